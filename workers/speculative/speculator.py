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

Adaptive: how many drafts each sequence verifies follows its measured acceptance, the batch's size
and the measured cost of a step's tokens (workers.speculative.draft_budget); disable_by_batch_size
(SpeculativeConfig, vLLM's key) also turns drafting off above a batch size.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from common.protocol import SpecDecodeStats
from workers.config import EngineConfig, SpeculativeConfig
from workers.engine.loader import model_bytes
from workers.engine.model_runner import ModelRunner
from workers.engine.sampler import draw_keys
from workers.engine.sequence import ScheduledChunk, Sequence
from workers.models.config import ModelConfig
from workers.speculative.draft_budget import (
    POOL_DECAY,
    POOL_PRIOR_WEIGHT,
    PRIOR_ACCEPTANCE,
    PRIOR_TOKEN_COST,
    PRIOR_WEIGHT,
    PROBE_STEPS,
    Acceptance,
    DraftHistory,
    StepCostFit,
    draft_counts,
    entry_bound,
    most_that_could_pay,
)
from workers.speculative.draft_model import AllocateKV, DraftModelProposer
from workers.speculative.ngram import NgramProposer
from workers.speculative.suffix_decoding import SuffixProposer


class Proposer(Protocol):
    """Guesses the tokens that follow a sequence (ngram here, suffix in workers.speculative.suffix_decoding, a
    draft model in workers.speculative.draft_model)."""

    # What a draft costs to propose, as a fraction of a target step: the step-cost fit's prior
    # (workers.speculative.draft_budget) until steps are measured.
    relative_cost: float
    # Whether propose_many draws its drafts with the keys the verification will use (a draft model),
    # so that every sampled request should have keys it can draw ahead.
    draws_with_keys: bool

    def prefill_kv(self, chunks: list[tuple[ScheduledChunk, bool]]) -> None:
        """A step's prompt chunks, each with whether it is a peer's: a proposer with a KV cache of its
        own writes its KV of them too (a draft model); the others keep no KV and do nothing."""
        ...

    def adopt_prompt(self, seq: Sequence, num_cached_tokens: int) -> bool | None:
        """seq's prompt KV arrived from a prefill worker (with a draft model's part, where it has one),
        except its first num_cached_tokens, found in this worker's prefix cache (a draft model
        answers whether its KV covers the whole prompt)."""
        ...

    def propose_many(
        self, seqs: list[Sequence], limits: list[int], generators: list[torch.Generator | None] | None = None
    ) -> list[list[int]]:
        """For each of seqs, at most its limit of draft tokens to follow its token_ids (possibly none).
        `generators`: for each, the generator whose next draws key its next sampled positions (None:
        greedy, or not known); a proposer with a distribution may draw its drafts with those keys."""
        ...

    def forget(self, seq: Sequence, finished: bool) -> None:
        """The request left the engine (`finished`: it ended, rather than being aborted or handed on)."""
        ...

    def drafting_seconds(self, measured: float) -> float | None:
        """What the drafts of the last propose_many cost, from its measured wall seconds, leaving out
        any one-time catching up (a draft model's first pass over a sequence's tokens); None: cannot tell."""
        ...


def make_proposer(
    config: SpeculativeConfig,
    target: ModelConfig | None = None,
    engine_config: EngineConfig | None = None,
    runner: ModelRunner | None = None,
    max_model_len: int = 0,
    allocate_kv: AllocateKV | None = None,
) -> Proposer:
    """The config's proposer; draft_model needs the target's model and engine configs and its runner
    (and takes `allocate_kv`, where its cache lives: DraftModelProposer)."""
    if config.method == "ngram":
        return NgramProposer(config)
    if config.method == "suffix":
        return SuffixProposer(config)
    if config.method == "draft_model":
        if target is None or engine_config is None or runner is None:
            raise ValueError("speculative_config.method 'draft_model' needs the engine's model (LLMEngine builds it)")
        return DraftModelProposer(
            config, target, engine_config, runner.num_blocks, max_model_len, model_bytes(runner.model), allocate_kv
        )
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
        return SpecDecodeStats(
            self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens, tuple(self.accepted_per_pos)
        )


class Speculator:
    """An engine's speculative decoding: drafts for a step's decoding sequences (the scheduler's
    drafter) and the verdict on them once the step's tokens are drawn (the engine's
    workers.engine.speculation.Speculation)."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int, proposer: Proposer | None = None) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.proposer = proposer if proposer is not None else make_proposer(config)
        self.counters = SpecDecodeCounters(config.num_speculative_tokens)
        self.pooled = Acceptance(POOL_DECAY)  # every sequence's drafts: a new sequence's prior
        self.step_cost = StepCostFit(prior=PRIOR_TOKEN_COST, draft_prior=self.proposer.relative_cost)
        self._proposal_seconds = 0.0  # the proposer's part of the current step (observe_step takes it out)
        self._steps_since_trial = 0  # drafts() calls since a probe was given only to learn the acceptance

    @classmethod
    def for_engine(
        cls,
        engine_config: EngineConfig,
        target: ModelConfig,
        runner: ModelRunner,
        max_model_len: int,
        allocate_kv: AllocateKV | None = None,
    ) -> Speculator | None:
        """The engine's speculator (None: no --speculative-config); `allocate_kv`: see make_proposer."""
        config = engine_config.speculative
        if config is None:
            return None
        return cls(
            config, max_model_len, make_proposer(config, target, engine_config, runner, max_model_len, allocate_kv)
        )

    def new_history(self) -> DraftHistory:
        """A new request's drafts (none yet), which its RequestState keeps."""
        return DraftHistory()

    def prefill_kv(self, chunks: list[tuple[ScheduledChunk, bool]]) -> None:
        """A step's prompt chunks, each with whether it is a peer's (Proposer.prefill_kv)."""
        if chunks:
            self.proposer.prefill_kv(chunks)

    @property
    def drafts_with_keys(self) -> bool:
        """Whether every sampled request should have keys its drafts can be drawn with (Proposer.draws_with_keys)."""
        return self.proposer.draws_with_keys

    def adopt_prompt(self, seq: Sequence) -> None:
        """seq's prompt KV arrived from a prefill worker (Proposer.adopt_prompt)."""
        self.proposer.adopt_prompt(seq, seq.num_cached_tokens)

    def drafts(
        self,
        decoding: list[Sequence],
        budget: int,
        history_of: Callable[[Sequence], DraftHistory | None],
        generator_of: Callable[[Sequence], torch.Generator | None] = lambda seq: None,
    ) -> list[list[int]]:
        """Drafts for each of decoding, at most budget in all, as many as pay (workers.speculative.draft_budget):
        none past disable_by_batch_size sequences, none where history_of(seq) is None (it may not
        draft), never past max_tokens or the context. The proposer is asked only for sequences
        whose first draft could pay. `generator_of(seq)`: the generator of seq's keys (Proposer.propose_many)."""
        size = self.config.disable_by_batch_size
        if size is not None and len(decoding) > size:
            return [[] for _ in decoding]
        token_cost = self.step_cost.token_cost(len(decoding))
        bound = entry_bound(len(decoding), token_cost, self.step_cost.draft_cost(len(decoding)))
        prior = self.pooled.rate(PRIOR_ACCEPTANCE, POOL_PRIOR_WEIGHT)
        # Until the worker has verified a few drafts, one probe every PROBE_STEPS steps tries them
        # whatever the bound: a proposer whose cost puts the prior acceptance under it would otherwise
        # never be tried (a draft model's probe may have to run the sequence's tokens first).
        self._steps_since_trial += 1
        trial = (
            self.pooled.accepted + self.pooled.rejections < POOL_PRIOR_WEIGHT and self._steps_since_trial > PROBE_STEPS
        )
        limits, rates, probes, histories = [], [], [], []
        for seq in decoding:
            history = history_of(seq)
            # At most max_tokens - 1 drafts more: the step's own token comes with them.
            limit = min(
                self.config.num_speculative_tokens,
                budget,
                seq.sampling_params.max_tokens - seq.num_output_tokens - 1,
                self.max_model_len - seq.num_tokens,
            )
            rate = history.recent.rate(prior, PRIOR_WEIGHT) if history is not None else 0.0
            # Probing is worth it while a fresh sequence (at the pooled rate) would draft, or as the trial above.
            probe = history is not None and history.due_a_probe and (prior > bound or trial)
            if probe and not prior > bound:
                trial, self._steps_since_trial = False, 0
            limits.append(0 if history is None else most_that_could_pay(rate, bound, limit, probe))
            rates.append(rate)
            probes.append(probe)
            histories.append(history)
        # A model proposer runs a step per draft asked for: ask only for what could pay.
        asked = [(i, seq) for i, seq in enumerate(decoding) if limits[i]]
        proposals: list[list[int]] = [[] for _ in decoding]
        if asked:
            started = time.perf_counter()
            made = self.proposer.propose_many(
                [seq for _, seq in asked], [limits[i] for i, _ in asked], [generator_of(seq) for _, seq in asked]
            )
            self._proposal_seconds = time.perf_counter() - started
            for (i, _), drafts in zip(asked, made):
                proposals[i] = drafts[: limits[i]]
            drafting = self.proposer.drafting_seconds(self._proposal_seconds)
            if drafting is not None:
                self.step_cost.observe_proposal(len(decoding), sum(map(len, proposals)), drafting)
        counts = draft_counts([len(p) for p in proposals], rates, token_cost, probes, budget)
        for history, count in zip(histories, counts):
            if history is not None and not count:
                history.skip_step()
        return [p[:count] for p, count in zip(proposals, counts)]

    def observe_step(self, chunks: list[tuple[int, int, bool]], seconds: float) -> None:
        """The engine's step observer: a step of decodes (each with or without drafts) feeds the
        step-cost fit; steps that also prefill would tie a token's cost to the prompts' lengths."""
        longest = 1 + self.config.num_speculative_tokens
        proposing, self._proposal_seconds = self._proposal_seconds, 0.0
        if all(sampled and num_tokens <= longest for _, num_tokens, sampled in chunks):
            self.step_cost.observe(len(chunks), sum(num_tokens for _, num_tokens, _ in chunks), seconds - proposing)

    def forget(self, seq: Sequence, finished: bool) -> None:
        """The request left the engine: the proposer drops what it kept of it (workers.speculative.suffix_decoding)."""
        self.proposer.forget(seq, finished)

    def verdict(
        self,
        chunk: ScheduledChunk,
        tokens: list[int],
        history: DraftHistory,
        generator: torch.Generator | None,
        generator_state: torch.Tensor | None,
    ) -> int:
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
        self.pooled.record(len(drafts), accepted)
        self.counters.record(len(drafts), accepted)
        return accepted
