"""A deterministic in-process stand-in for the worker pools, for router and observability tests
and benchmarks (bench/status_cost.py, bench/sim_scale.py); not used in serving.

`FakeBackend` implements `router.backend.ServingBackend` without Ray or a model. It plays a fixed
token script (`reply_ids`: `reply` tokenized, then EOS, over and over), and everything else is
Baton's own code: text and stop strings come from the engine's detokenizer
(`common.detokenizer.IncrementalDetokenizer`, driven with the tokenizer's decode exactly as
`LLMEngine` drives it), finish reasons follow `LLMEngine._advance`, and cached prompt tokens come
from the router's `PrefixIndex` fed with the chained block hashes every worker publishes.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field

from common.block_hash import hash_prefix_blocks, root_hash
from common.detokenizer import IncrementalDetokenizer
from common.protocol import RequestOutput, TokenLogprob
from common.sampling_params import SamplingParams
from router.backend import BackendError, GenerateRequest, RouteDecision, WorkerInfo
from router.flow_commands import EndReason
from router.prefix_index import PrefixIndex
from router.tokenizer import Tokenizer

__all__ = ["DEFAULT_REPLY", "FakeBackend"]

# Multi-byte characters on purpose: the emoji spans several byte-level tokens, so every test also
# checks that no half character is ever sent.
DEFAULT_REPLY = "Hello! I am a fake Baton backend. The capital of France is Paris. Ça va? 🎉"
KV_BYTES_PER_TOKEN = 1024  # made-up size of one token's KV, reported as moved for remote prefills


@dataclass
class FakeBackend:
    """Knobs: `token_delay` (seconds between tokens), `first_token_delay`, `fail_after` (raise
    BackendError after this many outputs; 0: before the first), `dead` (worker ids reported down),
    `block_size` (prefix-cache granularity). Records: `requests` (every GenerateRequest), `aborted`
    (ids passed to abort), `finished` (ids that ran to completion), `active` (ids generating now)."""

    tokenizer: Tokenizer
    num_prefill: int = 1
    num_decode: int = 1
    reply: str = DEFAULT_REPLY
    token_delay: float = 0.0
    first_token_delay: float = 0.0
    fail_after: int | None = None
    fail_message: str = "fake backend failure"
    dead: set[str] = field(default_factory=set)
    block_size: int = 16
    requests: list[GenerateRequest] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    abort_reasons: dict[str, EndReason] = field(default_factory=dict)
    finished: list[str] = field(default_factory=list)
    active: dict[str, RouteDecision] = field(default_factory=dict)
    prefix_index: PrefixIndex = field(default_factory=PrefixIndex)
    counters: dict[str, int] = field(default_factory=dict)
    _abort_events: dict[str, asyncio.Event] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.reply_ids: list[int] = self.tokenizer.encode(self.reply, add_special_tokens=False)

    # -- ServingBackend
    def workers(self) -> list[WorkerInfo]:
        running: dict[str, int] = {}
        for route in self.active.values():
            running[route.decode_worker] = running.get(route.decode_worker, 0) + 1
        out = []
        for role, n in (("prefill", self.num_prefill), ("decode", self.num_decode)):
            for i in range(n):
                wid = f"{role}-{i}"
                # Made-up but consistent load: each running request holds 5% of a decode worker's KV.
                r = running.get(wid, 0)
                out.append(
                    WorkerInfo(
                        wid,
                        role,
                        alive=wid not in self.dead,
                        running=r,
                        kv_usage=min(1.0, 0.05 * r),
                        last_heartbeat=time.time(),
                    )
                )
        return out

    async def abort(self, request_id: str, reason: EndReason = EndReason.CLIENT_GONE) -> None:
        self.aborted.append(request_id)
        self.abort_reasons[request_id] = reason
        event = self._abort_events.get(request_id)
        if event is not None:
            event.set()

    async def generate(self, request: GenerateRequest) -> AsyncGenerator[RequestOutput, None]:
        self.requests.append(request)
        route = request.route
        for wid in (route.decode_worker, route.prefill_worker):
            if wid is not None and wid in self.dead:
                raise BackendError(f"worker {wid} is dead", retryable=True)
        prompt = request.prompt_token_ids
        cached = self._prefill(prompt, route.prefill_worker or route.decode_worker, request.context.kv_namespace)
        request.trace.cached_tokens = cached
        if route.prefill_worker is not None:
            request.trace.kv_bytes = (len(prompt) - cached) * KV_BYTES_PER_TOKEN
            request.trace.kv_blocks = -(-(len(prompt) - cached) // self.block_size)
        aborted = self._abort_events[request.request_id] = asyncio.Event()
        self.active[request.request_id] = route
        try:
            if self.first_token_delay:
                await asyncio.sleep(self.first_token_delay)
            async for out in self._decode(request, cached, aborted):
                yield out
        finally:
            self._abort_events.pop(request.request_id, None)
            self.active.pop(request.request_id, None)

    # -- internals
    def _prefill(self, prompt: list[int], worker: str, namespace: str | None) -> int:
        """Cached prompt tokens on `worker`, then index the prompt's blocks as its KV events would."""
        hashes = hash_prefix_blocks(prompt, self.block_size, root_hash(namespace))
        hit_blocks = self.prefix_index.match(hashes).get(worker, 0)
        self.prefix_index.add(worker, hashes)
        # Like the engine: whole blocks only, and never the last prompt token (it is computed to sample).
        return min(hit_blocks * self.block_size, (len(prompt) - 1) // self.block_size * self.block_size)

    def _script(self, step: int, banned: set[int]) -> int:
        """The step-th token of reply, EOS, reply, EOS, ...; a banned token is skipped, as sampling would."""
        cycle = self.reply_ids + [self.tokenizer.eos_token_id]
        for k in range(len(cycle)):
            token = cycle[(step + k) % len(cycle)]
            if token not in banned:
                return token
        raise AssertionError("every token of the fake reply is banned")

    def _logprobs(self, token: int, step: int, sp: SamplingParams) -> list[TokenLogprob] | None:
        # Made up but consistent: the chosen token is the most likely; alternatives are the
        # following ids, each 1 nat less likely.
        if sp.logprobs is None:
            return None
        chosen = -0.05 - 0.01 * (step % 10)
        top = [((token + k) % self.tokenizer.vocab_size, chosen - k) for k in range(sp.logprobs)]
        return [TokenLogprob(token_id=token, logprob=chosen, top=top)]

    async def _decode(
        self, request: GenerateRequest, cached: int, aborted: asyncio.Event
    ) -> AsyncGenerator[RequestOutput, None]:
        """One token per step, finishing as LLMEngine._advance does."""
        sp = request.sampling_params
        eos_ids = set(self.tokenizer.eos_token_ids)
        detok = IncrementalDetokenizer(self.tokenizer.decode, sp.stop)
        output_ids: list[int] = []
        while True:
            step = len(output_ids)
            if self.fail_after is not None and step >= self.fail_after:
                raise BackendError(self.fail_message)
            if step > 0 and self.token_delay:
                await asyncio.sleep(self.token_delay)
            if aborted.is_set():
                return
            banned = set(sp.stop_token_ids) | (set() if sp.ignore_eos else eos_ids) if step < sp.min_tokens else set()
            token = self._script(step, banned)
            output_ids.append(token)
            reason = None
            if (not sp.ignore_eos and token in eos_ids) or token in sp.stop_token_ids:
                reason = "stop"
            detok.add(output_ids)
            if detok.stopped and reason is None:
                reason = "stop"
            if reason is None and len(output_ids) >= sp.max_tokens:
                reason = "length"
            if reason is not None:
                self.finished.append(request.request_id)
            yield RequestOutput(
                request_id=request.request_id,
                token_ids=[token],
                text=detok.take(final=reason is not None),
                logprobs=self._logprobs(token, step, sp),
                finished=reason is not None,
                finish_reason=reason,
                num_prompt_tokens=len(request.prompt_token_ids),
                num_cached_tokens=cached,
                num_output_tokens=len(output_ids),
            )
            if reason is not None:
                return
