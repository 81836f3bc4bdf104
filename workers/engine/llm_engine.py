"""The engine: add requests, step, stream outputs. One process, no Ray, no HTTP.

    engine = load_engine(None)          # workers.build: the default model
    rid = engine.add_request(prompt_ids, SamplingParams(max_tokens=32, temperature=0))
    while engine.has_unfinished_requests():
        for out in engine.step(): ...

A step schedules (Scheduler), runs the model over the flat batch (ModelRunner), samples
(sampler), then checks stop conditions and frees finished sequences' blocks into the prefix cache.
With speculative decoding, the step also verifies decoding sequences' drafts (its speculator, built
by workers.build, workers/speculative/) and may emit several tokens of a request in one RequestOutput.
A new request is checked and given its state by workers.engine.admission.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from common.detokenizer import Decode
from common.lora import LoRAModuleSpec, LoRAStatus
from common.protocol import KVReservation, RequestOutput, ResumeState, SpecDecodeStats, TokenLogprob
from common.request import RequestContext
from common.sampling_params import SamplingParams
from common.tenants import parse_tenant_weights
from workers.config import EngineConfig
from workers.engine.admission import checked_prompt, new_request_state, replay_outputs
from workers.engine.block_manager import BlockManager
from workers.engine.grammar import GrammarCache
from workers.engine.model_runner import ModelRunner
from workers.engine.offline import Completion, run_to_completion, score_tokens
from workers.engine.request_state import RequestState
from workers.engine.sampler import Sampler, draw_keys
from workers.engine.scheduler import Scheduler
from workers.engine.scheduling_policy import SchedulingPolicy
from workers.engine.sequence import ScheduledChunk, Sequence
from workers.engine.speculation import RequestDrafts, Speculation
from workers.models.config import ModelConfig

# Called after every engine step: (its chunks as (computed before, this step, sampled), wall seconds).
StepObserver = Callable[[list[tuple[int, int, bool]], float], None]


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_usage: float
    num_free_blocks: int
    num_blocks: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_computed_tokens: int  # tokens run through the model since start (prompt, output and drafts)
    spec_decode: SpecDecodeStats = SpecDecodeStats()  # zeros without speculative decoding
    lora: LoRAStatus = LoRAStatus()  # max_loras 0: no adapters served


class LLMEngine:
    """One engine over its model runner (built by workers.build.build_engine, which also builds the
    speculator: None without --speculative-config). `decode` detokenizes (None: no tokenizer, so no
    text, stop strings or structured output); `grammars` compiles structured output's grammars."""

    def __init__(
        self,
        model_config: ModelConfig,
        config: EngineConfig,
        runner: ModelRunner,
        decode: Decode | None = None,
        grammars: GrammarCache | None = None,
        speculator: Speculation[Any] | None = None,
    ) -> None:
        self.model_config = model_config
        self.config = config
        self.runner = runner
        self.max_model_len = runner.context_limit
        # With every layer windowed, blocks that fall out of the window are released as sequences advance.
        self.block_manager = BlockManager(
            self.runner.num_blocks, config.block_size, config.enable_prefix_caching, window=model_config.kv_window
        )
        self.speculator = speculator
        self.scheduler = Scheduler(
            self.block_manager,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            self._drafts if self.speculator is not None else None,
            max_adapters=config.max_loras if runner.lora is not None else None,
            policy=SchedulingPolicy(config.scheduling_policy, parse_tenant_weights(config.tenant_weights)),
        )
        self.decode = decode
        self.eos_token_ids = set(model_config.eos_token_ids)
        # Compiled grammars for structured output (None: an engine without a tokenizer refuses them).
        self.grammars = grammars
        # Requests waiting, running or waiting for KV; prefilled ones held for a peer live in
        # the scheduler (scheduler.held) until released.
        self._requests: dict[str, RequestState] = {}
        # Unseeded requests draw their noise from this engine's own generator, seeded from the OS.
        self.sampler = Sampler(
            self.runner.ops.exponential_race,
            torch.Generator().manual_seed(int.from_bytes(os.urandom(8), "little") >> 1),
            self.runner.ops.apply_token_bitmask,
        )
        self._ids = itertools.count()
        self.num_computed_tokens = 0
        self._step_observers: list[StepObserver] = []
        if self.speculator is not None:
            self.observe_steps(self.speculator.observe_step)  # how many drafts pay depends on a step's cost

    def observe_steps(self, observer: StepObserver) -> Callable[[], None]:
        """Call `observer(chunks, seconds)` after every step (StepObserver; the cost profile, the
        speculator and BATON_STEP_LOG_DIR read steps so). Returns the function that stops it."""
        self._step_observers.append(observer)

        def stop() -> None:
            if observer in self._step_observers:
                self._step_observers.remove(observer)

        return stop

    @property
    def kv_cache_dtype(self) -> str:
        """The KV cache's element type as stored, e.g. "float32" or "float8_e4m3fn"."""
        return str(self.runner.kv_dtype).removeprefix("torch.")

    # ---- requests ------------------------------------------------------------------------
    def add_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        prefill_only: bool = False,
        context: RequestContext | None = None,
    ) -> str:
        """Queue a request. With prefill_only, it ends here after its first token and keeps its KV
        blocks (see held_block_ids / release) so they can be sent to a decode worker. `context`: who
        the request is (common.request; made at the router's edge), kept on its Sequence."""
        seq = self._new_sequence(prompt_token_ids, params, request_id, prefill_only, context)
        self.scheduler.add(seq)
        return seq.request_id

    def resume_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams | None,
        request_id: str,
        resume: ResumeState,
        context: RequestContext | None = None,
    ) -> str:
        """Continue a request another worker started and lost (migration after it died).

        Prompt + the tokens already produced are prefilled here (through the prefix cache), then
        decoding goes on after them. max_tokens, min_tokens, penalties and usage count the tokens
        already produced; the detokenizer is replayed over them one token at a time, exactly as the
        first worker ran it, so a stop string spanning the seam is still found and no text the
        client has is sent again. A seeded request's generator restarts from its seed (best-effort:
        reproducible, but not the draws the first worker would have made)."""
        seq = self._new_sequence(prompt_token_ids, params, request_id, context=context)
        state = self._requests[seq.request_id]
        try:
            replay_outputs(state, resume, self.model_config.vocab_size, self.max_model_len)
        except ValueError:
            del self._requests[seq.request_id]
            raise
        state.num_sent_tokens = len(resume.output_token_ids)
        self.scheduler.add(seq)
        return seq.request_id

    def _new_sequence(self, prompt_token_ids, params, request_id, prefill_only=False, context=None) -> Sequence:
        params = params or SamplingParams()
        params.validate()
        prompt = checked_prompt(prompt_token_ids, self.model_config.vocab_size, self.max_model_len)
        if request_id is None:
            request_id = context.request_id if context is not None else f"req-{next(self._ids)}"
        if request_id in self._requests or request_id in self.scheduler.held:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if params.stop and self.decode is None:
            raise ValueError("stop strings need a tokenizer; this engine was built without one")
        adapter = context.adapter if context is not None else None
        if adapter is not None and (self.runner.lora is None or adapter not in self.runner.lora):
            served = "none (start with --enable-lora)" if self.runner.lora is None else self.runner.lora.names
            raise ValueError(f"LoRA adapter {adapter!r} is not served here; served: {served}")
        seed = params.seed
        if seed is None and not params.greedy and self.speculator is not None and self.speculator.drafts_with_keys:
            seed = int(draw_keys(self.sampler.generator, 1)[0])  # keys of its own, which a draft can draw ahead
        drafting = self.speculator.new_history() if self.speculator is not None else None
        state = new_request_state(
            request_id, prompt, params, seed, self.decode, self.grammars, prefill_only, drafting, context
        )
        self._requests[request_id] = state
        return state.seq

    # ---- disaggregation: prefill side ------------------------------------------------------
    def held_block_ids(self, request_id: str) -> list[int]:
        """KV blocks of a finished prefill-only request, in token order."""
        return self.scheduler.held_block_ids(request_id)

    def begin_send(self, request_id: str) -> list[int]:
        return self.scheduler.begin_send(request_id)  # blocks stay allocated, aborted or not, until release()

    def release(self, request_id: str) -> bool:
        """Free a prefill-only request's blocks (they stay in the prefix cache)."""
        return self.scheduler.release_held(request_id)

    # ---- disaggregation: decode side -------------------------------------------------------
    def reserve_for_kv(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        context: RequestContext | None = None,
    ) -> KVReservation | None:
        """Set aside blocks for a prompt another worker prefills; None when there is no room now.

        Blocks already in this worker's prefix cache are reused and need not be sent.
        """
        seq = self._new_sequence(prompt_token_ids, params, request_id, context=context)
        if not self.scheduler.add_reserved(seq):
            del self._requests[request_id]
            return None
        return KVReservation(request_id, list(seq.block_ids), seq.num_cached_tokens)

    def check_kv_namespace(self, request_id: str, kv_namespace: str | None) -> None:
        """Refuse KV computed under another namespace (LoRA adapter) than the request's own: its
        blocks would be cached under the wrong prefix and its tokens decoded from the wrong KV."""
        state = self._requests.get(request_id)
        if state is not None and state.seq.kv_namespace != kv_namespace:
            raise ValueError(
                f"request {request_id!r}: KV computed under {kv_namespace or 'the base model'!r}, "
                f"the request runs under {state.seq.kv_namespace or 'the base model'!r}"
            )

    def start_decoding(self, request_id: str, first_token: int, with_draft_kv: bool = False) -> None:
        """The prompt's KV (`with_draft_kv`: and a draft model's) arrived, its first token sampled
        elsewhere: decode on."""
        state = self._requests.get(request_id)
        if state is None:
            raise ValueError(f"request {request_id!r} is not waiting for KV here")
        seq = state.seq
        if state.grammar is not None and not state.grammar.accept(first_token):
            # The prefill worker sampled it under the same grammar: a mismatch is a bug, not bad input.
            raise AssertionError(f"request {request_id!r}: first token {first_token} is not allowed by its grammar")
        self.scheduler.kv_arrived(seq)
        if with_draft_kv and self.speculator is not None:
            self.speculator.adopt_prompt(seq)
        seq.append_token(first_token)
        if state.generator is not None and not seq.sampling_params.greedy:
            # The prefill worker drew that token's key from the same seed: go on after it, so a seeded
            # request gets the tokens it would get had it been prefilled here.
            draw_keys(state.generator, 1)
        if state.detokenizer is not None:
            # The prefill worker already streamed this text; advance past it identically.
            state.detokenizer.add(seq.output_token_ids)
            state.detokenizer.take(final=False)
        state.num_sent_tokens = 1

    # ---- leaving -------------------------------------------------------------------------
    def abort(self, request_id: str) -> bool:
        """Stop a request and free its blocks (a sending one's once its transfer ends: release).
        Returns False if it was not here."""
        if self.scheduler.abort_held(request_id):
            return True
        state = self._requests.pop(request_id, None)
        if state is None:
            return False
        state.seq.finish_reason = "abort"
        self._leave(state.seq, finished=False)
        return True

    def _leave(self, seq: Sequence, finished: bool) -> None:
        """seq's request leaves: the speculator's proposer drops what it kept of it, its blocks go
        back (prefix cache)."""
        if self.speculator is not None:  # before its blocks go: a draft model's proposer looks at them
            self.speculator.forget(seq, finished)
        self.scheduler.finish(seq)

    def request_ids(self) -> list[str]:
        """Requests waiting, running or waiting for KV here (not prefilled ones held for a peer)."""
        return list(self._requests)

    def abort_all(self) -> list[str]:
        """Abort every request request_ids() lists; returns their ids. Held prefills are left to
        the calls sending them, which release them."""
        ids = self.request_ids()
        for request_id in ids:
            self.abort(request_id)
        return ids

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def has_schedulable_work(self) -> bool:
        """Whether step() would compute anything (sequences waiting for KV from a peer do not count)."""
        return self.scheduler.has_schedulable_work()

    # ---- stepping ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        started = time.perf_counter()
        sched = self.scheduler.schedule()
        if not sched.chunks:
            return []
        chunks = sched.chunks
        sample_mask = [
            c.seq.num_computed_tokens + c.num_tokens - len(c.draft_token_ids) == c.seq.num_tokens for c in chunks
        ]
        shape = None
        if self._step_observers:
            shape = [(c.seq.num_computed_tokens, c.num_tokens, s) for c, s in zip(chunks, sample_mask)]
        outputs = self._run(sched.num_tokens, chunks, sample_mask)
        if shape is not None:
            seconds = time.perf_counter() - started
            for observer in list(self._step_observers):
                observer(shape, seconds)
        return outputs

    def _run(self, num_tokens: int, chunks: list[ScheduledChunk], sample_mask: list[bool]) -> list[RequestOutput]:
        logits = self.runner.execute(chunks, sample_mask)
        if self.speculator is not None:  # prompts: a draft model's KV of them (a peer's travels too)
            self.speculator.prefill_kv(
                [
                    (c, self._requests[c.seq.request_id].prefill_only)
                    for c in chunks
                    if c.seq.num_computed_tokens < c.seq.num_prompt_tokens
                ]
            )
        self.num_computed_tokens += num_tokens
        sampled: list[ScheduledChunk] = []
        for chunk, sampling in zip(chunks, sample_mask):
            if chunk.draft_token_ids:
                sampled.append(chunk)  # its computed tokens are known once its drafts are verified
                continue
            chunk.seq.num_computed_tokens += chunk.num_tokens
            self._settle_blocks(chunk.seq)
            if sampling:
                sampled.append(chunk)
        if not sampled:
            return []
        states = [self._requests[c.seq.request_id] for c in sampled]
        rows = [row for c, s in zip(sampled, states) for row in s.sampling_rows(c.draft_token_ids, self.eos_token_ids)]
        # A seeded row's generator gives one key per emitted token, as without drafts (Speculator.verdict).
        before = [
            s.generator.get_state() if c.draft_token_ids and s.generator is not None else None
            for c, s in zip(sampled, states)
        ]
        tokens, logprobs = self.sampler(logits, rows)
        outputs = []
        at = 0
        for chunk, state, generator_state in zip(sampled, states, before):
            seq, drafts = chunk.seq, chunk.draft_token_ids
            span = slice(at, at + 1 + len(drafts))
            at = span.stop
            if not drafts:
                outputs.append(self._advance(seq, tokens[span], logprobs[span]))
                continue
            # Drafts come from the speculator, which also gave the request its drafting history.
            assert self.speculator is not None and state.drafting is not None
            accepted = self.speculator.verdict(chunk, tokens[span], state.drafting, state.generator, generator_state)
            # The last token and the accepted drafts are computed; the rejected drafts' slots go back.
            seq.num_computed_tokens += 1 + accepted
            self.block_manager.release_tail(seq)
            out = self._advance(seq, tokens[span][: accepted + 1], logprobs[span][: accepted + 1])
            if not out.finished:
                self._settle_blocks(seq)  # after _advance: the accepted drafts are in seq.token_ids now
            outputs.append(out)
        return outputs

    def _settle_blocks(self, seq: Sequence) -> None:
        """After seq's computed tokens advanced: cache its newly full blocks, release those out of the window."""
        self.block_manager.cache_computed_blocks(seq)
        # A prefill for a peer keeps every block: the transfer sends them all.
        state = self._requests.get(seq.request_id) if self.block_manager.window is not None else None
        if state is not None and not state.prefill_only:
            self.block_manager.release_out_of_window(seq)

    def _drafts(self, decoding: list[Sequence], budget: int) -> list[list[int]]:
        assert self.speculator is not None  # the scheduler's drafter only with a speculator
        return self.speculator.drafts(
            decoding,
            budget,
            self._draft_history,  # the scheduler's drafter
            lambda seq: self._requests[seq.request_id].generator,
        )

    def _draft_history(self, seq: Sequence) -> RequestDrafts | None:
        """None where seq may not draft: structured output (its grammar moves token by token), a peer's prefill."""
        state = self._requests.get(seq.request_id)
        return state.drafting if state is not None and state.grammar is None and not state.prefill_only else None

    def _advance(self, seq: Sequence, tokens: list[int], logprobs: list[TokenLogprob | None]) -> RequestOutput:
        """Append this step's tokens to seq one by one, as far as the first that ends it, and say so
        in one output (no token past a stop)."""
        state = self._requests[seq.request_id]
        drafting = state.drafting
        reason = None
        for token, logprob in zip(tokens, logprobs):
            seq.append_token(token)
            if logprob is not None:
                state.pending_logprobs.append(logprob)
            reason = state.stop_reason(token, self.eos_token_ids, self.max_model_len)
            if reason is not None:
                break
        finished = reason is not None
        text = state.detokenizer.take(final=finished) if state.detokenizer is not None else ""
        out = RequestOutput(
            request_id=seq.request_id,
            token_ids=seq.output_token_ids[state.num_sent_tokens :],
            text=text,
            logprobs=state.pending_logprobs if logprobs[0] is not None else None,
            finished=finished,
            finish_reason=reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_draft_tokens=drafting.drafted if drafting is not None else 0,
            num_accepted_tokens=drafting.accepted if drafting is not None else 0,
            num_cached_tokens=seq.num_cached_tokens,
            num_output_tokens=seq.num_output_tokens,
        )
        state.num_sent_tokens = seq.num_output_tokens
        state.pending_logprobs = []
        if finished:
            seq.finish_reason = reason
            self._leave(seq, finished=True)
            del self._requests[seq.request_id]
        elif state.prefill_only:
            self.scheduler.hold(seq)
            del self._requests[seq.request_id]
        return out

    # ---- LoRA adapters -------------------------------------------------------------------
    def load_lora_adapter(self, spec: LoRAModuleSpec) -> None:
        """Serve the adapter `spec` names from now on (read and checked now: ValueError says why not)."""
        if self.runner.lora is None:
            raise ValueError("this engine serves no LoRA adapters (start it with --enable-lora)")
        self.runner.lora.add(spec)

    def unload_lora_adapter(self, name: str) -> bool:
        """Stop serving adapter `name`; requests under it already admitted finish first. False if unknown."""
        lora = self.runner.lora
        if lora is None or name not in lora:
            return False
        if any(state.seq.adapter == name for state in self._requests.values()):
            raise ValueError(f"LoRA adapter {name!r} still has requests running; unload it once they finish")
        return lora.remove(name)

    # ---- conveniences --------------------------------------------------------------------
    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_usage=bm.usage,
            num_free_blocks=bm.num_free_blocks,
            num_blocks=bm.num_blocks,
            prefix_cache_queries=bm.prefix_queries,
            prefix_cache_hits=bm.prefix_hits,
            num_preemptions=self.scheduler.num_preemptions,
            num_computed_tokens=self.num_computed_tokens,
            spec_decode=self.speculator.counters.snapshot() if self.speculator is not None else SpecDecodeStats(),
            lora=self._lora_status(),
        )

    def _lora_status(self) -> LoRAStatus:
        lora = self.runner.lora
        if lora is None:
            return LoRAStatus()

        def adapters(seqs) -> tuple[str, ...]:
            return tuple(sorted({s.adapter for s in seqs if s.adapter is not None}))

        return LoRAStatus(
            running=adapters(self.scheduler.running),
            waiting=adapters(self.scheduler.waiting),
            resident=tuple(lora.resident),
            max_loras=lora.limits.max_loras,
            disk_loads=lora.stats.disk_loads,
            slot_loads=lora.stats.slot_loads,
            served=tuple(lora.specs.values()),
        )

    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] | None = None
    ) -> list[Completion]:
        """Run a batch of prompts to completion and return them in order (workers.engine.offline)."""
        return run_to_completion(self, prompts, params)

    def score(self, token_ids: list[int], chunk_size: int | None = None) -> torch.Tensor:
        """log p(token_ids[i] | token_ids[:i]) for i = 1 .. n-1 (workers.engine.offline)."""
        return score_tokens(self, token_ids, chunk_size)
