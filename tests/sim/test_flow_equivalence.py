"""The router's executor and the simulator's run the same request flow, faults included.

One request goes through `router.ray_backend.RayBackend` over fake Ray actors
(tests/routing/fake_actors.py) and through `cluster.sim.simulator.Simulator` over simulated workers,
with the same random script of events: outputs, a decode worker lost or drained after some of them,
a prefill worker that dies or whose handoff fails, a KV load that fails its check, a client that goes
away. Every call of a `RequestFlow` handler is recorded (the state it leaves and the commands it
returns, with what depends on timing and sizes left out), and both executors must produce the same
sequence. The oracle is the other executor: any lifecycle either kept outside the flow would show
as a difference.
"""

from __future__ import annotations

import asyncio
import functools
import random
from dataclasses import dataclass, field

import pytest
from ray.exceptions import ActorDiedError

from cluster.sim.costs import FittedCostModel, ServingOverheads
from cluster.sim.engine import EngineSettings
from cluster.sim.simulator import ClusterSpec, Simulator
from cluster.sim.workload import Client, SimRequest, Workload
from common.sampling_params import SamplingParams
from router.backend import BackendError, RouteDecision
from router.flow import FlowLimits, RequestFlow
from router.flow_commands import (
    Abort,
    Count,
    Emit,
    Fail,
    MigrationGap,
    Prefill,
    QueueTokens,
    Reserve,
    StartDecode,
    Submit,
    WaitForDecode,
)
from router.pools import WorkerPools
from router.ray_backend import RayBackend
from tests.routing.fake_actors import FakeActor, make_request

PROMPT = tuple(range(1000, 1040))  # 40 tokens: two full blocks and a part
OUTPUT_LEN = 8
RID = "q"
HANDLERS = (
    "start",
    "on_reserved",
    "on_worker_output",
    "on_prefill_done",
    "on_prefill_failed",
    "on_output",
    "on_worker_lost",
    "on_drain",
    "on_wait",
    "on_submit_refused",
    "on_kv_load_failed",
    "on_bad_input",
    "on_error",
    "on_deadline",
    "on_client_gone",
)


@dataclass(frozen=True)
class Script:
    """One request's events: its route, what is set wrong before it starts, and what happens after
    its k-th output (k -> action)."""

    remote: bool
    prefill_fails: bool = False  # the first prefill's handoff fails (PrefillFailed)
    prefill_dies: bool = False  # the prefill worker dies while the prompt is on it
    kv_load_fails: bool = False  # the decode worker finds the pushed KV bad (policy fail)
    after: dict[int, str] = field(default_factory=dict)  # output count -> "lose" | "drain" | "leave"

    @staticmethod
    def draw(rng: random.Random) -> Script:
        remote = rng.random() < 0.75
        prefill_fault = rng.choice(["", "", "fails", "dies"]) if remote else ""
        kv_load_fails = remote and not prefill_fault and rng.random() < 0.2
        after: dict[int, str] = {}
        if not kv_load_fails:
            k = rng.randint(1, OUTPUT_LEN - 2)
            after[k] = rng.choice(["lose", "drain", "leave", "none"])
            if after[k] in ("lose", "drain") and rng.random() < 0.4:
                after[rng.randint(k + 1, OUTPUT_LEN - 1)] = "leave"  # the client leaves after the move
        return Script(remote, prefill_fault == "fails", prefill_fault == "dies", kv_load_fails, after)

    @property
    def route(self) -> RouteDecision:
        return RouteDecision("decode-0", "prefill-0" if self.remote else None)


def shape(command) -> tuple:
    """A command without what depends on timing, sizes or token values."""
    if isinstance(command, Emit):
        return ("Emit", len(command.output.token_ids), command.output.finished)
    if isinstance(command, Count):
        return ("Count", command.name)
    if isinstance(command, QueueTokens):
        return ("QueueTokens", command.worker_id, command.delta)
    if isinstance(command, (MigrationGap, WaitForDecode)):
        return (type(command).__name__,)
    if isinstance(command, Fail):
        return ("Fail", command.reason)
    if isinstance(command, Prefill):
        return ("Prefill", command.worker_id, command.decode_worker)
    if isinstance(command, Reserve):
        return ("Reserve", command.worker_id, command.attempt)
    if isinstance(command, Submit):
        resumed = None if command.resume is None else len(command.resume.output_token_ids)
        return ("Submit", command.worker_id, command.attempt, resumed)
    if isinstance(command, Abort):
        return ("Abort", command.worker_id, command.final, command.wait)
    if isinstance(command, StartDecode):
        return ("StartDecode", command.worker_id)
    raise AssertionError(f"unknown command {command!r}")


class Recorder:
    """Wraps RequestFlow's handlers (outermost calls only): records (state, commands) of each that
    changed something, and after each tells the script what happened."""

    def __init__(self, monkeypatch, react) -> None:
        self.steps: list[tuple[str, tuple]] = []
        self.outputs = 0
        self._depth = 0
        for name in HANDLERS:
            monkeypatch.setattr(RequestFlow, name, self._wrap(getattr(RequestFlow, name), name, react))

    def _wrap(self, handler, name, react):
        recorder = self

        @functools.wraps(handler)
        def wrapped(flow, *args, **kwargs):
            before = flow.state
            recorder._depth += 1
            try:
                commands = handler(flow, *args, **kwargs)
            finally:
                recorder._depth -= 1
            if recorder._depth == 0 and (commands or flow.state is not before):
                recorder.steps.append((flow.state.name, tuple(shape(c) for c in commands)))
                emitted = sum(1 for c in commands if isinstance(c, Emit))
                for _ in range(emitted):
                    recorder.outputs += 1
                    react("output", recorder.outputs)
                if name == "on_reserved" and any(isinstance(c, Prefill) for c in commands):
                    react("prefill_sent", 0)
            return commands

        return wrapped


def cost_model() -> FittedCostModel:
    coefficients = dict.fromkeys(FittedCostModel.COEFFICIENTS, 0.0) | {"c0": 0.01}
    return FittedCostModel(coefficients, knee=1, kv_bytes_per_token=1000, kv_capacity_tokens=1 << 16)


def run_simulated(script: Script, monkeypatch) -> list[tuple[str, tuple]]:
    spec = ClusterSpec(2, 2, EngineSettings(block_size=16), drain_timeout_s=0.0, limits=FlowLimits(migration_wait_s=1))
    sim = Simulator(spec, cost_model(), ServingOverheads(heartbeat_s=0.05), record_itl=False)
    monkeypatch.setattr(sim.policy, "choose", lambda prompt, infos, context=None: script.route)
    sim.workers["prefill-0"].fail_prefills = script.prefill_fails
    sim.workers["decode-0"].fail_kv_loads = script.kv_load_fails
    state = {"decode": "decode-0"}

    def react(event: str, k: int) -> None:
        if event == "prefill_sent" and script.prefill_dies:
            sim.loop.after(0.0, sim.kill_worker, "prefill-0")
        action = script.after.get(k) if event == "output" else None
        flight = sim.executor.flights.get(RID)
        decode = flight.flow.decode_worker if flight is not None and flight.flow is not None else state["decode"]
        if action == "lose":
            sim.loop.after(0.0, sim.kill_worker, decode)
        elif action == "drain":
            sim.loop.after(0.0, sim.drain_worker, "decode", decode)
        elif action == "leave":
            sim.loop.after(0.0, sim.end_request, RID)

    recorder = Recorder(monkeypatch, react)
    sim.run(Workload((Client("c", ((SimRequest(RID, PROMPT, OUTPUT_LEN),),), 1),)))
    return recorder.steps


def run_served(script: Script, monkeypatch) -> list[tuple[str, tuple]]:
    async def main() -> list[tuple[str, tuple]]:
        actors = {
            w: FakeActor(w, w.split("-")[0], step_s=0.02) for w in ("prefill-0", "prefill-1", "decode-0", "decode-1")
        }
        actors["prefill-0"].fail_prefills = script.prefill_fails
        actors["decode-0"].fail_kv_loads = script.kv_load_fails
        pools = WorkerPools(list(actors.values()), health_interval_s=0.05, health_timeout_s=1.0, poll_timeout_s=0.02)
        backend = RayBackend(pools, FlowLimits(migration_wait_s=1))
        loop = asyncio.get_running_loop()
        tasks: list[asyncio.Task] = []

        def kill(worker_id: str) -> None:
            actors[worker_id].kill()
            pools.mark_down(pools.get(worker_id), ActorDiedError())  # as the health loop finds it

        def react(event: str, k: int) -> None:
            if event == "prefill_sent" and script.prefill_dies:
                loop.call_soon(kill, "prefill-0")
            action = script.after.get(k) if event == "output" else None
            live = pools.requests.get(RID)
            decode = live.flow.decode_worker if live is not None else "decode-0"
            if action == "lose":
                loop.call_soon(kill, decode)
            elif action == "drain":
                tasks.append(loop.create_task(pools.drain_worker(decode, 0.0)))
            elif action == "leave":
                tasks.append(loop.create_task(backend.abort(RID)))

        recorder = Recorder(monkeypatch, react)
        request = make_request(RID, list(PROMPT), SamplingParams(max_tokens=OUTPUT_LEN, temperature=0), script.route)
        try:
            backend.workers()
            async for _ in backend.generate(request):
                pass
        except BackendError:
            pass  # a failed request: its steps are recorded
        await asyncio.gather(*tasks)
        await backend.close()
        return recorder.steps

    return asyncio.run(main())


SCRIPTS = [Script.draw(random.Random(seed)) for seed in range(40)]


@pytest.mark.parametrize("script", SCRIPTS, ids=[f"seed{i}" for i in range(len(SCRIPTS))])
def test_both_executors_run_the_same_states_and_commands(script, monkeypatch):
    served = run_served(script, monkeypatch)
    monkeypatch.undo()
    simulated = run_simulated(script, monkeypatch)
    assert served == simulated
    assert served[-1][0] in ("FINISHED", "ABORTED", "FAILED")


def test_the_scripts_cover_every_kind_of_event():
    """The drawn scripts include each fault, and both routes (a script set that lost one would pass
    without testing it)."""
    kinds = {a for s in SCRIPTS for a in s.after.values()}
    assert {"lose", "drain", "leave"} <= kinds
    assert any(s.prefill_fails for s in SCRIPTS) and any(s.prefill_dies for s in SCRIPTS)
    assert any(s.kv_load_fails for s in SCRIPTS)
    assert any(s.remote for s in SCRIPTS) and any(not s.remote for s in SCRIPTS)


def test_a_difference_in_one_executor_is_seen(monkeypatch):
    """The comparison can fail: a simulated worker that refuses prefills where the served one does
    not gives another sequence."""
    script = Script(remote=True)
    served = run_served(script, monkeypatch)
    monkeypatch.undo()
    simulated = run_simulated(Script(remote=True, prefill_fails=True), monkeypatch)
    assert served != simulated
