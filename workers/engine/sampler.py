"""Turns logits into next tokens: greedy, temperature, top-k, top-p, min-p, penalties, seeds, logprobs.

Every row of a step goes through one tensor pass; each cut runs once, on the rows that use it:

1. penalties (repetition, then presence and frequency), banned tokens (EOS and stop tokens
   before min_tokens) and structured output (a grammar's allowed tokens: one bitmask for the
   batch, one row per grammar row, applied in one vectorised pass) change the logits of the rows
   that have them;
2. greedy rows (temperature 0) take the argmax, so greedy decoding matches a plain argmax oracle;
3. the other rows draw in one call of the exponential race kernel (kernels/sampling.py:
   argmax p_i / E_i with E_i ~ Exp(1)), which needs no normalised distribution and no sort, and
   takes the cuts as per-row thresholds instead of masked copies of the logits: top-k as the k-th
   largest logit (torch.topk, on the top-k rows only), min-p as max x + T log min_p (p >= min_p *
   max p), top-p by rejection: a drawn token is kept when the mass of the tokens above it is under
   top_p, which is exactly membership of the nucleus that sorting would keep, and drawing from p
   while keeping only nucleus tokens draws from p restricted to the nucleus;
4. the few rows that reject RACE_ATTEMPTS times in a row (a tiny nucleus of a flat distribution)
   take the sorted cut and race once more.

The order of the cuts is top-k, top-p, min-p, each on what the previous left, as before this
module was batched. The noise of a row comes from one 64-bit key a step: a seeded request's key is
drawn from its own torch.Generator, so its tokens do not depend on what it is batched with; the
unseeded rows share one draw from the sampler's generator. Logprobs are those of the model's
distribution (raw logits), as OpenAI reports them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from common.protocol import TokenLogprob
from common.sampling_params import SamplingParams
from kernels.sampling import exponential_race_reference, retry_keys
from kernels.token_bitmask import allocate_token_bitmask, apply_token_bitmask_reference

if TYPE_CHECKING:  # annotations only
    from workers.engine.grammar import GrammarState

# Rejection rounds for top-p before the sorted fallback; a round is accepted with probability at
# least max(top_p, largest probability), so with the usual top_p >= 0.5 eight rounds almost never run out.
RACE_ATTEMPTS = 8

# (logits, inv_temperature, keys, top_k_floor, min_p_offset, top_p, attempts) -> token ids, -1 where
# top-p rejected every attempt: KernelOps.exponential_race (kernels/sampling.py).
Race = Callable[..., torch.Tensor]
ApplyBitmask = Callable[[torch.Tensor, torch.Tensor, list[int]], None]  # (logits, bitmask, rows), in place


@dataclass
class SamplingRow:
    """What the sampler needs to know of one sequence."""

    params: SamplingParams
    output_token_ids: list[int]
    prompt_token_ids: list[int]
    generator: torch.Generator | None
    banned_token_ids: tuple[int, ...] = ()  # EOS/stop tokens while min_tokens is not reached
    # The prompt as a tensor, kept by the caller across steps so penalties do not rebuild it.
    prompt_tensor: torch.Tensor | None = None
    # The request's grammar when it has a structured output.
    grammar: GrammarState | None = None


def draw_keys(generator: torch.Generator | None, n: int) -> torch.Tensor:
    """n race keys (int64) from `generator` (torch's default one when None): one per row and step."""
    return torch.empty(n, dtype=torch.int64).random_(generator=generator)


def _rows(indices: list[int], total: int) -> slice | torch.Tensor:
    """An indexer for these rows: a slice (a view, no copy) when they are all of them."""
    return slice(None) if len(indices) == total else torch.tensor(indices, dtype=torch.long)


def _flat_ids(rows: list[SamplingRow], which: list[int], vocab: int, prompt: bool) -> torch.Tensor:
    """Indices into work.view(-1) of the output (and prompt) tokens of rows `which` (row i of
    `work` is rows[i]); repeated tokens repeat."""
    parts = []
    for i in which:
        row = rows[i]
        ids = torch.tensor(row.output_token_ids, dtype=torch.long)
        if prompt:
            given = (
                row.prompt_tensor
                if row.prompt_tensor is not None
                else torch.tensor(row.prompt_token_ids, dtype=torch.long)
            )
            ids = torch.cat([given, ids])
        parts.append(ids + i * vocab)
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


def _apply_penalties(work: torch.Tensor, rows: list[SamplingRow]) -> None:
    """Repetition penalty over prompt and output tokens (divide positive logits, multiply negative
    ones), then presence and frequency over output tokens (OpenAI's formulas), in place. Only the
    logits of tokens that occurred are touched: no pass over the vocabulary."""
    vocab = work.shape[1]
    flat = work.view(-1)
    rep = [i for i, r in enumerate(rows) if r.params.repetition_penalty != 1.0]
    if rep:
        ids = _flat_ids(rows, rep, vocab, prompt=True).unique()
        penalty = torch.tensor([r.params.repetition_penalty for r in rows])[ids // vocab]
        vals = flat[ids]
        flat[ids] = torch.where(vals > 0, vals / penalty, vals * penalty)
    pf = [
        i
        for i, r in enumerate(rows)
        if (r.params.presence_penalty or r.params.frequency_penalty) and r.output_token_ids
    ]
    if pf:
        ids, counts = _flat_ids(rows, pf, vocab, prompt=False).unique(return_counts=True)
        row_of = ids // vocab
        freq = torch.tensor([r.params.frequency_penalty for r in rows])[row_of]
        presence = torch.tensor([r.params.presence_penalty for r in rows])[row_of]
        flat[ids] -= freq * counts.to(work.dtype) + presence


def _top_p_sorted(x: torch.Tensor, inv_t: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """x with the tokens outside each row's nucleus set to -inf (the smallest prefix of the sorted
    distribution whose mass reaches top_p; the top token always stays)."""
    sorted_x, order = torch.sort(x, descending=True)
    probs = (sorted_x * inv_t[:, None]).softmax(-1)
    drop = probs.cumsum(-1) - probs >= top_p[:, None]
    return x.scatter(1, order, sorted_x.masked_fill(drop, float("-inf")))


def _cut(used: list[bool], values: list[float], none: float) -> torch.Tensor | None:
    """A per-row float32 cut tensor, `none` for rows without it; None when no row uses it."""
    if not any(used):
        return None
    return torch.tensor([v if u else none for u, v in zip(used, values)], dtype=torch.float32)


def _sample_rows(x: torch.Tensor, rows: list[SamplingRow], keys: torch.Tensor, race: Race) -> torch.Tensor:
    """Token ids [len(rows)] drawn from the non-greedy rows' logits x (float32, not modified)."""
    vocab = x.shape[1]
    params = [r.params for r in rows]
    inv_t = torch.tensor([1.0 / p.temperature for p in params], dtype=torch.float32)
    top_k_floor: torch.Tensor | None = None
    top_k = [i for i, p in enumerate(params) if 0 < p.top_k < vocab]
    if top_k:
        # The k-th largest logit of each top-k row: tokens below it are cut (ties with it stay).
        index = _rows(top_k, len(rows))
        ks = torch.tensor([params[i].top_k for i in top_k])
        top_k_floor = torch.full((len(rows),), float("-inf"))
        top_k_floor[index] = x[index].topk(int(ks.max())).values.gather(1, (ks - 1)[:, None])[:, 0]
    min_p_offset = _cut(
        [p.min_p > 0.0 for p in params],
        [p.temperature * math.log(p.min_p) if p.min_p > 0.0 else 0.0 for p in params],
        float("-inf"),
    )
    top_p = _cut([p.top_p < 1.0 for p in params], [p.top_p for p in params], 1.0)
    tokens = race(x, inv_t, keys, top_k_floor, min_p_offset, top_p, RACE_ATTEMPTS)
    missed = (tokens < 0).nonzero()[:, 0]
    if len(missed):
        # Every attempt fell outside the nucleus (a small nucleus of a flat distribution): cut it by
        # sorting what top-k left, keep min-p's cut, and race once more.
        sub = x[missed]
        if top_k_floor is not None:
            sub = sub.masked_fill(sub < top_k_floor[missed, None], float("-inf"))
        assert top_p is not None  # only a nucleus cut makes the race miss
        sub = _top_p_sorted(sub, inv_t[missed], top_p[missed].double())
        offsets = None if min_p_offset is None else min_p_offset[missed]
        tokens[missed] = race(sub, inv_t[missed], retry_keys(keys[missed], RACE_ATTEMPTS), None, offsets, None, 1)
    return tokens


def _logprobs(raw: torch.Tensor, rows: list[SamplingRow], tokens: list[int]) -> list[TokenLogprob | None]:
    out: list[TokenLogprob | None] = [None] * len(rows)
    want = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    if not want:
        return out
    # log p = x - logsumexp(x): no [rows, vocab] log_softmax, and the top ones are the top logits.
    x = raw[_rows(want, len(rows))]
    lse = torch.logsumexp(x, -1, keepdim=True)
    chosen = (x.gather(1, torch.tensor([tokens[i] for i in want])[:, None]) - lse)[:, 0].tolist()
    n_top = max(n for r in rows if (n := r.params.logprobs) is not None)
    top_logits, top_indices = x.topk(n_top) if n_top else (x[:, :0], x[:, :0].long())
    top_values, top_ids = (top_logits - lse).tolist(), top_indices.tolist()
    for j, i in enumerate(want):
        n = rows[i].params.logprobs
        out[i] = TokenLogprob(tokens[i], chosen[j], list(zip(top_ids[j][:n], top_values[j][:n])))
    return out


def _apply_grammars(
    work: torch.Tensor, rows: list[SamplingRow], constrained: list[int], apply_bitmask: ApplyBitmask
) -> None:
    """Tokens the grammar of each constrained row does not allow -> -inf, in place. Each matcher
    writes its own row of one bitmask; one masked pass then covers every constrained row."""
    bitmask = allocate_token_bitmask(len(rows), work.shape[1])
    for i in constrained:
        grammar = rows[i].grammar
        assert grammar is not None  # `constrained` lists the rows whose grammar constrains them
        grammar.fill_bitmask(bitmask, i)
    apply_bitmask(work, bitmask.to(work.device), constrained)


def sample(
    logits: torch.Tensor,
    rows: list[SamplingRow],
    generator: torch.Generator | None = None,
    race: Race = exponential_race_reference,
    apply_bitmask: ApplyBitmask = apply_token_bitmask_reference,
) -> tuple[list[int], list[TokenLogprob | None]]:
    """logits float32 [len(rows), vocab] -> chosen token ids and, where asked, logprobs.

    `generator` draws the keys of unseeded rows (torch's default generator when None); `race` is
    the exponential race kernel (KernelOps.exponential_race; the PyTorch reference by default);
    `apply_bitmask` the grammar mask's kernel (KernelOps.apply_token_bitmask).
    """
    if logits.dim() != 2 or logits.shape[0] != len(rows):
        raise ValueError(f"logits must be [len(rows)={len(rows)}, vocab], got {tuple(logits.shape)}")
    raw = logits
    penalised = [r.params.needs_penalties for r in rows]
    banned = [i for i, r in enumerate(rows) if r.banned_token_ids]
    # A grammar waiting for the end of the reasoning (workers.engine.grammar.GrammarPhase) leaves its row free.
    constrained = [i for i, r in enumerate(rows) if r.grammar is not None and r.grammar.constraining]
    work = logits.clone() if any(penalised) or banned or constrained else logits
    if constrained:
        _apply_grammars(work, rows, constrained, apply_bitmask)
    if any(penalised):
        _apply_penalties(work, rows)
    if banned:
        vocab = work.shape[1]
        ids = torch.tensor([i * vocab + t for i in banned for t in rows[i].banned_token_ids], dtype=torch.long)
        work.view(-1)[ids] = float("-inf")

    sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
    greedy = [i for i, r in enumerate(rows) if r.params.greedy]
    tokens = torch.empty(len(rows), dtype=torch.int64)
    if greedy:
        index = _rows(greedy, len(rows))
        tokens[index] = work[index].argmax(-1)
    if sampled:
        keys = torch.empty(len(sampled), dtype=torch.int64)
        seeded = [j for j, i in enumerate(sampled) if rows[i].generator is not None]
        unseeded = [j for j, i in enumerate(sampled) if rows[i].generator is None]
        for j in seeded:
            keys[j] = draw_keys(rows[sampled[j]].generator, 1)[0]
        if unseeded:
            keys[_rows(unseeded, len(sampled))] = draw_keys(generator, len(unseeded))
        index = _rows(sampled, len(rows))
        tokens[index] = _sample_rows(work[index], [rows[i] for i in sampled], keys, race)
    token_list = tokens.tolist()
    return token_list, _logprobs(raw, rows, token_list)


@dataclass
class Sampler:
    """sample() with an engine's kernel and its own generator for unseeded rows (no global RNG state)."""

    race: Race = exponential_race_reference
    generator: torch.Generator | None = None
    apply_bitmask: ApplyBitmask = apply_token_bitmask_reference

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> tuple[list[int], list[TokenLogprob | None]]:
        return sample(logits, rows, self.generator, self.race, self.apply_bitmask)
