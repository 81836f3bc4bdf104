"""What a worker cost model is asked and answers: one engine step's `StepShape` (what the real
scheduler put in the batch), and the `CostModel` protocol that turns it into seconds and sizes the
KV cache. The models themselves: cluster/sim/fitted_costs.py (measured on this machine) and
cluster/sim/roofline.py (GPUs from their data sheets)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

__all__ = ["CostModel", "StepShape"]


@dataclass(frozen=True)
class StepShape:
    """One engine step as the scheduler built it.

    tokens: tokens run through the model (prefill chunk tokens + one per decoding sequence);
    sampled: rows that produce a token (lm_head + sampler run for these only);
    decode_seqs / decode_context: sequences decoding one token and the sum of their contexts
      (the K/V tokens their attention reads);
    prefill_tokens / prefill_pairs: prefill chunk tokens and their causal attention pairs
      (sum over chunks of n * cached_or_computed_before + n * (n + 1) / 2);
    prefill_context: K/V tokens the prefill chunks' attention reads (sum of their contexts).
    """

    tokens: int = 0
    sampled: int = 0
    decode_seqs: int = 0
    decode_context: int = 0
    prefill_tokens: int = 0
    prefill_pairs: int = 0
    prefill_context: int = 0

    @classmethod
    def of(cls, chunks: list[tuple[int, int, bool]]) -> StepShape:
        """From (tokens computed before, tokens this step, sampled) per scheduled chunk."""
        tokens = sampled = dseqs = dctx = ptok = ppairs = pctx = 0
        for before, n, sample in chunks:
            tokens += n
            sampled += sample
            if n == 1:
                dseqs += 1
                dctx += before + 1
            else:
                ptok += n
                ppairs += n * before + n * (n + 1) // 2
                pctx += before + n
        return cls(tokens, sampled, dseqs, dctx, ptok, ppairs, pctx)


class CostModel(Protocol):
    """What the simulator needs from a worker model."""

    def step_time(self, shape: StepShape) -> float:
        """Seconds one engine step of this shape takes."""
        ...

    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V for one token over all layers (what a KV transfer moves per token)."""
        ...

    def kv_capacity_tokens(self) -> int:
        """KV tokens one worker's cache holds."""
        ...

    def gpus_per_worker(self) -> int:
        """Accelerators (or CPU slots) one worker occupies: the unit the planner spends."""
        ...
