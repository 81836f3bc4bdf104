"""Speculative decoding: proposers of draft tokens, the acceptance rule, and when drafting pays.

A step verifies a decoding sequence's last token plus its k drafts as one chunk of k + 1 query
positions (a prefill chunk at the sequence's current position: paged attention with causal masking,
the same path chunked prefill with a cached prefix takes), so the model gives k + 1 rows of logits.

Acceptance, for a point-mass proposal (a proposer that names one token, no distribution): at each
position j the row's token x_j is drawn exactly as the plain sampler draws it there (the full
processed distribution p_j: penalties over the output so far plus the drafts before j, banned stop
tokens before min_tokens, temperature, top-k, top-p, min-p; greedy rows take the argmax), from the
key the plain sampler would use for that output position. The draft d_{j+1} is accepted when
x_j == d_{j+1}; the first x_j that differs, or x_k after k accepted drafts (the "bonus"), is the last
token of the step. This is rejection sampling with q = delta(d): P(accept) = p(d) = min(1, p(d)/q(d)),
and a rejected position emits x ~ p given x != d, which is p with d removed and renormalised
(max(0, p - q) normalised). So every emitted token is distributed exactly as without speculation;
greedy rows give the same tokens, and a seeded row draws one key per emitted token from its own
generator (unused keys are given back), so it gives the same tokens with or without speculation,
alone or batched.

Adaptive (a simple first version): no drafts in a step with more than disable_by_batch_size decoding
sequences (SpeculativeConfig), and a sequence whose drafts were all rejected MISSES_BEFORE_PAUSE
verifications in a row drafts nothing for its next PAUSE_STEPS decode steps.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from common.protocol import SpecDecodeStats
from workers.config import SpeculativeConfig
from workers.sampler import draw_keys
from workers.sequence import ScheduledChunk, Sequence
from workers.suffix_decoding import SuffixProposer

MISSES_BEFORE_PAUSE = 4  # verifications in a row with no accepted draft before a sequence pauses
PAUSE_STEPS = 16  # decode steps a paused sequence runs without drafts before trying again


class Proposer(Protocol):
    """Guesses the tokens that follow a sequence (ngram here, suffix in workers.suffix_decoding)."""

    def propose(self, seq: Sequence, max_drafts: int) -> list[int]:
        """At most max_drafts draft tokens to follow seq.token_ids (possibly none)."""
        ...

    def forget(self, seq: Sequence, finished: bool) -> None:
        """The request left the engine (`finished`: it ended, rather than being aborted or handed on)."""
        ...


class NgramProposer:
    """Prompt lookup: the longest suffix of n tokens (n from prompt_lookup_max down to
    prompt_lookup_min) that occurred earlier in the sequence's prompt and output; the drafts are the
    tokens that followed its latest earlier occurrence. O(len * n) numpy compares a step."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max

    def propose(self, seq: Sequence, max_drafts: int) -> list[int]:
        return ngram_drafts(seq.token_ids, self.min_n, self.max_n, max_drafts)

    def forget(self, seq: Sequence, finished: bool) -> None:
        pass  # it keeps nothing between steps


def ngram_drafts(token_ids: list[int], min_n: int, max_n: int, max_drafts: int) -> list[int]:
    """The tokens after the latest earlier occurrence of the longest matching suffix (see NgramProposer)."""
    length = len(token_ids)
    if max_drafts < 1 or length < min_n + 1:
        return []
    tokens = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n:]
        # Windows starting at 0 .. length - n - 1: each has at least one token after it, and the
        # suffix itself (starting at length - n) is not among them.
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: length - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return tokens[start : start + max_drafts].tolist()
    return []


def make_proposer(config: SpeculativeConfig) -> Proposer:
    if config.method == "ngram":
        return NgramProposer(config)
    if config.method == "suffix":
        return SuffixProposer(config)
    raise ValueError(f"speculative_config.method {config.method!r} is not yet supported")  # config refuses it first


def num_accepted(tokens: list[int], drafts: tuple[int, ...] | list[int]) -> int:
    """How many drafts the step's tokens accept: the longest prefix where tokens[j] == drafts[j]
    (tokens[j] is the token drawn at the position before draft j)."""
    accepted = 0
    for token, draft in zip(tokens, drafts):
        if token != draft:
            break
        accepted += 1
    return accepted


@dataclass
class DraftHistory:
    """One request's acceptance: its totals (reported with its outputs) and its recent misses, for
    the per-sequence pause (state of the request)."""

    misses_in_a_row: int = 0
    paused_steps_left: int = 0
    drafted: int = 0
    accepted: int = 0

    def wants_drafts(self) -> bool:
        """Whether to draft this decode step (a paused sequence counts one step down)."""
        if self.paused_steps_left:
            self.paused_steps_left -= 1
            return False
        return True

    def record(self, num_drafts: int, accepted: int) -> None:
        if not num_drafts:
            return
        self.drafted += num_drafts
        self.accepted += accepted
        self.misses_in_a_row = 0 if accepted else self.misses_in_a_row + 1
        if self.misses_in_a_row >= MISSES_BEFORE_PAUSE:
            self.misses_in_a_row = 0
            self.paused_steps_left = PAUSE_STEPS


@dataclass
class SpecDecodeCounters:
    """The engine's speculative-decoding counters since start (vLLM's spec_decode metrics)."""

    num_speculative_tokens: int
    num_drafts: int = 0  # verifications: sequences that had drafts in a step
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # [j]: drafts accepted at position j

    def __post_init__(self) -> None:
        self.accepted_per_pos = [0] * self.num_speculative_tokens

    def record(self, num_drafts: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += accepted
        for j in range(accepted):
            self.accepted_per_pos[j] += 1

    def snapshot(self) -> SpecDecodeStats:
        return SpecDecodeStats(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
                               tuple(self.accepted_per_pos))


class Speculator:
    """An engine's speculative decoding: drafts for a step's decoding sequences (the scheduler's
    drafter) and the verdict on them once the step's tokens are drawn."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.proposer = make_proposer(config)
        self.counters = SpecDecodeCounters(config.num_speculative_tokens)

    def drafts(self, decoding: list[Sequence], budget: int, may_draft: Callable[[Sequence], bool]) -> list[list[int]]:
        """Drafts for each of decoding, at most budget in all: none past disable_by_batch_size
        sequences, none where may_draft(seq) says no (asked only of sequences with room for a
        draft), never past max_tokens or the context."""
        size = self.config.disable_by_batch_size
        if size is not None and len(decoding) > size:
            return [[] for _ in decoding]
        out = []
        for seq in decoding:
            # At most max_tokens - 1 drafts more: the step's own token comes with them.
            limit = min(self.config.num_speculative_tokens, budget,
                        seq.sampling_params.max_tokens - seq.num_output_tokens - 1, self.max_model_len - seq.num_tokens)
            drafts = self.proposer.propose(seq, limit)[:limit] if limit > 0 and may_draft(seq) else []
            budget -= len(drafts)
            out.append(drafts)
        return out

    def forget(self, seq: Sequence, finished: bool) -> None:
        """The request left the engine: the proposer drops what it kept of it (workers.suffix_decoding)."""
        self.proposer.forget(seq, finished)

    def verdict(self, chunk: ScheduledChunk, tokens: list[int], history: DraftHistory,
                generator: torch.Generator | None, generator_state: torch.Tensor | None) -> int:
        """How many of chunk's drafts the step's tokens (one per verified position) accept; counts
        them. A seeded row's generator, at generator_state before the step's draws, is moved on
        by one key per emitted token, as it would be without drafts."""
        drafts = chunk.draft_token_ids
        accepted = num_accepted(tokens, drafts)
        if generator is not None and generator_state is not None:
            generator.set_state(generator_state)
            if not chunk.seq.sampling_params.greedy:
                draw_keys(generator, accepted + 1)
        history.record(len(drafts), accepted)
        self.counters.record(len(drafts), accepted)
        return accepted
