"""Worker cost models: how long one engine step takes, how many KV tokens fit, how fast KV moves.

A step is summarised by its `StepShape` (what the real scheduler put in the batch). Two models
turn a shape into seconds (formulas written out in docs/sim.md):

- `FittedCostModel` (cluster/sim/fitted_costs.py): coefficients fitted by `bench/profile_costs.py`
  from real engine steps on this machine (least squares over measured steps, with a floor below
  which a step costs as much as `knee` tokens: streaming the weights once);
- `RooflineCostModel` (cluster/sim/roofline.py): a GPU (H100, H200) running a model shape (8B,
  70B, ...) in bf16 or FP8, step time = max(FLOPs / compute, bytes / HBM bandwidth) per
  tensor-parallel rank, plus the all-reduces and a fixed per-step overhead.

This module owns the rest of a model profile and reads profiles: `LinkModel` gives KV transfer
time from bytes: latency + bytes / bandwidth (NVLink, InfiniBand, Ethernet presets, or this
machine's shared memory as measured by bench/kv_transfer.py); `ServingOverheads` the times outside
the engine steps; `load_cost_model` reads a profile file (bench/profile_costs.py writes them). The
models' names are importable from here too.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from cluster.sim.fitted_costs import FittedCostModel, TensorParallelCost, fit_cost_model
from cluster.sim.roofline import GPUS, MODELS, GpuSpec, ModelShape, RooflineCostModel
from cluster.sim.step_shape import CostModel, StepShape

__all__ = [
    "GPUS",
    "LINKS",
    "MODELS",
    "CostModel",
    "FittedCostModel",
    "GpuSpec",
    "LinkModel",
    "ModelShape",
    "RooflineCostModel",
    "ServingOverheads",
    "StepShape",
    "TensorParallelCost",
    "cost_model_from_dict",
    "fit_cost_model",
    "load_cost_model",
]


@dataclass(frozen=True)
class ServingOverheads:
    """Times outside the engine steps, measured on the serving path (seconds).

    router_s: request arrival to routing done (HTTP, tokenisation, decision);
    rpc_s: one router -> worker call (Ray), each way together;
    stream_s: a worker's output to the client (long-poll, SSE);
    heartbeat_s: how often the router refreshes worker stats and KV events.
    """

    router_s: float = 0.002
    rpc_s: float = 0.001
    stream_s: float = 0.0015
    heartbeat_s: float = 2.0

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if not value >= 0:
                raise ValueError(f"overhead {name} must be >= 0 seconds, got {value!r}")


@dataclass(frozen=True)
class LinkModel:
    """KV transfer between a prefill and a decode worker: latency + bytes / bandwidth."""

    name: str
    bandwidth_bytes_s: float
    latency_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.bandwidth_bytes_s > 0 or self.latency_s < 0:
            raise ValueError(f"link {self.name}: bandwidth must be > 0 and latency >= 0")

    def transfer_time(self, nbytes: int) -> float:
        return self.latency_s + nbytes / self.bandwidth_bytes_s if nbytes > 0 else 0.0


# Per direction, per GPU; effective rather than line rate where a transfer cannot reach it.
LINKS: dict[str, LinkModel] = {
    "nvlink": LinkModel("nvlink", 450e9 * 0.8, 10e-6),  # NVLink 4: 900 GB/s both ways
    "infiniband": LinkModel("infiniband", 50e9 * 0.8, 5e-6),  # one 400 Gb/s NDR NIC per GPU
    "ethernet": LinkModel("ethernet", 12.5e9 * 0.7, 30e-6),  # 100 Gb/s, TCP
    "cpu-shm": LinkModel("cpu-shm", 0.9e9, 60e-6),  # bench/kv_transfer.py on this machine
}


def cost_model_from_dict(spec: dict) -> CostModel:
    """A cost model from its JSON form (a profile written by bench/profile_costs.py, or a roofline spec)."""
    kind = spec.get("kind")
    if kind == "fitted":
        return FittedCostModel(
            spec["coefficients"],
            spec["knee"],
            spec["kv_bytes_per_token"],
            spec["kv_capacity_tokens"],
            spec.get("gpus_per_worker", 1),
        )
    if kind == "roofline":
        gpu, model = spec.get("gpu", "H200"), spec.get("model", "llama-8b")
        if gpu not in GPUS:
            raise ValueError(f"unknown gpu {gpu!r}; known: {sorted(GPUS)}")
        if model not in MODELS:
            raise ValueError(f"unknown model {model!r}; known: {sorted(MODELS)}")
        extra = {
            k: spec[k]
            for k in (
                "weight_dtype",
                "kv_dtype",
                "tp",
                "compute_eff",
                "bandwidth_eff",
                "memory_util",
                "step_overhead_s",
            )
            if k in spec
        }
        return RooflineCostModel(GPUS[gpu], MODELS[model], **extra)
    raise ValueError(f"cost model kind must be 'fitted' or 'roofline', got {kind!r}")


def load_cost_model(path: str | Path) -> tuple[CostModel, ServingOverheads, LinkModel]:
    """A model profile file: {"cost_model": {...}, "overheads": {...}, "link": "cpu-shm" | {...}}."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read model profile {str(path)!r}: {exc}") from None
    spec = data.get("cost_model", data)
    overheads = ServingOverheads(**data.get("overheads", {}))
    link = data.get("link", "nvlink")
    if isinstance(link, str):
        if link not in LINKS:
            raise ValueError(f"unknown link {link!r}; known: {sorted(LINKS)}")
        link = LINKS[link]
    else:
        link = LinkModel(**link)
    return cost_model_from_dict(spec), overheads, link
