"""Prompt lookup: drafts copied from where the sequence's latest tokens occurred before (NgramProposer)."""

from __future__ import annotations

import numpy as np
import torch

from workers.config import SpeculativeConfig
from workers.engine.sequence import ScheduledChunk, Sequence


class NgramProposer:
    """Prompt lookup: the longest suffix of n tokens (n from prompt_lookup_max down to
    prompt_lookup_min) that occurred earlier in the sequence's prompt and output; the drafts are the
    tokens that followed its latest earlier occurrence. O(len * n) numpy compares a step."""

    relative_cost = 0.0
    draws_with_keys = False

    def __init__(self, config: SpeculativeConfig) -> None:
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max

    def propose_many(
        self, seqs: list[Sequence], limits: list[int], generators: list[torch.Generator | None] | None = None
    ) -> list[list[int]]:
        return [ngram_drafts(seq.token_ids, self.min_n, self.max_n, limit) for seq, limit in zip(seqs, limits)]

    def forget(self, seq: Sequence, finished: bool) -> None:
        pass  # it keeps nothing between steps

    def prefill_kv(self, chunks: list[tuple[ScheduledChunk, bool]]) -> None:
        pass  # no KV of its own

    def adopt_prompt(self, seq: Sequence, num_cached_tokens: int) -> None:
        pass

    def drafting_seconds(self, measured: float) -> float:
        return measured  # all of its time is drafting


def ngram_drafts(token_ids: list[int], min_n: int, max_n: int, max_drafts: int) -> list[int]:
    """The tokens after the latest earlier occurrence of the longest matching suffix (see NgramProposer)."""
    length = len(token_ids)
    if max_drafts < 1 or length < min_n + 1:
        return []
    tokens = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n :]
        # Windows starting at 0 .. length - n - 1: each has at least one token after it, and the
        # suffix itself (starting at length - n) is not among them.
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: length - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return tokens[start : start + max_drafts].tolist()
    return []
