"""Cluster simulator: a Baton deployment as a discrete-event simulation that runs the router's own
routing policy and prefix index and the workers' own scheduler and block manager (see docs/sim.md)."""

from cluster.sim.costs import (
    GPUS,
    LINKS,
    MODELS,
    FittedCostModel,
    LinkModel,
    RooflineCostModel,
    ServingOverheads,
    StepShape,
    load_cost_model,
)
from cluster.sim.engine import EngineSettings
from cluster.sim.metrics import SLO, SimResult
from cluster.sim.simulator import ClusterSpec, Simulator, simulate
from cluster.sim.workload import AdapterMix, Client, LengthDist, SimRequest, Workload, WorkloadSpec, read_trace

__all__ = [
    "GPUS",
    "LINKS",
    "MODELS",
    "SLO",
    "AdapterMix",
    "Client",
    "ClusterSpec",
    "EngineSettings",
    "FittedCostModel",
    "LengthDist",
    "LinkModel",
    "RooflineCostModel",
    "ServingOverheads",
    "SimRequest",
    "SimResult",
    "Simulator",
    "StepShape",
    "Workload",
    "WorkloadSpec",
    "load_cost_model",
    "read_trace",
    "simulate",
]
