"""What the engine keeps of one request beside its Sequence: its generator, detokenizer, grammar,
logprobs not yet sent; and the two questions asked of it every step: the sampler's rows for the
positions it samples, and whether the token just appended ends it."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from common.detokenizer import IncrementalDetokenizer
from common.protocol import TokenLogprob
from workers.engine.grammar import GrammarState
from workers.engine.sampler import SamplingRow
from workers.engine.sequence import Sequence
from workers.engine.speculation import RequestDrafts


@dataclass
class RequestState:
    seq: Sequence
    generator: torch.Generator | None
    detokenizer: IncrementalDetokenizer | None
    num_sent_tokens: int = 0
    pending_logprobs: list[TokenLogprob] = field(default_factory=list)
    # Prefill-only requests stop after their first token and keep their blocks until release().
    prefill_only: bool = False
    # The prompt as a tensor, made on the first step that needs it (repetition penalty) and kept.
    prompt_tensor: torch.Tensor | None = None
    # Structured output: where the request stands in its grammar (advanced by every output token).
    grammar: GrammarState | None = None
    # Speculative decoding: its drafts' totals and recent acceptance (the speculator's
    # new_history(), workers.speculative.draft_budget.DraftHistory); None: the engine does not speculate.
    drafting: RequestDrafts | None = None

    def sampling_rows(self, draft_token_ids: tuple[int, ...], eos_token_ids: set[int]) -> list[SamplingRow]:
        """The sampler's rows for this step: one, or with drafts one per verified position j, each
        as the plain sampler would see that position once drafts[:j] are output tokens (penalties
        count them; before min_tokens, counted with them, stop tokens are banned)."""
        seq = self.seq
        p = seq.sampling_params
        if p.repetition_penalty != 1.0 and self.prompt_tensor is None:
            self.prompt_tensor = torch.tensor(seq.prompt_token_ids, dtype=torch.long)
        rows = []
        for j in range(1 + len(draft_token_ids)):
            banned: tuple[int, ...] = ()
            # A grammar decides where a structured reply ends: banning its stop token could leave it no token at all.
            if seq.num_output_tokens + j < p.min_tokens and p.structured_output is None:
                banned = tuple(set(p.stop_token_ids) | (set() if p.ignore_eos else eos_token_ids))
            output = seq.output_token_ids if j == 0 else seq.output_token_ids + list(draft_token_ids[:j])
            rows.append(
                SamplingRow(p, output, seq.prompt_token_ids, self.generator, banned, self.prompt_tensor, self.grammar)
            )
        return rows

    def stop_reason(self, token: int, eos_token_ids: set[int], max_model_len: int) -> str | None:
        """Why the request ends with `token`, just appended ("stop", "length"), or None; advances
        its grammar and detokenizer past the token."""
        seq = self.seq
        p = seq.sampling_params
        reason = None
        if not p.ignore_eos and token in eos_token_ids:
            reason = "stop"
        elif token in p.stop_token_ids:
            reason = "stop"
        if self.grammar is not None:
            accepted = self.grammar.accept(token)
            assert accepted, f"request {seq.request_id}: sampled token {token} outside its grammar"
            if self.grammar.terminated and reason is None:
                reason = "stop"  # the grammar is complete: nothing more may follow
        if self.detokenizer is not None:
            self.detokenizer.add(seq.output_token_ids)
            if self.detokenizer.stopped and reason is None:
                reason = "stop"
        if reason is None and (seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= max_model_len):
            reason = "length"
        return reason
