"""Turns logits into next tokens: greedy, temperature, top-k, top-p, min-p, penalties, seeds, logprobs.

Greedy rows take the argmax of the raw logits, so greedy decoding matches a plain argmax oracle.
A seeded request draws from its own torch.Generator, so its tokens do not depend on what it is
batched with. Logprobs are those of the model's distribution (raw logits), as OpenAI reports them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workers.protocol import TokenLogprob
from workers.sampling_params import SamplingParams


@dataclass
class SamplingRow:
    """What the sampler needs to know of one sequence."""

    params: SamplingParams
    output_token_ids: list[int]
    prompt_token_ids: list[int]
    generator: torch.Generator | None
    banned_token_ids: tuple[int, ...] = ()  # EOS/stop tokens while min_tokens is not reached


def _apply_penalties(logits: torch.Tensor, row: SamplingRow) -> torch.Tensor:
    p = row.params
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(row.prompt_token_ids) | set(row.output_token_ids)), dtype=torch.long)
        if seen.numel():
            vals = logits[seen]
            logits[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and row.output_token_ids:
        ids, counts = torch.tensor(row.output_token_ids, dtype=torch.long).unique(return_counts=True)
        logits[ids] -= p.frequency_penalty * counts.to(logits.dtype) + p.presence_penalty
    return logits


def _filter(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p cuts (cut logits become -inf)."""
    logits = logits / p.temperature
    if p.top_k and p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # Keep the smallest prefix whose mass reaches top_p (the top token always stays).
        drop = probs.cumsum(-1) - probs >= p.top_p
        logits = logits.scatter(0, order[drop], float("-inf"))
    if p.min_p > 0.0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    return logits


def sample(logits: torch.Tensor, rows: list[SamplingRow]) -> tuple[list[int], list[TokenLogprob | None]]:
    """logits float32 [len(rows), vocab] -> chosen token ids and, where asked, logprobs."""
    assert logits.shape[0] == len(rows)
    raw = logits
    needs_copy = any(r.params.needs_penalties or r.banned_token_ids for r in rows)
    work = logits.clone() if needs_copy else logits
    for i, row in enumerate(rows):
        if row.params.needs_penalties:
            work[i] = _apply_penalties(work[i], row)
        if row.banned_token_ids:
            work[i, list(row.banned_token_ids)] = float("-inf")

    tokens = work.argmax(-1).tolist()
    for i, row in enumerate(rows):
        p = row.params
        if p.greedy:
            continue
        probs = _filter(work[i], p).softmax(-1)
        tokens[i] = int(torch.multinomial(probs, 1, generator=row.generator).item())

    logprobs: list[TokenLogprob | None] = [None] * len(rows)
    want = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    if want:
        lp = torch.log_softmax(raw[want], dim=-1)
        for j, i in enumerate(want):
            n = rows[i].params.logprobs
            top = []
            if n:
                values, ids = torch.topk(lp[j], n)
                top = list(zip(ids.tolist(), values.tolist()))
            logprobs[i] = TokenLogprob(tokens[i], float(lp[j, tokens[i]]), top)
    return tokens, logprobs
