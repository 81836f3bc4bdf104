"""Stand-ins for the Ray worker actors, so RayBackend runs in-process without Ray or a model.

Each `FakeActor` answers the calls RayBackend and the pool manager make through their typed client
(`heartbeat`, `reserve`, `prefill`, `start_decode`, `submit`, `poll_outputs`, `abort`, `endpoint`,
`ready`, `shutdown`), with the records of common.request, the way EngineWorker does, through
`.remote(...)` returning an awaitable. A prefill answers at once; its first token (a PrefillResult)
reaches the outbox `prefill_delay_s` later. It "computes" a prompt by
publishing STORED events for its
full blocks (as the block manager does), and reports cached tokens from what it stored before.

Generation is a deterministic script, so any interleaving of workers can be checked against it:
token i of a request is `script_token(prompt, i)` with text `script_text(token)`, max_tokens of
them ("length"), one per `step_s` for every request a decode actor runs (a continuous batch).
`submit(..., resume)` continues from the tokens already produced, as LLMEngine.resume_request does
(it checks the text count the router sends against the script's).

`kill()` makes every later call raise (ActorDiedError: gone for good); `kill(restart_after_s=T)`
raises ActorUnavailableError until the actor comes back T seconds later with a new pid and
nothing of its old state, as a Ray actor restart does. `kill(oom=True)` is Ray's memory monitor
killing it with no restart left: every later call raises OutOfMemoryError, and only Ray's state
of the actor says DEAD (`ray_state`: what cluster.placement.actor_state reads of a real one).
`hang()` makes calls wait (its requests go on decoding) until `unhang()`: a worker that stalled,
was given up, and came back as it was.
Like EngineWorker, it stamps each output with the attempt its creation call named.
"""

from __future__ import annotations

import asyncio
import itertools
import os
from dataclasses import dataclass

from ray.exceptions import ActorDiedError, ActorUnavailableError, OutOfMemoryError, RayTaskError

from common.block_hash import hash_prefix_blocks
from common.protocol import (
    KVEvent,
    KVEventBatch,
    KVEventKind,
    KVReservation,
    PrefillFailed,
    PrefillResult,
    RequestOutput,
    ResumeState,
    WorkerHeartbeat,
    WorkerReady,
    WorkerStats,
)
from common.request import (
    AbortRequest,
    PrefillRequest,
    RequestContext,
    ReserveRequest,
    StartDecodeRequest,
    SubmitRequest,
    WorkerRequest,
)
from common.sampling_params import SamplingParams
from common.transports import KVLoadFailed
from router.backend import GenerateRequest, RouteDecision
from router.trace import RequestTrace

BS = 16
_pids = itertools.count(os.getpid() + 100000)


def script_token(prompt: list[int], i: int) -> int:
    return (sum(prompt) * 7 + 31 * i) % 1000


def script_text(token: int) -> str:
    return f"<{token}>"


def script(prompt: list[int], max_tokens: int) -> list[int]:
    """The whole answer the fake workers give to a prompt."""
    return [script_token(prompt, i) for i in range(max_tokens)]


class _Method:
    def __init__(self, actor: FakeActor, fn) -> None:
        self.actor, self.fn = actor, fn

    def remote(self, *args):
        async def call():
            actor = self.actor
            if self.fn.__name__ != "_renew_lease":  # the lease loop's renewals are counted apart
                actor.calls.append(self.fn.__name__.lstrip("_"))  # attempts, even on a dead actor
            if actor.hung is not None:
                await actor.hung.wait()
            if actor.dead:
                if actor.restarting:
                    raise ActorUnavailableError("restarting", None)
                if actor.oom:
                    raise OutOfMemoryError("1 worker(s) were killed due to the node running low on memory.")
                raise ActorDiedError()
            incarnation = actor.pid
            try:
                result = await self.fn(*args)
            except (KVLoadFailed, ValueError) as exc:  # raised by the worker: Ray hands it over as a RayTaskError
                raise RayTaskError(self.fn.__name__.lstrip("_"), "a fake traceback", exc).as_instanceof_cause() from exc
            if actor.dead or actor.pid != incarnation:
                raise ActorUnavailableError("died during the call", None)  # its reply never came
            return result

        return call()


@dataclass
class _Running:
    prompt: list[int]
    max_tokens: int
    produced: int  # tokens of the script already produced (here or on an earlier worker)
    attempt: int = 0  # the router's, stamped on the outputs


class FakeActor:
    """A worker and its own handle (what router.pools.WorkerEntry asks for)."""

    def __init__(self, worker_id: str, role: str, prefill_delay_s: float = 0.0, step_s: float = 0.0) -> None:
        self.worker_id, self.role = worker_id, role
        self.dead = self.restarting = self.oom = False
        self.hung: asyncio.Event | None = None  # set: calls go on
        self.prefill_delay_s = prefill_delay_s
        self.step_s = step_s
        self.calls: list[str] = []
        self.submitted: list[tuple[str, ResumeState | None]] = []  # every submit's request id and resume
        self.cached: set[int] = set()
        self.events: list[KVEvent] = []
        self.outbox: asyncio.Queue | None = None
        self._outbox_loop: asyncio.AbstractEventLoop | None = None
        self.running: dict[str, _Running] = {}
        self.reserved: set[str] = set()
        self.prefilling: set[str] = set()  # prefills whose first token has not been queued yet
        self.handle = self
        # reserve() remembers what start_decode() needs (the real worker keeps it in its engine).
        self._prompts: dict[str, list[int]] = {}
        self._max_tokens: dict[str, int] = {}
        self._attempts: dict[str, int] = {}
        self._stepper: asyncio.Task | None = None
        self.pid = os.getpid()  # change it to simulate a restarted worker
        self.stopped = False
        self.renewed = 0  # lease renewals (the router's lease loop)
        self.reply_delay_s = 0.0  # poll_outputs: from taking the outputs to the reply reaching the router
        self.fail_prefills = False  # each prefill ends in a PrefillFailed (its KV handoff failed)
        self.fail_kv_loads = False  # each start_decode finds the pushed KV bad (--kv-load-failure-policy fail)
        for name in (
            "heartbeat",
            "reserve",
            "prefill",
            "start_decode",
            "submit",
            "poll_outputs",
            "abort",
            "endpoint",
            "ready",
            "shutdown",
            "renew_lease",
        ):
            setattr(self, name, _Method(self, getattr(self, "_" + name)))

    # ---- faults ----------------------------------------------------------------------------
    @property
    def ray_state(self) -> str:
        return "ALIVE" if not self.dead else "RESTARTING" if self.restarting else "DEAD"

    def kill(self, restart_after_s: float | None = None, oom: bool = False) -> None:
        self.dead, self.oom = True, oom
        self.running.clear()
        self.reserved.clear()
        self.prefilling.clear()
        if restart_after_s is not None:
            self.restarting = True
            asyncio.get_running_loop().call_later(restart_after_s, self._restart)

    def _restart(self) -> None:
        self.dead = self.restarting = False
        self.pid = next(_pids)
        self.cached, self.events, self.outbox = set(), [], None
        self.events.append(KVEvent(KVEventKind.CLEARED))

    def hang(self) -> None:
        self.hung = asyncio.Event()

    def unhang(self) -> None:
        hung, self.hung = self.hung, None
        hung.set()

    # ---- the scripted engine -----------------------------------------------------------------
    def _queue(self) -> asyncio.Queue:
        """The outbox, on the running event loop (a second router app over the same workers runs
        on another loop; what the first left queued is carried over)."""
        loop = asyncio.get_running_loop()
        if self.outbox is None or self._outbox_loop is not loop:
            left = [] if self.outbox is None else [self.outbox.get_nowait() for _ in range(self.outbox.qsize())]
            self.outbox, self._outbox_loop = asyncio.Queue(), loop
            for item in left:
                self.outbox.put_nowait(item)
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

    def _run(self, rid: str, prompt: list[int], max_tokens: int, produced: int, attempt: int) -> None:
        self.running[rid] = _Running(list(prompt), max_tokens, produced, attempt)
        if self._stepper is None or self._stepper.done():
            self._stepper = asyncio.get_running_loop().create_task(self._steps())

    async def _steps(self) -> None:
        while self.running and not self.dead:
            await asyncio.sleep(self.step_s)
            if self.dead:
                return
            for rid, r in list(self.running.items()):
                tok = script_token(r.prompt, r.produced)
                r.produced += 1
                done = r.produced >= r.max_tokens
                if done:
                    del self.running[rid]
                self._queue().put_nowait(
                    RequestOutput(
                        rid,
                        [tok],
                        script_text(tok),
                        finished=done,
                        finish_reason="length" if done else None,
                        num_prompt_tokens=len(r.prompt),
                        num_output_tokens=r.produced,
                        attempt=r.attempt,
                    )
                )

    # ---- the calls -----------------------------------------------------------------------------
    async def _heartbeat(self, router=None):
        events, self.events = self.events, []
        stats = WorkerStats(
            self.worker_id, self.role, len(self.running), 0, 0.0, 100, 100, 0, 0, 0, 0, 0, 0, 0, 0, self.pid
        )
        return WorkerHeartbeat(stats, KVEventBatch(events, None, BS))

    async def _endpoint(self):
        return f"endpoint-{self.worker_id}-{self.pid}"

    async def _reserve(self, call: ReserveRequest):
        rid, prompt = call.request_id, call.request.prompt_token_ids
        cached = self._compute(prompt)
        self.reserved.add(rid)
        self._attempts[rid] = call.owner.attempt
        self._prompts[rid], self._max_tokens[rid] = list(prompt), call.request.sampling_params.max_tokens
        return KVReservation(rid, list(range(-(-len(prompt) // BS))), cached)

    async def _prefill(self, call: PrefillRequest):
        self.prefilling.add(call.request_id)
        asyncio.get_running_loop().create_task(self._prefill_later(call, self.pid))

    async def _prefill_later(self, call: PrefillRequest, incarnation: int):
        """The first token after `prefill_delay_s`, into the outbox (nothing if the actor died meanwhile)."""
        await asyncio.sleep(self.prefill_delay_s)
        prompt = call.request.prompt_token_ids
        if self.dead or self.pid != incarnation or call.request_id not in self.prefilling:
            return
        self.prefilling.discard(call.request_id)
        if self.fail_prefills:
            self._queue().put_nowait(PrefillFailed(call.request_id, "the KV handoff failed (injected)"))
            return
        cached = self._compute(prompt)
        tok = script_token(prompt, 0)
        done = call.request.sampling_params.max_tokens == 1
        out = RequestOutput(
            call.request_id,
            [tok],
            script_text(tok),
            finished=done,
            finish_reason="length" if done else None,
            num_prompt_tokens=len(prompt),
            num_cached_tokens=cached,
            num_output_tokens=1,
        )
        self._queue().put_nowait(PrefillResult(out, 3, 3 * 4096, 0.001, self.prefill_delay_s))

    async def _start_decode(self, call: StartDecodeRequest):
        rid = call.request_id
        if rid not in self.reserved:
            raise ValueError(f"request {rid!r} is not waiting for KV here")
        self.reserved.discard(rid)
        if self.fail_kv_loads:  # as the `fail` policy does: free it, then say why
            self._prompts.pop(rid), self._max_tokens.pop(rid), self._attempts.pop(rid)
            raise KVLoadFailed(f"the KV pushed for {rid} failed its check (injected)", "checksum_mismatch")
        self._run(rid, self._prompts.pop(rid), self._max_tokens.pop(rid), 1, self._attempts.pop(rid))

    async def _submit(self, call: SubmitRequest):
        rid, prompt, resume = call.request_id, call.request.prompt_token_ids, call.resume
        if rid in self.running:
            raise ValueError(f"request_id {rid!r} is already in use")
        self.submitted.append((rid, resume))
        produced = 0
        if resume is not None:
            produced = len(resume.output_token_ids)
            expect = script(prompt, produced)
            if list(resume.output_token_ids) != expect or resume.text_chars != sum(len(script_text(t)) for t in expect):
                raise ValueError(f"resume of {rid!r} does not match what was produced")
        self._compute(prompt)
        self._run(rid, prompt, call.request.sampling_params.max_tokens, produced, call.owner.attempt)

    async def _poll_outputs(self, timeout_s, router=None):
        q = self._queue()
        try:
            first = await asyncio.wait_for(q.get(), timeout_s)
        except asyncio.TimeoutError:
            return []
        out = [first]
        while not q.empty():
            out.append(q.get_nowait())
        await asyncio.sleep(self.reply_delay_s)  # the reply in flight (a slow network)
        return out

    async def _ready(self):
        return WorkerReady(
            self.worker_id,
            self.role,
            max_model_len=4096,
            block_size=BS,
            num_blocks=100,
            dtype="float32",
            kv_cache_dtype="float32",
        )

    async def _renew_lease(self, router):
        self.renewed += 1

    async def _shutdown(self):
        self.stopped = True

    async def _abort(self, call: AbortRequest):
        rid = call.request_id
        self.reserved.discard(rid)
        self.prefilling.discard(rid)
        return self.running.pop(rid, None) is not None


def make_request(
    request_id: str,
    prompt: list[int],
    params: SamplingParams,
    route: RouteDecision,
    trace: RequestTrace | None = None,
    context: RequestContext | None = None,
) -> GenerateRequest:
    """A GenerateRequest as router.serving makes one (a context made at the edge, a trace)."""
    request = WorkerRequest(context or RequestContext(request_id), list(prompt), params)
    return GenerateRequest(request, route, trace or RequestTrace(request_id, len(prompt)))
