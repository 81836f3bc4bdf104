"""Every worker satisfies the one worker interface, `common.worker_api.WorkerAPI`: the engine worker,
its Ray actor shells and the simulated worker take the same calls with the same parameters (names,
kinds, defaults, annotations) and answer with the same types; the typed client mirrors them. The
oracle is the protocol class itself, read with `inspect`."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from cluster.sim.engine import SimWorker
from common.worker_api import WORKER_METHODS, WorkerAPI
from common.worker_client import WorkerClient

Signature = list[tuple[str, object, object, object]]


def parameters(fn) -> Signature:
    """(name, kind, default, annotation) of each parameter but self. Without `_ray_trace_ctx`: once
    a class was handed to ray.remote in this process, Ray's tracing hook adds that keyword in place."""
    return [
        (p.name, p.kind, p.default, p.annotation)
        for p in list(inspect.signature(fn).parameters.values())[1:]
        if p.name != "_ray_trace_ctx"
    ]


def mismatches(cls: type, *, returns: bool = True, only_these: bool = False) -> list[str]:
    """How `cls` differs from WorkerAPI: missing calls, other parameters, other return types, and
    (`only_these`) public methods the protocol does not have."""
    found = []
    for name in WORKER_METHODS:
        fn = getattr(cls, name, None)
        if fn is None or not callable(fn):
            found.append(f"{name}: missing")
            continue
        want = getattr(WorkerAPI, name)
        if parameters(fn) != parameters(want):
            found.append(f"{name}: parameters {parameters(fn)} != {parameters(want)}")
        if returns and inspect.signature(fn).return_annotation != inspect.signature(want).return_annotation:
            found.append(
                f"{name}: returns {inspect.signature(fn).return_annotation} "
                f"!= {inspect.signature(want).return_annotation}"
            )
    if only_these:
        public = {n for n, _ in inspect.getmembers(cls, inspect.isfunction) if not n.startswith("_")}
        found += [f"{name}: not in the protocol" for name in sorted(public - set(WORKER_METHODS))]
    return found


def implementations() -> dict[str, type]:
    from workers.shell.actors import DecodeWorker, PrefillWorker, actor_class
    from workers.shell.worker import EngineWorker

    for role in ("prefill", "decode"):
        actor_class(role)  # as the driver does: Ray's hook then edits the shells' methods in place
    return {
        "EngineWorker": EngineWorker,
        "PrefillWorker": PrefillWorker,
        "DecodeWorker": DecodeWorker,
        "SimWorker": SimWorker,
    }


@pytest.mark.parametrize("name", ["EngineWorker", "PrefillWorker", "DecodeWorker", "SimWorker"])
def test_each_worker_takes_every_call_of_the_protocol_with_its_signature(name):
    assert mismatches(implementations()[name]) == []


@pytest.mark.parametrize("name", ["PrefillWorker", "DecodeWorker"])
def test_the_actor_shells_expose_nothing_beyond_the_protocol(name):
    """What Ray makes remote on a shell is exactly the protocol: no call a client could not name."""
    assert mismatches(implementations()[name], only_these=True) == []


def test_the_typed_client_mirrors_every_call():
    """Same names and parameters; it answers with Ray's awaitable (ObjectRef) of the protocol's type."""
    assert mismatches(WorkerClient, returns=False, only_these=True) == []
    for name in WORKER_METHODS:
        want = str(inspect.signature(getattr(WorkerAPI, name)).return_annotation)
        assert str(inspect.signature(getattr(WorkerClient, name)).return_annotation) == f"ObjectRef[{want}]", name


def test_the_checker_finds_a_missing_call_another_parameter_and_an_extra_method():
    class Drifted:
        def ready(self): ...

        def submit(self, request_id, prompt) -> None: ...  # the positional arguments the records replaced

        def extra(self) -> None: ...

    found = mismatches(Drifted, only_these=True)
    assert any(f.startswith("endpoint: missing") for f in found)
    assert any(f.startswith("submit: parameters") for f in found)
    assert any(f.startswith("ready: returns") for f in found)
    assert "extra: not in the protocol" in found


def test_a_simulated_worker_is_a_worker_at_run_time():
    from cluster.sim.costs import FittedCostModel
    from cluster.sim.engine import EngineSettings
    from cluster.sim.events import EventLoop
    from common.roles import Role

    coefficients = dict.fromkeys(FittedCostModel.COEFFICIENTS, 0.0) | {"c0": 0.01}
    cost = FittedCostModel(coefficients, knee=1, kv_bytes_per_token=1000, kv_capacity_tokens=1 << 16)
    assert isinstance(SimWorker(EventLoop(), "decode-0", Role.DECODE, cost, EngineSettings()), WorkerAPI)


# -- who may call a worker ----------------------------------------------------------------------------
REPO = Path(__file__).resolve().parents[2]
# The two modules that may: the typed client, and the Ray shell's client of a worker's own
# tensor-parallel ranks (RayRankFollowers; TPRankActor's calls share some names, they are not a worker's).
MAY_CALL_REMOTE = {"common/worker_client.py", "workers/shell/actors.py"}
SCANNED = ("common", "router", "workers", "kvtransfer", "kernels", "cluster", "testkit", "bench", "tests")


def remote_worker_calls(source: str) -> list[tuple[int, str]]:
    """(line, method) of each `<something>.<worker method>.remote(...)` in `source`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        func = node.func if isinstance(node, ast.Call) else None
        if isinstance(func, ast.Attribute) and func.attr == "remote" and isinstance(func.value, ast.Attribute):
            if func.value.attr in WORKER_METHODS:
                found.append((node.lineno, func.value.attr))
    return found


def test_the_scan_finds_a_worker_call_by_remote():
    source = "ray.get(handle.stats.remote())\nactor.options(num_cpus=1).remote(config)\nx.ping.remote()\n"
    assert remote_worker_calls(source) == [(1, "stats")]


def test_no_worker_method_is_called_with_remote_outside_the_typed_client():
    found = []
    for package in SCANNED:
        for path in sorted((REPO / package).rglob("*.py")):
            where = str(path.relative_to(REPO))
            if where not in MAY_CALL_REMOTE:
                found += [f"{where}:{line} .{method}.remote(" for line, method in remote_worker_calls(path.read_text())]
    assert found == [], "call workers through common.worker_client.WorkerClient:\n" + "\n".join(found)
