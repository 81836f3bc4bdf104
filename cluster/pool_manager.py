"""The pool manager: changes the pools while the server runs, and keeps them at their size.

- **Scaling** (`scale`, behind the admin endpoint and `baton scale`): a new worker is started with
  `cluster.placement.spawn_worker` (the launcher's own way, so it asks Ray for the same GPUs, CPUs
  and pool resource; on a cluster with an autoscaler that demand is what launches a node), placed,
  ready, its KV layout checked against the other pool (`connect_pairs`), and only then handed to
  the router (`WorkerPools.add_worker`). A worker removed is drained first: no new request, what it
  runs finishes within `drain_timeout_s` or migrates, then the router forgets it (its prefix-index
  entries with it) and the actor is stopped.
- **Healing**: workers are restartable actors (`max_restarts`): Ray restarts a dead worker's
  process and the router re-admits it once it answers. A worker dead for good (no restart left,
  `WorkerPools.gone_workers`) is replaced by a new one, so the pool returns to its size.
- **Membership**: after every change the worker set (`cluster.membership.Membership`) goes to the
  `subscribe_membership` callbacks: the launcher publishes it for the other router processes.

Everything here runs on the router's event loop; Ray's blocking calls go to a thread.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import ray

from cluster.config import BatonConfig
from cluster.membership import Member, Membership
from cluster.placement import (
    SpawnedWorker,
    actor_state,
    connect_pairs,
    release_placement_group,
    spawn_worker,
    wait_placed,
)
from common.protocol import WorkerReady
from common.roles import ROLES, Role
from common.worker_client import WorkerClient
from router.admin import PoolsView, ScaleResult
from router.ray_backend import RayBackend

log = logging.getLogger("baton.pools")
# After a replacement failed, wait this long before trying again (the health loop asks every interval).
HEAL_RETRY_S = 30.0


@dataclass(frozen=True)
class PoolTargets:
    prefill: int
    decode: int

    def __post_init__(self) -> None:
        if self.prefill < 0:
            raise ValueError(
                f"the prefill pool cannot have {self.prefill} workers (0 or more: 0 makes the decode workers prefill)"
            )
        if self.decode < 1:
            raise ValueError(f"the decode pool needs at least 1 worker, got {self.decode}")

    def of(self, role: Role) -> int:
        return self.prefill if role == Role.PREFILL else self.decode


class DeploymentState(Protocol):
    """What the pool manager reads and keeps up to date of a running deployment
    (cluster.launcher.Deployment is one)."""

    config: BatonConfig
    model_dir: Path
    max_model_len: int
    block_size: int
    workers: list[SpawnedWorker]
    backend: RayBackend | None
    nodes: dict[str, str]  # worker id -> Ray node id
    kv_links: dict[tuple[str, str], str]  # (prefill, decode) -> transport kind


class PoolManager:
    """Scales and heals the pools of one running deployment (its backend must be built)."""

    def __init__(
        self, deployment: DeploymentState, actor_name_prefix: str = "baton", ready_timeout_s: float = 300.0
    ) -> None:
        if deployment.backend is None:
            raise ValueError("the deployment has no backend yet")
        self.deployment = deployment
        self.workers = deployment.backend.pools
        self.actor_name_prefix = actor_name_prefix
        self.ready_timeout_s = ready_timeout_s
        placement = deployment.config.placement
        self.targets = PoolTargets(placement.prefill_workers, placement.decode_workers)
        self.drain_timeout_s = placement.drain_timeout_s
        # New workers get fresh indices: Ray frees a stopped actor's name only some time later.
        used = {role: [w.index for w in deployment.workers if w.role is role] for role in ROLES}
        self._next = {role: itertools.count(max(used[role], default=-1) + 1) for role in ROLES}
        self._lock = asyncio.Lock()
        self._healing: asyncio.Task | None = None
        self._heal_failed_at = float("-inf")
        self.replaced: list[tuple[str, str]] = []  # (gone worker, its replacement)
        # Told the new targets after every scaling (the router app sizes its admission gates with it).
        self._on_resize: list[Callable[[PoolTargets], None]] = []
        # Told the worker set after every change (cluster.membership: the other routers follow it).
        self._on_membership: list[Callable[[Membership], None]] = []
        self._membership_version = 0
        self.workers.subscribe_gone(self._on_gone)
        # The router learns from Ray's state that a worker the memory monitor killed has no restart left.
        self.workers.actor_state = lambda handle: actor_state(handle)[0]

    def subscribe_resize(self, callback: Callable[[PoolTargets], None]) -> None:
        """Call `callback` with the new targets after every scaling."""
        self._on_resize.append(callback)

    def subscribe_membership(self, callback: Callable[[Membership], None]) -> None:
        """Call `callback` with the worker set (a new version) after every change to the pools."""
        self._on_membership.append(callback)

    def _publish(self, draining: frozenset[str] = frozenset()) -> None:
        """Tell the subscribers the workers the router serves with (`draining`: about to be drained)."""
        if not self._on_membership:
            return
        names = {w.worker_id: w.actor_name for w in self.deployment.workers}
        members = tuple(
            Member(w.worker_id, Role(w.role), names[w.worker_id], w.draining or w.worker_id in draining)
            for w in self.workers.workers()
            if w.worker_id in names
        )
        self._membership_version += 1
        membership = Membership(self._membership_version, self.targets.prefill, self.targets.decode, members)
        for callback in self._on_membership:
            callback(membership)

    # ---- views -------------------------------------------------------------------------------
    def pools(self) -> PoolsView:
        return PoolsView(self.targets.prefill, self.targets.decode, self.workers.workers())

    def _serving(self, role: Role) -> list[str]:
        """The role's workers not on their way out."""
        return [w.worker_id for w in self.workers.workers() if w.role == role and not w.draining]

    # ---- scaling -------------------------------------------------------------------------------
    async def scale(self, prefill: int | None = None, decode: int | None = None) -> ScaleResult:
        """Start or drain workers until each pool has its new size (None: leave that pool)."""
        async with self._lock:
            started = time.monotonic()
            targets = PoolTargets(
                self.targets.prefill if prefill is None else prefill, self.targets.decode if decode is None else decode
            )
            before = {role: len(self._serving(role)) for role in ROLES}
            self.targets = targets
            added: list[str] = []
            removed: list[str] = []
            moved = 0
            # Grow first, then shrink: requests drained off a removed worker find the new ones.
            grow = [role for role in ROLES for _ in range(max(0, targets.of(role) - before[role]))]
            if grow:
                added = await self._add_workers(grow)
            for role in ROLES:
                extra = len(self._serving(role)) - targets.of(role)
                for wid in self._removal_order(role)[: max(0, extra)]:
                    moved += await self._remove(wid)
                    removed.append(wid)
            for callback in self._on_resize:
                callback(targets)
            self._publish()  # the new targets, also when no worker changed
            after = {role: len(self._serving(role)) for role in ROLES}
            log.info(
                "pools scaled from %s to %s (added %s, removed %s, %d requests moved) in %.1f s",
                before,
                after,
                added,
                removed,
                moved,
                time.monotonic() - started,
            )
            return ScaleResult(
                {role.value: n for role, n in before.items()},
                {role.value: n for role, n in after.items()},
                added,
                removed,
                moved,
                round(time.monotonic() - started, 3),
            )

    def _removal_order(self, role: Role) -> list[str]:
        """Dead ones first, then the least busy, then the newest."""
        index = {w.worker_id: w.index for w in self.deployment.workers}
        infos = [w for w in self.workers.workers() if w.role == role and not w.draining]
        infos.sort(key=lambda w: (w.alive, w.in_flight, -index.get(w.worker_id, 0)))
        return [w.worker_id for w in infos]

    async def _add_workers(self, roles: list[Role]) -> list[str]:
        """Start one worker per entry of `roles` (together); all of them serve, or none does."""
        config = self.deployment.config
        restarts = config.placement.max_restarts
        spawned: list[SpawnedWorker] = []
        try:
            for role in roles:
                spawned.append(
                    await asyncio.to_thread(
                        spawn_worker,
                        config,
                        role,
                        next(self._next[role]),
                        self.actor_name_prefix,
                        None,
                        max_restarts=restarts,
                    )
                )
                # Listed at once, so a shutdown while it starts stops it too (the router uses it only later).
                self.deployment.workers.append(spawned[-1])
            nodes = await asyncio.to_thread(wait_placed, spawned, config.placement.placement_timeout_s)
            refs = [w.client.ready() for w in spawned]
            reports = await asyncio.wait_for(_all(refs), self.ready_timeout_s)
            for report in reports:
                self._check_limits(report)
            await asyncio.to_thread(self._connect_new, spawned)
        except BaseException as exc:
            failed = {w.worker_id for w in spawned}
            self.deployment.workers[:] = [w for w in self.deployment.workers if w.worker_id not in failed]
            for w in spawned:
                _kill(w.handle)
                release_placement_group(w)
            if isinstance(exc, asyncio.TimeoutError):
                raise RuntimeError(f"new workers not ready after {self.ready_timeout_s:.0f} s") from None
            if isinstance(exc, ray.exceptions.RayError):
                raise RuntimeError(f"a new worker failed to start: {exc}") from None
            raise
        for w in spawned:
            self.deployment.nodes[w.worker_id] = nodes.get(w.worker_id, "")
            self.workers.add_worker(w.worker_id, w.role, w.handle)
            log.info("worker %s joined the %s pool", w.worker_id, w.role)
        self._publish()
        return [w.worker_id for w in spawned]

    def _check_limits(self, report: WorkerReady) -> None:
        """A new worker must hold what the router already promises clients, in the same layout."""
        d = self.deployment
        if report.block_size != d.block_size:
            raise RuntimeError(f"{report.worker_id} has block size {report.block_size}, the pools {d.block_size}")
        if report.max_model_len < d.max_model_len:
            raise RuntimeError(
                f"{report.worker_id} holds {report.max_model_len} tokens, the router serves {d.max_model_len}"
            )

    def _connect_new(self, spawned: list[SpawnedWorker]) -> None:
        """The start-up handshake for every pair the new workers are in (KV layout and transport)."""
        live = {w.worker_id for w in self.workers.workers() if w.alive}  # a dead peer would fail the handshake
        current = {w.worker_id: (w.role, w.handle) for w in self.deployment.workers if w.worker_id in live}
        current.update({w.worker_id: (w.role, w.handle) for w in spawned})  # not in the router yet
        new = {w.worker_id for w in spawned}
        prefill = [(wid, h) for wid, (role, h) in current.items() if role is Role.PREFILL]
        for wid, (role, handle) in current.items():
            if role is not Role.DECODE:
                continue
            senders = prefill if wid in new else [(p, h) for p, h in prefill if p in new]
            if senders:
                self.deployment.kv_links.update(connect_pairs(senders, [(wid, handle)]))

    async def _remove(self, worker_id: str) -> int:
        self._publish(draining=frozenset({worker_id}))  # the other routers drain it too
        moved = await self.workers.drain_worker(worker_id, self.drain_timeout_s)
        handle = self.workers.remove_worker(worker_id)
        self._publish()
        leaving = [w for w in self.deployment.workers if w.worker_id == worker_id]
        self.deployment.workers[:] = [w for w in self.deployment.workers if w.worker_id != worker_id]
        self.deployment.nodes.pop(worker_id, None)
        self.deployment.kv_links = {k: v for k, v in self.deployment.kv_links.items() if worker_id not in k}
        await _stop(handle)
        for w in leaving:
            release_placement_group(w)
        log.info("worker %s left its pool (%d requests moved)", worker_id, moved)
        return moved

    # ---- healing -------------------------------------------------------------------------------
    def _on_gone(self) -> None:
        """Called by the backend's health loop while some worker is dead for good."""
        if (self._healing is None or self._healing.done()) and time.monotonic() - self._heal_failed_at > HEAL_RETRY_S:
            self._healing = asyncio.get_running_loop().create_task(self.heal())

    async def heal(self) -> list[str]:
        """Replace every worker dead for good (the new one first, so a failed start leaves the dead
        one listed and the next health interval after HEAL_RETRY_S tries again); returns the new ones."""
        async with self._lock:
            started = []
            for wid in self.workers.gone_workers():
                role = next(w.role for w in self.deployment.workers if w.worker_id == wid)
                log.warning("worker %s is dead for good (no restart left): replacing it", wid)
                try:
                    (new,) = await self._add_workers([role])
                except (RuntimeError, ValueError) as exc:
                    log.error("could not replace %s: %s (retrying in %.0f s)", wid, exc, HEAL_RETRY_S)
                    self._heal_failed_at = time.monotonic()
                    continue
                await self._remove(wid)
                self.replaced.append((wid, new))
                started.append(new)
            return started


async def _all(refs: list) -> list:
    # One by one, not gather: a cancelled gather (server shutting down) leaves an unretrieved error.
    return [await ref for ref in refs]


async def _stop(handle) -> None:
    """Let the worker close its transport (shared memory), then end the actor for good."""
    try:
        await asyncio.wait_for(WorkerClient(handle).shutdown(), 10)
    except (ray.exceptions.RayError, asyncio.TimeoutError):
        pass  # dead or hung: ray.kill below is all that is left
    _kill(handle)


def _kill(handle) -> None:
    try:
        ray.kill(handle, no_restart=True)
    except Exception:  # already gone
        pass
