"""Stand-ins for the Ray worker actors, so RayBackend runs in-process without Ray or a model.

Each `FakeActor` answers the calls RayBackend makes (`heartbeat`, `reserve`, `prefill`,
`start_decode`, `submit`, `poll_outputs`, `abort`, `endpoint`) the way EngineWorker does, through
`.remote(...)` returning an awaitable. It "computes" a prompt by publishing STORED events for its
full blocks (as the block manager does), reports cached tokens from what it stored before, and
answers one token per request. `kill()` makes every later call raise RayActorError.
"""

from __future__ import annotations

import asyncio
import os

from ray.exceptions import RayActorError

from workers.block_hash import hash_prefix_blocks
from workers.protocol import KVEvent, KVEventKind
from workers.protocol import KVReservation, RequestOutput
from workers.protocol import KVEventBatch, PrefillResult, WorkerHeartbeat, WorkerStats

BS = 16


class _Method:
    def __init__(self, actor: "FakeActor", fn) -> None:
        self.actor, self.fn = actor, fn

    def remote(self, *args):
        async def call():
            self.actor.calls.append(self.fn.__name__.lstrip("_"))  # attempts, even on a dead actor
            if self.actor.dead:
                raise RayActorError()
            return await self.fn(*args)

        return call()


class FakeActor:
    def __init__(self, worker_id: str, role: str, prefill_delay_s: float = 0.0) -> None:
        self.worker_id, self.role = worker_id, role
        self.dead = False
        self.prefill_delay_s = prefill_delay_s
        self.calls: list[str] = []
        self.cached: set[int] = set()
        self.events: list[KVEvent] = []
        self.outbox: asyncio.Queue | None = None
        self.pid = os.getpid()  # change it to simulate a restarted worker
        for name in ("heartbeat", "reserve", "prefill", "start_decode", "submit", "poll_outputs", "abort", "endpoint"):
            setattr(self, name, _Method(self, getattr(self, "_" + name)))

    def kill(self) -> None:
        self.dead = True

    def _queue(self) -> asyncio.Queue:
        if self.outbox is None:
            self.outbox = asyncio.Queue()
        return self.outbox

    def _compute(self, prompt: list[int]) -> int:
        """Cache the prompt's full blocks; return how many leading tokens were cached before."""
        hashes = hash_prefix_blocks(prompt[: len(prompt) - 1], BS)
        hit = 0
        for h in hashes:
            if h not in self.cached:
                break
            hit += 1
        new = [h for h in hashes if h not in self.cached]
        self.cached.update(new)
        if new:
            self.events.append(KVEvent(KVEventKind.STORED, tuple(new)))
        return hit * BS

    async def _heartbeat(self):
        events, self.events = self.events, []
        stats = WorkerStats(self.worker_id, self.role, 0, 0, 0.0, 100, 100, 0, 0, 0, 0, 0, 0, 0, 0, self.pid)
        return WorkerHeartbeat(stats, KVEventBatch(events, None, BS))

    async def _endpoint(self):
        return b"endpoint"

    async def _reserve(self, rid, prompt, params):
        cached = self._compute(prompt)
        return KVReservation(rid, list(range(-(-len(prompt) // BS))), cached)

    async def _prefill(self, req):
        await asyncio.sleep(self.prefill_delay_s)
        cached = self._compute(req.prompt_token_ids)
        out = RequestOutput(req.request_id, [7], "x", num_prompt_tokens=len(req.prompt_token_ids),
                            num_cached_tokens=cached, num_output_tokens=1)
        return PrefillResult(out, 3, 3 * 4096, 0.001, self.prefill_delay_s)

    async def _start_decode(self, rid, first_token):
        self._queue().put_nowait(RequestOutput(rid, [8], "y", finished=True, finish_reason="length", num_output_tokens=2))

    async def _submit(self, rid, prompt, params):
        cached = self._compute(prompt)
        q = self._queue()
        q.put_nowait(RequestOutput(rid, [7], "x", num_prompt_tokens=len(prompt), num_cached_tokens=cached, num_output_tokens=1))
        q.put_nowait(RequestOutput(rid, [8], "y", finished=True, finish_reason="length", num_output_tokens=2))

    async def _poll_outputs(self, timeout_s):
        q = self._queue()
        try:
            first = await asyncio.wait_for(q.get(), timeout_s)
        except asyncio.TimeoutError:
            return []
        out = [first]
        while not q.empty():
            out.append(q.get_nowait())
        return out

    async def _abort(self, rid):
        return True
