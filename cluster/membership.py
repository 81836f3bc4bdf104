"""The deployment's worker set, published by router 0's pool manager and followed by every other router.

Router 0 (the launcher's) owns the pools: `baton scale`, the admin endpoint, the autoscaler and
healing all go through its `cluster.pool_manager.PoolManager`. The other routers (routers 1..N-1
of `baton serve --api-server-count N`, and `baton router` in other pods) learn of its changes here:

- The pool manager publishes the set it serves with (`Membership`: a version, the target sizes
  and every worker with its actor name and whether it is draining) after every change, to a
  small named Ray actor, `<prefix>-membership` (`WorkerDirectory`), created at the first change:
  a deployment that never changes its pools runs none.
- Every other router polls it about once a second (`MembershipFollower`) and brings its own
  `WorkerPools` to the same set the way router 0 changes its own: a new worker is added (its
  long-poll, lease and KV-event queue start with it), a draining one gets no new request and is
  drained, a removed one is forgotten (its prefix-index entries with it).

Why a Ray actor and not the worker actors' names (`ray.util.list_named_actors`) or a file: every
router is a driver of the deployment's Ray, also one in another pod, where a directory of files is
not; and a worker's name says nothing of its state: it exists from the moment the worker is
spawned, long before it is ready and connected to the other pool (the KV handshake), and a drained
worker keeps it until it is stopped. Only the pool manager knows when a worker serves.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, cast

import ray
from ray.exceptions import RayError

from common.roles import Role
from router.pools import WorkerPools

__all__ = [
    "Member",
    "Membership",
    "MembershipChanges",
    "MembershipFollower",
    "MembershipPublisher",
    "WorkerDirectory",
    "changes",
    "directory_name",
    "read_membership",
]

log = logging.getLogger("baton.membership")


def directory_name(actor_name_prefix: str) -> str:
    """The directory actor's name beside the workers' (`<prefix>-<role>-<index>`)."""
    return f"{actor_name_prefix}-membership"


@dataclass(frozen=True)
class Member:
    worker_id: str
    role: Role
    actor_name: str  # the worker actor's name in the deployment's namespace
    draining: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "role", Role(self.role))  # ValueError for a role that is neither


@dataclass(frozen=True)
class Membership:
    """The worker set router 0 serves with, as of one change (versions only grow)."""

    version: int
    prefill_target: int
    decode_target: int
    members: tuple[Member, ...]


@dataclass(frozen=True)
class MembershipChanges:
    """What a router must do to its pools to follow a published Membership."""

    add: tuple[Member, ...]
    drain: tuple[str, ...]
    remove: tuple[str, ...]


def changes(current: Mapping[str, bool], published: Membership) -> MembershipChanges:
    """From this router's workers (worker id -> draining) to the published set: add the serving
    workers it lacks (a draining one it never had is not worth adding), drain those the pool
    manager drains, remove those no longer published."""
    members = {m.worker_id: m for m in published.members}
    return MembershipChanges(
        add=tuple(m for m in published.members if m.worker_id not in current and not m.draining),
        drain=tuple(
            wid for wid, draining in current.items() if wid in members and members[wid].draining and not draining
        ),
        remove=tuple(wid for wid in current if wid not in members),
    )


class WorkerDirectory:
    """The latest Membership (the body of the `<prefix>-membership` actor)."""

    def __init__(self) -> None:
        self._latest: Membership | None = None

    def publish(self, membership: Membership) -> None:
        if self._latest is None or membership.version > self._latest.version:
            self._latest = membership

    def read(self, known_version: int = 0) -> Membership | None:
        """The latest Membership if it is newer than `known_version`, else None."""
        latest = self._latest
        return latest if latest is not None and latest.version > known_version else None


_DirectoryActor = ray.remote(num_cpus=0)(WorkerDirectory)


class MembershipPublisher:
    """Router 0's side: hands each Membership to the directory actor (created at the first one;
    owned by this driver, so it ends with the deployment). Never blocks on the actor: calls from
    one caller run in the order they were sent."""

    def __init__(self, actor_name_prefix: str, namespace: str) -> None:
        self.name = directory_name(actor_name_prefix)
        self.namespace = namespace
        # The directory actor's handle: Any, as common.worker_client holds a worker's (Ray types an
        # actor's methods only when they are declared with ray.method).
        self._actor: Any = None
        self._last: ray.ObjectRef[None] | None = None

    def publish(self, membership: Membership) -> None:
        if self._actor is None or self._last_failed():
            self._actor = _DirectoryActor.options(name=self.name, namespace=self.namespace, get_if_exists=True).remote()
        self._last = cast("ray.ObjectRef[None]", self._actor.publish.remote(membership))

    def _last_failed(self) -> bool:
        """The previous publication failed (the actor died): a new actor gets the next one."""
        if self._last is None:
            return False
        done, _ = ray.wait([self._last], timeout=0)
        if not done:
            return False
        try:
            ray.get(done[0])
        except RayError as exc:
            log.warning("the worker directory %s is gone (%s); starting it again", self.name, exc)
            return True
        return False

    def close(self) -> None:
        if self._actor is not None:
            try:
                ray.kill(self._actor)
            except Exception:  # already gone with its driver
                pass
            self._actor = None


def read_membership(actor_name_prefix: str, namespace: str, known_version: int = 0) -> Membership | None:
    """The published set if there is one newer than `known_version` (blocking; None without a
    directory: the pools never changed, the start-up set holds)."""
    try:
        actor: Any = ray.get_actor(directory_name(actor_name_prefix), namespace=namespace)
    except ValueError:
        return None
    return ray.get(cast("ray.ObjectRef[Membership | None]", actor.read.remote(known_version)))


class MembershipFollower:
    """A non-launcher router's side: polls the directory every `every_s` and applies what changed
    to `pools`. `read` (known version -> newer Membership or None) and `resolve` (actor name ->
    handle) default to Ray; tests pass stand-ins. `on_targets(prefill, decode)` hears of new
    target sizes (the app's automatic admission gates follow them)."""

    def __init__(
        self,
        pools: WorkerPools,
        actor_name_prefix: str,
        namespace: str,
        drain_timeout_s: float,
        every_s: float = 1.0,
        on_targets: Callable[[int, int], None] | None = None,
        read: Callable[[int], Awaitable[Membership | None]] | None = None,
        resolve: Callable[[str], Awaitable[object]] | None = None,
    ) -> None:
        self.pools = pools
        self.actor_name_prefix = actor_name_prefix
        self.namespace = namespace
        self.drain_timeout_s = drain_timeout_s
        self.every_s = every_s
        self.on_targets = on_targets
        self.version = 0
        self._read = read or self._read_from_ray
        self._resolve = resolve or self._resolve_in_ray
        self._drains: dict[str, asyncio.Task] = {}
        self._targets: tuple[int, int] | None = None

    async def _read_from_ray(self, known_version: int) -> Membership | None:
        return await asyncio.to_thread(read_membership, self.actor_name_prefix, self.namespace, known_version)

    async def _resolve_in_ray(self, actor_name: str) -> object:
        return await asyncio.to_thread(ray.get_actor, actor_name, self.namespace)

    async def run(self) -> None:
        """Follow until cancelled (a failed read is retried at the next poll)."""
        try:
            while True:
                await asyncio.sleep(self.every_s)
                try:
                    membership = await self._read(self.version)
                except RayError as exc:
                    log.warning("cannot read the worker directory: %s", exc)
                    continue
                if membership is not None:
                    await self.apply(membership)
        finally:
            for task in self._drains.values():
                task.cancel()

    async def apply(self, membership: Membership) -> MembershipChanges:
        """Bring the pools to `membership` (one older than what was applied is ignored)."""
        if membership.version <= self.version:
            return MembershipChanges((), (), ())
        current = {w.worker_id: w.draining for w in self.pools.workers()}
        todo = changes(current, membership)
        added = []
        for member in todo.add:
            try:
                handle = await self._resolve(member.actor_name)
            except ValueError:  # stopped since it was published: the next version drops it
                log.warning("worker %s (%s) is published but not found", member.worker_id, member.actor_name)
                continue
            self.pools.add_worker(member.worker_id, member.role, handle)
            added.append(member)
            log.info(
                "worker %s joined the %s pool (directory version %d)", member.worker_id, member.role, membership.version
            )
        for wid in todo.drain:
            self._drains[wid] = asyncio.get_running_loop().create_task(
                self.pools.drain_worker(wid, self.drain_timeout_s)
            )
            log.info("draining worker %s (directory version %d)", wid, membership.version)
        for wid in todo.remove:
            drain = self._drains.pop(wid, None)
            if drain is not None:
                drain.cancel()
            self.pools.remove_worker(wid)
            log.info("worker %s left its pool (directory version %d)", wid, membership.version)
        self.version = membership.version
        targets = (membership.prefill_target, membership.decode_target)
        if self.on_targets is not None and targets != self._targets:
            self.on_targets(*targets)
        self._targets = targets
        return MembershipChanges(tuple(added), todo.drain, todo.remove)
