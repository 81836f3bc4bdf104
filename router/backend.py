"""The boundary between the HTTP layer and the worker pools.

The router talks to workers only through `ServingBackend`, so the HTTP layer is testable without
Ray: `FakeBackend` below produces deterministic tokens and text from a tokenizer, and can be made
slow, made to fail, or given dead workers. The Ray backend (in a later issue) implements the same
three methods.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Protocol, runtime_checkable

from router.trace import RequestTrace
from workers.protocol import RequestOutput, TokenLogprob
from workers.sampling_params import SamplingParams

__all__ = [
    "BackendError",
    "FakeBackend",
    "GenerateRequest",
    "RouteDecision",
    "ServingBackend",
    "WorkerInfo",
]


@dataclass(frozen=True)
class WorkerInfo:
    """One worker as the router sees it: its pool, whether it is alive, and its load."""

    worker_id: str
    role: str  # "prefill" | "decode"
    alive: bool = True
    running: int = 0  # sequences being computed
    waiting: int = 0  # sequences queued
    kv_usage: float = 0.0  # fraction of KV blocks in use, 0 to 1
    # Prompt tokens routed to this worker whose prefill has not produced a first token yet (the
    # router's own count: the KV-aware policy's queue term).
    queued_prefill_tokens: int = 0
    prefix_cache_queries: int = 0  # cumulative, from the worker's prefix cache
    prefix_cache_hits: int = 0
    last_heartbeat: float | None = None  # wall-clock time of the last stats answer (None: never)


@dataclass(frozen=True)
class RouteDecision:
    """Where a request runs: decode worker D, and prefill worker P (None: D prefills locally)."""

    decode_worker: str
    prefill_worker: str | None = None
    reason: str = ""  # for metrics and logs, e.g. "round_robin"
    # Leading prompt blocks the prefilling worker (P, or D when local) holds per the prefix index.
    cached_blocks: int = 0


@dataclass(frozen=True)
class GenerateRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    route: RouteDecision
    # Filled in by the backend (prefill/transfer times, fallbacks) when given; see router.trace.
    trace: RequestTrace | None = None


class BackendError(RuntimeError):
    """A failure inside the worker pools (the router answers 500, or 503 when retryable)."""

    def __init__(self, message: str, retryable: bool = False) -> None:
        super().__init__(message)
        self.retryable = retryable


@runtime_checkable
class ServingBackend(Protocol):
    def workers(self) -> list[WorkerInfo]:
        """A snapshot of every worker of both pools (cheap: called per request by the routing policy)."""
        ...

    def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        """An async generator of increments (new token ids and text) ending with one finished output."""
        ...

    async def abort(self, request_id: str) -> None:
        """Stop a request and free its resources; a no-op for unknown or finished requests."""
        ...


# --------------------------------------------------------------------------- fake

DEFAULT_FAKE_REPLY = "Hello! I am a fake Baton backend. The capital of France is Paris."


@dataclass
class FakeBackend:
    """A deterministic in-process stand-in for the worker pools.

    Replies with `reply` (tokenized with `tokenizer`), one token per step, then EOS (finish
    "stop"), or stops at max_tokens (finish "length"). Stop strings are cut as the engine does.
    Logprobs are made up but consistent: the chosen token is the most likely one (logprob about
    -0.05) and the alternatives are the following token ids, 1, 2, ... nats less likely. Knobs for tests:

    - `token_delay`: seconds between tokens (a slow backend); `first_token_delay` before the first.
    - `fail_after`: raise BackendError after this many outputs (0: before the first one).
    - `dead`: worker ids reported as not alive.
    - `block_size`: a prompt seen before reports its whole blocks as cached tokens.
    Records: `requests` (every GenerateRequest), `aborted` (ids passed to abort), `finished`.
    """

    tokenizer: object  # router.tokenizer.Tokenizer (kept loose to avoid an import cycle in type checks)
    num_prefill: int = 1
    num_decode: int = 1
    reply: str = DEFAULT_FAKE_REPLY
    token_delay: float = 0.0
    first_token_delay: float = 0.0
    fail_after: int | None = None
    fail_message: str = "fake backend failure"
    dead: set[str] = field(default_factory=set)
    block_size: int = 16
    requests: list[GenerateRequest] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)
    _seen_prompts: list[tuple[int, ...]] = field(default_factory=list)
    _abort_events: dict[str, asyncio.Event] = field(default_factory=dict)
    _active: dict[str, RouteDecision] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._reply_ids = self.tokenizer.encode(self.reply, add_special_tokens=False)

    # -- ServingBackend
    def workers(self) -> list[WorkerInfo]:
        out = []
        active = {}
        for route in self._active.values():
            active[route.decode_worker] = active.get(route.decode_worker, 0) + 1
        for role, n in (("prefill", self.num_prefill), ("decode", self.num_decode)):
            for i in range(n):
                wid = f"{role}-{i}"
                # Made-up but consistent load: each running request holds 5% of a decode worker's KV.
                running = active.get(wid, 0)
                out.append(WorkerInfo(wid, role, alive=wid not in self.dead, running=running,
                                      kv_usage=min(1.0, 0.05 * running), last_heartbeat=time.time()))
        return out

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
        event = self._abort_events.get(request_id)
        if event is not None:
            event.set()

    async def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        self.requests.append(request)
        for wid in (request.route.decode_worker, request.route.prefill_worker):
            if wid is not None and wid in self.dead:
                raise BackendError(f"worker {wid} is dead", retryable=True)
        sp = request.sampling_params
        prompt = request.prompt_token_ids
        cached = self._cached_tokens(prompt)
        self._seen_prompts.append(tuple(prompt))
        if request.trace is not None:
            request.trace.cached_tokens = cached
            if request.route.prefill_worker is not None:
                request.trace.kv_bytes = (len(prompt) - cached) * 1024  # made up: 1 KiB per token
                request.trace.kv_blocks = -(-(len(prompt) - cached) // self.block_size)
        aborted = self._abort_events[request.request_id] = asyncio.Event()
        self._active[request.request_id] = request.route
        eos = self.tokenizer.eos_token_id
        detok = self.tokenizer.detokenizer(prompt)
        full = ""  # all text so far (stop strings cut)
        sent = 0  # how much of it was sent
        emitted = 0
        try:
            if self.first_token_delay:
                await asyncio.sleep(self.first_token_delay)
            step = 0
            while True:
                if self.fail_after is not None and step >= self.fail_after:
                    raise BackendError(self.fail_message)
                if aborted.is_set():
                    return
                if step > 0 and self.token_delay:
                    await asyncio.sleep(self.token_delay)
                    if aborted.is_set():
                        return
                # Which token: the reply, then EOS (unless ignore_eos: then the reply again).
                idx = step % (len(self._reply_ids) + 1)
                at_eos = idx == len(self._reply_ids)
                token = eos if at_eos else self._reply_ids[idx]
                step += 1
                finish = None
                if at_eos and not sp.ignore_eos and step > sp.min_tokens:
                    finish = "stop"
                elif token in sp.stop_token_ids and step > sp.min_tokens:
                    finish = "stop"
                else:
                    full += detok.add([token]) if not at_eos else ""
                    # Stop strings: cut the text at the first match, as the engine does.
                    if sp.stop and step > sp.min_tokens:
                        cut = min((i for i in (full.find(s, max(0, sent - len(s))) for s in sp.stop) if i >= 0), default=-1)
                        if cut >= 0:
                            full = full[:cut]
                            finish = "stop"
                if finish is None and step >= sp.max_tokens:
                    finish = "length"
                # Hold back a tail that may still become a stop string; release it all at the end.
                end = len(full) if finish is not None else len(full) - _stop_prefix_len(full, sp.stop)
                new_text, sent = full[sent:end], max(sent, end)
                logprobs = None
                if sp.logprobs is not None:
                    chosen = -0.05 - 0.01 * (step % 10)
                    alternatives = [((token + k) % self.tokenizer.vocab_size, chosen - k) for k in range(1, sp.logprobs)]
                    top = [(token, chosen)] + alternatives if sp.logprobs else []
                    logprobs = [TokenLogprob(token_id=token, logprob=chosen, top=top)]
                emitted += 1
                if finish is not None:
                    self.finished.append(request.request_id)
                yield RequestOutput(
                    request_id=request.request_id,
                    token_ids=[token],
                    text=new_text,
                    logprobs=logprobs,
                    finished=finish is not None,
                    finish_reason=finish,
                    num_prompt_tokens=len(prompt),
                    num_cached_tokens=cached,
                    num_output_tokens=emitted,
                )
                if finish is not None:
                    return
        finally:
            self._abort_events.pop(request.request_id, None)
            self._active.pop(request.request_id, None)

    # -- helpers
    def _cached_tokens(self, prompt: list[int]) -> int:
        best = 0
        for seen in self._seen_prompts:
            n = 0
            for a, b in zip(seen, prompt):
                if a != b:
                    break
                n += 1
            best = max(best, n)
        # Whole blocks only, and never the last prompt token (it must be computed to sample).
        return min(best, len(prompt) - 1) // self.block_size * self.block_size


def _stop_prefix_len(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of text that is a proper prefix of a stop string."""
    best = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:n]):
                best = n
                break
    return best
