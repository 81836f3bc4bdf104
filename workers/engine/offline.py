"""Running an engine to completion outside serving: a batch of prompts to their finished outputs,
and a token sequence's log-probabilities through the paged KV cache. Tests, benchmarks and
evaluation use these (as `LLMEngine.generate` and `LLMEngine.score`); serving steps the engine
itself (workers.shell.worker)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Protocol

import torch

from common.protocol import RequestOutput, TokenLogprob
from common.sampling_params import SamplingParams
from workers.config import EngineConfig
from workers.engine.block_manager import BlockManager
from workers.engine.model_runner import ModelRunner
from workers.engine.sequence import ScheduledChunk, Sequence
from workers.models.config import ModelConfig

__all__ = ["Completion", "Engine", "run_to_completion", "score_tokens"]

_score_ids = itertools.count()


class Engine(Protocol):
    """What these helpers use of `workers.engine.llm_engine.LLMEngine`."""

    config: EngineConfig
    model_config: ModelConfig
    block_manager: BlockManager
    runner: ModelRunner

    @property
    def max_model_len(self) -> int: ...

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams | None = None) -> str: ...

    def step(self) -> list[RequestOutput]: ...


@dataclass
class Completion:
    """A finished request, as the batch `generate` helper returns it."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    num_cached_tokens: int
    logprobs: list[TokenLogprob] | None


def run_to_completion(
    engine: Engine, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] | None = None
) -> list[Completion]:
    """Run a batch of prompts to completion (continuous batching inside) and return them in order."""
    if params is None or isinstance(params, SamplingParams):
        params = [params or SamplingParams()] * len(prompts)
    if len(params) != len(prompts):
        raise ValueError(f"got {len(prompts)} prompts but {len(params)} sampling params")
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    collected: dict[str, Completion] = {
        rid: Completion(rid, list(p), [], "", None, 0, [] if sp.logprobs is not None else None)
        for rid, p, sp in zip(ids, prompts, params)
    }
    pending = set(ids)
    while pending:
        for out in engine.step():
            done = collected.get(out.request_id)
            if done is None:
                continue
            done.token_ids.extend(out.token_ids)
            done.text += out.text
            done.num_cached_tokens = out.num_cached_tokens
            if out.logprobs is not None and done.logprobs is not None:
                done.logprobs.extend(out.logprobs)
            if out.finished:
                done.finish_reason = out.finish_reason
                pending.discard(out.request_id)
    return [collected[rid] for rid in ids]


def score_tokens(engine: Engine, token_ids: list[int], chunk_size: int | None = None) -> torch.Tensor:
    """log p(token_ids[i] | token_ids[:i]) for i = 1 .. n-1, float32 [n - 1] (for perplexity).

    Runs chunked prefill (chunk_size tokens a step, default max_num_batched_tokens) through
    the paged KV cache, so the scores see exactly what generation sees, FP8 KV included.
    Uses fresh blocks, never the prefix cache, and frees them; call it between steps.
    """
    ids = list(token_ids)
    if len(ids) < 2:
        raise ValueError(f"score needs at least 2 tokens, got {len(ids)}")
    if len(ids) > engine.max_model_len:
        raise ValueError(f"score got {len(ids)} tokens; this engine's context is {engine.max_model_len} tokens")
    vocab = engine.model_config.vocab_size
    bad = next((t for t in ids if not isinstance(t, int) or not 0 <= t < vocab), None)
    if bad is not None:
        raise ValueError(f"score got token {bad!r}, outside the vocabulary [0, {vocab})")
    chunk_size = chunk_size or engine.config.max_num_batched_tokens
    # Never scheduled: only its blocks are used.
    seq = Sequence(f"score-{next(_score_ids)}", ids, SamplingParams(max_tokens=1))
    bm = engine.block_manager
    if not bm.can_allocate(seq, len(ids)):
        raise ValueError(f"score needs {bm.blocks_needed(seq, len(ids))} free KV blocks, {bm.num_free_blocks} are free")
    bm.allocate(seq, len(ids))
    out = []
    try:
        while seq.num_computed_tokens < len(ids):
            n = min(chunk_size, len(ids) - seq.num_computed_tokens)
            out.append(engine.runner.next_token_logprobs(ScheduledChunk(seq, n)))
            seq.num_computed_tokens += n
    finally:
        bm.free(seq)
    return torch.cat(out)
