"""Ray actor shells for the two pools. All behaviour lives in workers.shell.worker.EngineWorker.

The shells add what only Ray knows: the node the actor landed on and that node's IP, which the
KV transport per pair of workers needs (`WorkerConfig.node_id`, `host`), and they undo Ray's
niceness (see `normal_priority`).

They are also what the driver (`baton serve`, which starts Ray and runs the router) holds: Ray
reads an actor's remote methods off its class there, so this module imports nothing of the
engine (torch, transformers, xgrammar, triton). Each actor imports it in its own process, in its
constructor, and every remote method hands the call to its EngineWorker unchanged.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from common.lora import LoRAModuleSpec
from common.net import free_port
from common.protocol import (
    KVEndpoint,
    KVReservation,
    RouterClaim,
    WorkerHeartbeat,
    WorkerOutput,
    WorkerReady,
    WorkerStats,
)
from common.request import AbortRequest, PrefillRequest, ReserveRequest, StartDecodeRequest, SubmitRequest
from common.roles import Role
from common.sampling_params import SamplingParams
from common.transports import PeerLink
from workers.config import WorkerConfig

if TYPE_CHECKING:  # kvtransfer loads torch; these are only annotations here
    from kvtransfer import TransferResult


log = logging.getLogger(__name__)


def normal_priority() -> int:
    """Every thread of this process back to niceness 0; returns how many threads were raised.

    Ray starts its worker processes at niceness 15 (its `worker_niceness`), so that its own daemons
    stay responsive; for a serving worker that means any normal process on the host (a log
    shipper, a neighbour, a benchmark client) takes the worker's core first and streams stall.
    Linux keeps a niceness per thread, and Ray's call threads exist before the constructor runs,
    so each thread is set. Lowering niceness needs CAP_SYS_NICE (root in a container has it);
    without it the workers stay at Ray's niceness, with a warning that says how to avoid it."""
    raised = 0
    for task in os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else []:
        tid = int(task)
        try:
            if os.getpriority(os.PRIO_PROCESS, tid) > 0:
                os.setpriority(os.PRIO_PROCESS, tid, 0)
                raised += 1
        except ProcessLookupError:  # the thread ended meanwhile
            continue
        except PermissionError:
            log.warning(
                "this worker runs at niceness %d (Ray's worker_niceness) and may not lower it: start the "
                "Ray nodes with RAY_worker_niceness=0 so other processes on the host cannot stall its steps",
                os.getpriority(os.PRIO_PROCESS, tid),
            )
            break
    return raised


def placed(config: WorkerConfig) -> WorkerConfig:
    """`config` with this actor's Ray node id and node IP filled in."""
    return replace(config, node_id=ray.get_runtime_context().get_node_id(), host=ray.util.get_node_ip_address())


class WorkerActor:
    """One pool's worker as a Ray actor: checks its role, builds its EngineWorker, forwards each call.

    The methods are common.worker_api.WorkerAPI's, as EngineWorker has them (Ray checks a call's
    arguments against them in the caller; tests/unit/test_worker_api.py holds all three equal)."""

    ROLE: Role

    def __init__(self, config: WorkerConfig) -> None:
        if config.role != self.ROLE:
            raise ValueError(f"{type(self).__name__} needs role {self.ROLE.value!r}, got {config.role!r}")
        normal_priority()  # before the engine's threads start: they inherit it
        # Here, not at the top: the engine loads torch, transformers, xgrammar and triton, which
        # only the actor's process needs (the driver holds this class and stays without them).
        from workers.shell.worker import EngineWorker

        config = placed(config)
        if config.tp_size == 1:
            self.worker = EngineWorker(config)
            return
        config = replace(config, tp_init_method=f"tcp://{config.host}:{free_port(config.host)}")
        followers = RayRankFollowers.start(config)
        self.worker = EngineWorker(config, followers=followers)
        followers.watch()

    def ready(self) -> WorkerReady:
        return self.worker.ready()

    def endpoint(self) -> KVEndpoint:
        return self.worker.endpoint()

    def connect_peer(self, endpoint: KVEndpoint) -> str:
        return self.worker.connect_peer(endpoint)

    def kv_links(self) -> list[PeerLink]:
        return self.worker.kv_links()

    def submit(self, request: SubmitRequest) -> None:
        return self.worker.submit(request)

    def reserve(self, request: ReserveRequest) -> KVReservation | None:
        return self.worker.reserve(request)

    def prefill(self, request: PrefillRequest) -> None:
        return self.worker.prefill(request)

    def start_decode(self, request: StartDecodeRequest) -> None:
        return self.worker.start_decode(request)

    def abort(self, request: AbortRequest) -> bool:
        return self.worker.abort(request)

    def compile_grammar(self, params: SamplingParams) -> None:
        return self.worker.compile_grammar(params)

    def load_lora_adapter(self, spec: LoRAModuleSpec) -> None:
        return self.worker.load_lora_adapter(spec)

    def unload_lora_adapter(self, name: str) -> bool:
        return self.worker.unload_lora_adapter(name)

    def poll_outputs(self, timeout_s: float = 0.05, router: RouterClaim | None = None) -> list[WorkerOutput]:
        return self.worker.poll_outputs(timeout_s, router)

    def renew_lease(self, router: RouterClaim) -> None:
        return self.worker.renew_lease(router)

    def heartbeat(self, router: RouterClaim | None = None) -> WorkerHeartbeat:
        return self.worker.heartbeat(router)

    def stats(self) -> WorkerStats:
        return self.worker.stats()

    def shutdown(self) -> None:
        return self.worker.shutdown()


class TPRankActor:
    """A non-zero rank of a tensor-parallel worker (workers.tp_rank.TPRankWorker) as a Ray actor."""

    def __init__(self, config: WorkerConfig, rank: int) -> None:
        normal_priority()
        from workers.parallel.rank import TPRankWorker  # in the actor's process only, as EngineWorker above

        self.rank = TPRankWorker(config, rank)

    def endpoint(self) -> KVEndpoint:
        return self.rank.endpoint()

    def pid(self) -> int:
        return self.rank.pid()

    def connect_peer(self, peers: list[KVEndpoint]) -> list:
        return self.rank.connect_peer(peers)

    def expect(self, request_id: str, block_ids: list[int], timeout_s: float) -> None:
        return self.rank.expect(request_id, block_ids, timeout_s)

    def wait(self, request_id: str) -> TransferResult:
        return self.rank.wait(request_id)

    def send(
        self,
        peers: list[KVEndpoint],
        src_block_ids: list[int],
        dst_block_ids: list[int],
        request_id: str,
        timeout_s: float,
    ) -> list:
        return self.rank.send(peers, src_block_ids, dst_block_ids, request_id, timeout_s)

    def abort(self, request_id: str) -> None:
        return self.rank.abort(request_id)

    def wait_stopped(self, timeout_s: float | None = None) -> bool:
        return self.rank.wait_stopped(timeout_s)

    def shutdown(self) -> None:
        return self.rank.shutdown()


class RayRankFollowers:
    """Ranks 1..N-1 of this actor's worker as Ray actors in the bundles 1..N-1 of its placement
    group (one node: the group was made STRICT_PACK), owned by this actor: they die with it, and a
    restarted rank 0 starts new ones. Implements workers.worker.RankFollowers."""

    def __init__(self, handles: list) -> None:
        self.handles = handles
        self._closing = threading.Event()
        self._pids: list[int] | None = None

    @classmethod
    def start(cls, config: WorkerConfig) -> RayRankFollowers:
        group = ray.util.get_current_placement_group()
        remote = threaded_actor_class(TPRankActor)
        handles = []
        for rank in range(1, config.tp_size):
            if group is not None and rank < len(group.bundle_specs):
                bundle = group.bundle_specs[rank]
                options = {
                    "num_cpus": bundle.get("CPU", 0),
                    "num_gpus": bundle.get("GPU", 0),
                    "scheduling_strategy": PlacementGroupSchedulingStrategy(group, rank),
                }
            else:  # not placed by Baton's launcher (tests): beside it, without resources
                options = {"num_cpus": 0}
            handles.append(remote.options(**options).remote(config, rank))
        return cls(handles)

    def watch(self) -> None:
        """End this process when a rank's steps end or its actor dies, unless this worker is
        shutting down: the group cannot step without it, and Ray restarts the whole worker (its
        requests migrate meanwhile)."""

        def wait_for_a_loss() -> None:
            refs = [h.wait_stopped.remote() for h in self.handles]
            ray.wait(refs, num_returns=1, timeout=None)
            self.lost(RuntimeError("a rank's actor stopped"))

        threading.Thread(target=wait_for_a_loss, name="tp-ranks-watch", daemon=True).start()

    def lost(self, exc: Exception) -> None:
        # Whichever notices first, this watch or rank 0's next step: a step's failure must not end
        # the requests (their streams would stop short); the restart moves them instead.
        if not self._closing.is_set():
            log.error("a rank of this tensor-parallel worker stopped (%s); the worker restarts as a whole", exc)
            os.kill(os.getpid(), signal.SIGKILL)

    def endpoints(self) -> list[KVEndpoint]:
        return ray.get([h.endpoint.remote() for h in self.handles])

    def pids(self) -> list[int]:
        if self._pids is None:  # asked with every heartbeat; a rank's process never changes (a new one is a new group)
            self._pids = ray.get([h.pid.remote() for h in self.handles])
        return self._pids

    def connect(self, peers: Sequence[KVEndpoint]) -> None:
        ray.get([h.connect_peer.remote(list(peers)) for h in self.handles])

    def expect(self, request_id: str, block_ids: list[int], timeout_s: float) -> None:
        ray.get([h.expect.remote(request_id, block_ids, timeout_s) for h in self.handles])

    def wait(self, request_id: str) -> list[TransferResult]:
        return ray.get([h.wait.remote(request_id) for h in self.handles])

    def send(
        self,
        peers: Sequence[KVEndpoint],
        src_block_ids: list[int],
        dst_block_ids: list[int],
        request_id: str,
        timeout_s: float,
    ):
        refs = [h.send.remote(list(peers), src_block_ids, dst_block_ids, request_id, timeout_s) for h in self.handles]
        return lambda: [link for links in ray.get(refs) for link in links]

    def abort(self, request_id: str) -> None:
        try:  # called on the engine thread too (a router's lease ran out): a lost rank must not end it
            ray.get([h.abort.remote(request_id) for h in self.handles])
        except ray.exceptions.RayError as exc:  # the rank is gone; watch() restarts the whole worker
            log.warning("could not abort %s on the other ranks: %r", request_id, exc)

    def closing(self) -> None:
        self._closing.set()

    def shutdown(self) -> None:
        self._closing.set()
        try:
            ray.get([h.shutdown.remote() for h in self.handles], timeout=15)
        except (ray.exceptions.RayError, TimeoutError) as exc:  # a rank already gone has nothing to close
            log.warning("the other ranks did not confirm their shutdown: %r", exc)


class PrefillWorker(WorkerActor):
    """Runs prompts to their first token and pushes their KV blocks to decode workers."""

    ROLE = Role.PREFILL


class DecodeWorker(WorkerActor):
    """Receives KV blocks, decodes in a continuous batch, and can prefill locally."""

    ROLE = Role.DECODE


# Actor methods block (long polls, waits for first tokens), so each actor serves calls on a pool
# of threads; the engine itself runs on its own thread.
ACTOR_MAX_CONCURRENCY = 64


def threaded_actor_class(cls: type) -> Any:
    """cls as a Ray actor class serving calls on ACTOR_MAX_CONCURRENCY threads."""
    threads = ACTOR_MAX_CONCURRENCY
    return ray.remote(max_concurrency=threads)(cls)  # type: ignore[call-overload]  # an actor option Ray's stubs omit


def actor_class(role: Role) -> Any:
    return threaded_actor_class(PrefillWorker if role == Role.PREFILL else DecodeWorker)
