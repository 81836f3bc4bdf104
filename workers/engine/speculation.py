"""What the engine asks of speculative decoding: the protocols workers.speculative implements.

An engine is built with a speculator or without one (workers.build); the engine core knows it only
through `Speculation`, so it imports nothing of workers.speculative, which builds on the engine
(its draft model runs on a ModelRunner of its own).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, TypeVar

import torch

from common.protocol import SpecDecodeStats
from workers.engine.sequence import ScheduledChunk, Sequence


class RequestDrafts(Protocol):
    """One request's drafts, kept in its RequestState: the totals the engine reports with its outputs
    (workers.speculative.draft_budget.DraftHistory, which also keeps its recent acceptance)."""

    drafted: int
    accepted: int


class SpeculationCounters(Protocol):
    def snapshot(self) -> SpecDecodeStats: ...


# The speculator's own record of one request's drafts: the engine keeps it in the request's state
# and hands it back, knowing only its totals (RequestDrafts).
History = TypeVar("History", bound=RequestDrafts)


class Speculation(Protocol[History]):
    """An engine's speculative decoding (workers.speculative.speculator.Speculator): drafts for a step's
    decoding sequences (the scheduler's drafter) and the verdict on them once the step's tokens are drawn."""

    @property
    def counters(self) -> SpeculationCounters:
        """Since start, for EngineStats.spec_decode."""
        ...

    @property
    def drafts_with_keys(self) -> bool:
        """Whether every sampled request should have keys its drafts can be drawn with."""
        ...

    def new_history(self) -> History:
        """A new request's drafts (none yet), kept in its RequestState."""
        ...

    def prefill_kv(self, chunks: list[tuple[ScheduledChunk, bool]]) -> None:
        """A step's prompt chunks, each with whether it is a peer's (a draft model writes its KV of them)."""
        ...

    def adopt_prompt(self, seq: Sequence) -> None:
        """seq's prompt KV arrived from a prefill worker (with a draft model's part)."""
        ...

    def drafts(
        self,
        decoding: list[Sequence],
        budget: int,
        history_of: Callable[[Sequence], History | None],
        generator_of: Callable[[Sequence], torch.Generator | None],
    ) -> list[list[int]]:
        """Drafts for each of decoding, at most budget in all; none where history_of(seq) is None."""
        ...

    def observe_step(self, chunks: list[tuple[int, int, bool]], seconds: float) -> None:
        """The engine's step observer (StepObserver): what a step's tokens cost."""
        ...

    def forget(self, seq: Sequence, finished: bool) -> None:
        """The request left the engine (`finished`: it ended, rather than being aborted or handed on)."""
        ...

    def verdict(
        self,
        chunk: ScheduledChunk,
        tokens: list[int],
        history: History,
        generator: torch.Generator | None,
        generator_state: torch.Tensor | None,
    ) -> int:
        """How many of chunk's drafts the step's tokens accept; counts them in history."""
        ...
