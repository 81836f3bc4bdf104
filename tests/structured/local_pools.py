"""The router's real backend (RayBackend over WorkerPools) driving real EngineWorkers in this
process, without Ray: each worker sits behind a handle with Ray's call shape
(`handle.method.remote(*args)` is an awaitable run on a thread), and a worker's exception arrives
as Ray delivers it (a RayTaskError that is also an instance of the worker's exception class, with
the exception as its `cause`). For tests of what the router and the workers do together (the
request flow, error mapping, what a worker holds afterwards) on a tiny model, in seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import traceback
from dataclasses import dataclass

from ray.exceptions import RayTaskError

from common.roles import Role
from router.backend import RouteDecision
from router.pools import WorkerPools
from router.ray_backend import RayBackend


class _Method:
    def __init__(self, fn, name: str) -> None:
        self.fn, self.name = fn, name

    def remote(self, *args):
        async def call():
            try:
                return await asyncio.to_thread(self.fn, *args)
            except Exception as exc:
                raise RayTaskError(self.name, traceback.format_exc(), exc).as_instanceof_cause() from None

        return call()


class LocalHandle:
    """An EngineWorker as a Ray actor handle."""

    def __init__(self, worker) -> None:
        self.worker = worker

    def __getattr__(self, name: str) -> _Method:
        return _Method(getattr(self.worker, name), name)


@dataclass
class _Entry:
    worker_id: str
    role: Role
    handle: object


class FixedRoute:
    """A routing policy that prefills remotely on p0 (`remote`) or locally on d0."""

    def __init__(self, remote: bool) -> None:
        self.remote = remote

    def choose(self, prompt_token_ids, workers, context=None) -> RouteDecision:
        return RouteDecision("d0", "p0" if self.remote else None, "fixed")


@contextlib.contextmanager
def local_backend(model_dir, config):
    """(RayBackend over a prefill worker p0 and a decode worker d0 of `model_dir`, (p0, d0))."""
    from workers.shell.worker import EngineWorker, WorkerConfig

    prefill = EngineWorker(WorkerConfig("p0", "prefill", str(model_dir), config, transport="shm"))
    decode = EngineWorker(WorkerConfig("d0", "decode", str(model_dir), config, transport="shm"))
    try:
        pools = WorkerPools(
            [_Entry("p0", Role.PREFILL, LocalHandle(prefill)), _Entry("d0", Role.DECODE, LocalHandle(decode))],
            health_interval_s=0.2,
        )
        yield RayBackend(pools), (prefill, decode)
    finally:
        prefill.shutdown()
        decode.shutdown()
