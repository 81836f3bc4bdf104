"""Placing the two pools on a Ray cluster: what each worker asks Ray for, spawning workers, and
the deadline within which Ray must place them.

Per pool (`resolve_pool`), from the configuration and the cluster's nodes as Ray reports them:

- GPUs: `gpus_per_worker`, or 1 when any node has GPUs (whatever the transport flag says);
  a worker given GPUs runs its engine and KV cache on CUDA.
- CPUs: `threads_per_worker` when given (the engine runs that many threads), else none.
  Without it on the CPU the workers split the machine's cores between them
  (`BatonConfig.worker_threads`: cores // workers threads each, all at normal priority), so a
  decode worker always has its own share and a long prompt's prefill cannot take it: streams
  keep their pace beside a long prompt, whatever else runs on the host. A CPU decode worker
  borrows the cores the other processes leave idle, step by step, and gives them back as soon
  as they are wanted (workers.shell.elastic_threads). Giving a long prefill
  every core (with the decode worker at idle priority, or at a lower priority than the
  prefill's threads) was measured and dropped: a busy host stalled the streams, or starved the
  prefill (docs/performance.md, "Sharing a CPU host").
- the pool's custom resource (`baton_prefill` / `baton_decode`), 1 per worker, when a node
  offers it: that is what pins each pool to its node type on a `ray up` or KubeRay cluster.
- a Ray label selector (`prefill_node_labels` / `decode_node_labels`), when given.

`spawn_worker` starts one worker actor with those options; the launcher uses it for the initial
pools and the pool manager for workers added later. `wait_placed` watches Ray's actor table
until every worker has a process on some node; past the deadline it raises `PlacementError`
naming the resource no node can give and what every node offers, instead of leaving an actor
pending forever. `connect_pairs` runs the start-up handshake of every prefill/decode pair and
reports the KV backend each pair uses.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from cluster.config import BatonConfig
from common.roles import ROLES, Role
from common.transports import Place, offered_kinds
from common.worker_client import WorkerClient
from workers.config import WorkerConfig
from workers.shell.actors import actor_class

log = logging.getLogger("baton.placement")

# Resources every Ray node reports that say nothing about where a worker may go.
_BOOKKEEPING = ("memory", "object_store_memory")
_POLL_S = 0.25
_REPORT_EVERY_S = 10.0


class PlacementError(ValueError):
    """A pool could not be placed within its deadline; the message says what is missing."""


@dataclass(frozen=True)
class NodeOffer:
    """One alive Ray node as placement sees it."""

    node_id: str
    ip: str
    total: dict[str, float]
    available: dict[str, float]
    labels: dict[str, str]

    def describe(self) -> str:
        names = sorted(
            k for k in self.total if not k.startswith(("node:", "accelerator_type:")) and k not in _BOOKKEEPING
        )
        offers = ", ".join(f"{k} {_num(self.available.get(k, 0.0))}/{_num(self.total[k])} free" for k in names)
        labels = {k: v for k, v in self.labels.items() if not k.startswith("ray.io/")}
        return f"{self.node_id[:12]} ({self.ip}): {offers or 'nothing'}" + (f", labels {labels}" if labels else "")


def cluster_nodes() -> list[NodeOffer]:
    """The alive nodes of the Ray cluster this process is connected to."""
    available = ray._private.state.available_resources_per_node()
    return [
        NodeOffer(
            n["NodeID"],
            n["NodeManagerAddress"],
            dict(n["Resources"]),
            dict(available.get(n["NodeID"], {})),
            dict(n.get("Labels") or {}),
        )
        for n in ray.nodes()
        if n["Alive"]
    ]


@dataclass(frozen=True)
class PoolPlacement:
    """What every worker of one pool asks Ray for."""

    role: Role
    num_cpus: float
    num_gpus: float
    resources: dict[str, float] = field(default_factory=dict)  # custom resources
    label_selector: dict[str, str] = field(default_factory=dict)

    @property
    def device(self) -> str:
        return "cuda" if self.num_gpus > 0 else "cpu"

    def demand(self) -> dict[str, float]:
        """The resources one worker needs, by Ray's names."""
        out = {"CPU": self.num_cpus, "GPU": self.num_gpus, **self.resources}
        return {k: v for k, v in out.items() if v > 0}

    def ray_options(self) -> dict[str, Any]:
        options: dict[str, Any] = {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus}
        if self.resources:
            options["resources"] = dict(self.resources)
        if self.label_selector:
            options["label_selector"] = dict(self.label_selector)
        return options

    def describe(self) -> str:
        need = ", ".join(f"{k} {_num(v)}" for k, v in self.demand().items()) or "no resources"
        labels = ",".join(f"{k}={v}" for k, v in self.label_selector.items())
        return need + (f" on a node labelled {labels}" if labels else "")


def resolve_pool(config: BatonConfig, role: Role, nodes: list[NodeOffer]) -> PoolPlacement:
    """The placement of pool `role` on a cluster made of `nodes`."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {[r.value for r in ROLES]}, got {role!r}")
    p = config.placement
    gpus = p.gpus_per_worker
    if gpus is None:  # on a GPU cluster the workers run on GPUs, whatever the transport says
        gpus = 1.0 if any(n.total.get("GPU", 0) > 0 for n in nodes) else 0.0
    resource = p.resource(role)
    resources = {}
    if resource and any(n.total.get(resource, 0) > 0 for n in nodes):
        resources[resource] = 1.0
    elif resource:
        log.info("no node offers the resource %s: %s workers may land on any node", resource, role)
    cpus = float(p.threads_per_worker) if p.threads_per_worker else 0.0
    pool = PoolPlacement(role, cpus, float(gpus), resources, p.node_labels(role))
    offered_kinds(config.transport.kind, Place(device=pool.device))  # e.g. transport cpu with GPUs: say so now
    return pool


def private_ray_cpus(config: BatonConfig, machine_cpus: int) -> int:
    """CPUs to give a private Ray: the machine's, or more when the workers ask for more (their
    threads are the user's explicit choice; a private Ray should not refuse them)."""
    p = config.placement
    asked = (p.threads_per_worker or 0) * (p.prefill_workers + p.decode_workers)
    return max(machine_cpus, asked, 1)


@dataclass
class SpawnedWorker:
    """A worker actor that has been asked for; placed and ready come later."""

    worker_id: str  # "<role>-<index>"
    role: Role
    index: int
    handle: Any
    placement: PoolPlacement | None  # None: a stand-in that Ray did not place (tests)
    actor_name: str
    placement_group: Any = None  # a tensor-parallel worker's ranks' bundles (released with the worker)

    @property
    def client(self) -> WorkerClient:
        """The worker's calls (common.worker_api.WorkerAPI), typed."""
        return WorkerClient(self.handle)


def release_placement_group(worker: SpawnedWorker) -> None:
    """Give back a removed tensor-parallel worker's bundles (after its actor is ended)."""
    if worker.placement_group is not None:
        try:
            remove_placement_group(worker.placement_group)
        except Exception as exc:  # Ray already gone (shutdown): nothing is held any more
            log.debug("placement group of %s not removed: %r", worker.worker_id, exc)


def rank_bundles(placement: PoolPlacement, tp_size: int) -> list[dict[str, float]]:
    """The bundles of a worker of tp_size ranks: each rank's CPUs and GPUs, the pool's custom
    resource once (in rank 0's bundle: one per worker, as a node type offers it per worker).
    Ray refuses an empty bundle, so a rank that asks for nothing holds a hundredth of a CPU."""
    rank = {k: v for k, v in (("CPU", placement.num_cpus), ("GPU", placement.num_gpus)) if v > 0} or {"CPU": 0.01}
    return [{**rank, **placement.resources}] + [dict(rank) for _ in range(tp_size - 1)]


def worker_config(config: BatonConfig, role: Role, worker_id: str, placement: PoolPlacement) -> WorkerConfig:
    """The WorkerConfig of one worker. The model is passed as the user gave it, so each worker
    resolves it on its own node; the engine runs where the placement gives it GPUs."""
    engine = replace(config.worker_engine_config(), device=placement.device)
    return WorkerConfig(
        worker_id,
        role,
        config.model,
        engine,
        transport=config.transport.kind,
        transfer_timeout_s=config.transport.transfer_timeout_s,
        kv_load_failure_policy=config.transport.kv_load_failure_policy,
        tp_size=config.placement.tp_size(role),
        peer_tp_size=config.placement.tp_size(Role.DECODE if role == Role.PREFILL else Role.PREFILL),
    )


def spawn_worker(
    config: BatonConfig,
    role: Role,
    index: int,
    name_prefix: str = "baton",
    placement: PoolPlacement | None = None,
    **actor_options: Any,
) -> SpawnedWorker:
    """Start worker `<role>-<index>` as a Ray actor named `<name_prefix>-<role>-<index>`.

    `placement` defaults to the pool's placement on the cluster as it is now; `actor_options`
    go to Ray as they are (e.g. max_restarts). Returns at once: follow with `wait_placed`,
    then the worker's `ready()`, then `connect_pairs`.
    """
    placement = placement or resolve_pool(config, role, cluster_nodes())
    worker_id = f"{role}-{index}"
    name = f"{name_prefix}-{worker_id}"
    options = {**placement.ray_options(), "name": name, **actor_options}
    tp_size = config.placement.tp_size(role)
    group = None
    if tp_size > 1:
        # The ranks of a worker on one node (STRICT_PACK): rank 0 is this actor in bundle 0, and it
        # starts ranks 1..N-1 in the other bundles (workers.shell.actors.RayRankFollowers).
        bundles = rank_bundles(placement, tp_size)
        selector = [dict(placement.label_selector)] * tp_size if placement.label_selector else None
        group = placement_group(bundles, strategy="STRICT_PACK", bundle_label_selector=selector)
        options = {
            "num_cpus": bundles[0].get("CPU", 0),
            "num_gpus": bundles[0].get("GPU", 0),
            "resources": {k: v for k, v in bundles[0].items() if k not in ("CPU", "GPU")},
            "name": name,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(group, 0),
            **actor_options,
        }
    handle = actor_class(role).options(**options).remote(worker_config(config, role, worker_id, placement))
    return SpawnedWorker(worker_id, Role(role), index, handle, placement, name, group)


def actor_state(handle: Any) -> tuple[str, str | None]:
    """(Ray's state of the actor, its node id once it has a process there)."""
    info = ray._private.state.actors(handle._actor_id.hex())
    state = info.get("State", "UNKNOWN")
    # Ray fills in the worker process (pid, address) once the actor is placed, while its
    # constructor still runs (the state says PENDING_CREATION until the constructor returns).
    placed = state in ("ALIVE", "DEAD", "RESTARTING") or (info.get("Pid") or 0) > 0
    return state, (info.get("Address") or {}).get("NodeID") if placed else None


def wait_placed(workers: list[SpawnedWorker], timeout_s: float) -> dict[str, str]:
    """Worker id -> Ray node id once every worker has a process on a node (or has died, which
    its ready() reports). PlacementError after `timeout_s`, naming what is missing."""
    started = time.monotonic()
    placed: dict[str, str] = {}
    next_report = started + _REPORT_EVERY_S
    while True:
        for w in workers:
            if w.worker_id not in placed:
                state, node = actor_state(w.handle)
                if node is not None or state == "DEAD":
                    placed[w.worker_id] = node or ""
        waiting = [w for w in workers if w.worker_id not in placed]
        if not waiting:
            return placed
        now = time.monotonic()
        if now - started > timeout_s:
            raise PlacementError(unplaced_message(waiting, timeout_s, cluster_nodes()))
        if now >= next_report:
            log.warning(
                "waiting %.0f s for Ray to place %s (each needs %s)",
                now - started,
                ", ".join(w.worker_id for w in waiting),
                _needs(waiting[0]),
            )
            next_report = now + _REPORT_EVERY_S
        time.sleep(_POLL_S)


def _needs(worker: SpawnedWorker) -> str:
    """What the worker asked Ray for."""
    return worker.placement.describe() if worker.placement is not None else "no placement (a stand-in)"


def unplaced_message(waiting: list[SpawnedWorker], timeout_s: float, nodes: list[NodeOffer]) -> str:
    """Why the first waiting worker's pool cannot be placed, and what every node offers."""
    pool = waiting[0].placement
    if pool is None:  # a stand-in, which asked Ray for nothing
        return f"{', '.join(w.worker_id for w in waiting)} still not placed by Ray after {timeout_s:.0f} s"
    ids = [w.worker_id for w in waiting if w.role == pool.role]
    head = (
        f"the {pool.role} pool cannot be placed: {', '.join(ids)} still not placed by Ray after "
        f"{timeout_s:.0f} s; each needs {pool.describe()}"
    )
    offers = "; ".join(n.describe() for n in nodes) or "no alive nodes"
    return f"{head}. {lacking(pool, nodes)}. The cluster's nodes offer: {offers}"


def lacking(pool: PoolPlacement, nodes: list[NodeOffer]) -> str:
    """The resource (or label) that keeps `pool` off every node."""
    candidates = [n for n in nodes if labels_match(pool.label_selector, n.labels)]
    if not candidates:
        labels = ",".join(f"{k}={v}" for k, v in pool.label_selector.items())
        return f"Lacking: no node carries the labels {labels}"
    demand = pool.demand()
    missing = [
        f"{k} (needs {_num(v)}, the most any node offers is {_num(max(n.total.get(k, 0.0) for n in candidates))})"
        for k, v in demand.items()
        if not any(n.total.get(k, 0.0) >= v for n in candidates)
    ]
    if missing:
        return "Lacking: " + "; ".join(missing)
    whole = [n for n in candidates if all(n.total.get(k, 0.0) >= v for k, v in demand.items())]
    if not whole:
        return f"Lacking: no single node offers all of {pool.describe()}"
    busy = [k for k, v in demand.items() if not any(n.available.get(k, 0.0) >= v for n in whole)]
    return (
        "Lacking: " + ", ".join(busy) + " is all in use on the nodes that have it"
        if busy
        else "Ray has not placed it yet (the resources looked free when the deadline passed)"
    )


def labels_match(selector: dict[str, str], labels: dict[str, str]) -> bool:
    """Ray's label selector semantics: value, !value, in(a,b), !in(a,b)."""
    for key, want in selector.items():
        have = labels.get(key)
        negate = want.startswith("!")
        want = want[1:] if negate else want
        if want.startswith("in(") and want.endswith(")"):
            ok = have in [v.strip() for v in want[3:-1].split(",")]
        else:
            ok = have == want
        if ok == negate:
            return False
    return True


def connect_pairs(
    prefill: list[tuple[str, Any]], decode: list[tuple[str, Any]], timeout_s: float = 60.0
) -> dict[tuple[str, str], str]:
    """Handshake every prefill worker with every decode worker (both as (worker id, handle));
    returns the KV backend of each (prefill id, decode id) pair. Workers whose KV layouts differ,
    or that no backend can join, are refused here, not mid-request."""
    kinds: dict[tuple[str, str], str] = {}
    for decode_id, decode_handle in decode:
        if not prefill:
            break
        endpoint = ray.get(WorkerClient(decode_handle).endpoint(), timeout=timeout_s)
        for prefill_id, handle in prefill:
            try:
                kinds[prefill_id, decode_id] = ray.get(WorkerClient(handle).connect_peer(endpoint), timeout=timeout_s)
            except ray.exceptions.RayTaskError as exc:
                raise ValueError(f"{prefill_id} cannot send KV to {decode_id}: {exc.cause}") from None
    return kinds


def _num(value: float) -> str:
    return f"{value:g}"
