"""A request inside the engine: its tokens, its KV blocks and where it stands."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Protocol

from common.request import RequestContext
from common.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued; needs (re)computing its tokens' KV
    RUNNING = "running"  # in the batch: prefilling or decoding
    # Decode side of a remote prefill: blocks reserved; a peer pushes the prompt's KV into them.
    WAITING_FOR_KV = "waiting_for_kv"
    # Prefill side: prompt done and first token sampled; blocks held until sent to the decode peer.
    HELD_FOR_PEER = "held_for_peer"
    # Prefill side: a transfer reads the blocks; they are freed only once it has ended.
    SENDING_KV = "sending_kv"
    FINISHED = "finished"


# Every legal status change; the scheduler checks each one (see Scheduler._move).
TRANSITIONS: dict[SequenceStatus, frozenset[SequenceStatus]] = {
    SequenceStatus.WAITING: frozenset({SequenceStatus.RUNNING, SequenceStatus.WAITING_FOR_KV, SequenceStatus.FINISHED}),
    SequenceStatus.WAITING_FOR_KV: frozenset({SequenceStatus.RUNNING, SequenceStatus.FINISHED}),
    SequenceStatus.RUNNING: frozenset({SequenceStatus.WAITING, SequenceStatus.HELD_FOR_PEER, SequenceStatus.FINISHED}),
    SequenceStatus.HELD_FOR_PEER: frozenset({SequenceStatus.SENDING_KV, SequenceStatus.FINISHED}),
    SequenceStatus.SENDING_KV: frozenset({SequenceStatus.FINISHED}),
    SequenceStatus.FINISHED: frozenset(),
}


@dataclass(eq=False)  # a sequence is itself: lists of them find and remove by identity, in O(1) a compare
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    # Tokens whose K/V are in the cache. Prefill advances it by chunks, decode by one.
    num_computed_tokens: int = 0
    # Prompt tokens found in the prefix cache when first scheduled (reported as cached_tokens).
    num_cached_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    # Hashes of this sequence's full blocks, extended as blocks fill (computed once per block).
    block_hashes: list[int] = field(default_factory=list)
    # Leading blocks the prefix cache has already seen (registered, or left to an equal block
    # registered first): each step looks only at the blocks after them.
    num_registered_blocks: int = 0
    finish_reason: str | None = None
    num_preemptions: int = 0
    # Who the request is (made at the router's edge; a bare one for requests made in process).
    context: RequestContext | None = None

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        if self.context is None:
            self.context = RequestContext(self.request_id)

    @property
    def kv_namespace(self) -> str | None:
        """Where the prefix cache's chain of this request starts (its context's namespace)."""
        assert self.context is not None  # __post_init__ makes a bare context when none was given
        return self.context.kv_namespace

    @property
    def adapter(self) -> str | None:
        """The LoRA adapter this request runs under (None: the base model)."""
        assert self.context is not None
        return self.context.adapter

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        self.output_token_ids.append(token_id)


class StepSequence(Protocol):
    """What the model runner reads of a chunk's sequence (StepInputs.of): a Sequence, or a draft
    model's view of one (workers.speculative.draft_model.DraftView)."""

    @property
    def token_ids(self) -> list[int]: ...

    @property
    def block_ids(self) -> list[int]: ...

    @property
    def num_computed_tokens(self) -> int: ...

    @property
    def num_prompt_tokens(self) -> int: ...

    @property
    def adapter(self) -> str | None: ...


@dataclass(frozen=True)
class StepChunk:
    """num_tokens new tokens of seq to compute this step, starting at seq.num_computed_tokens.

    With draft_token_ids (speculative decoding), the chunk is a decoding sequence's last token
    followed by its drafts: num_tokens = 1 + len(draft_token_ids) query positions, verified in one
    forward pass; the drafts are not in seq.token_ids until accepted. The model runner takes these;
    the scheduler makes ScheduledChunk, whose seq is a Sequence."""

    seq: StepSequence
    num_tokens: int
    draft_token_ids: tuple[int, ...] = ()

    @property
    def input_token_ids(self) -> list[int]:
        """The tokens this chunk runs through the model, in position order."""
        start = self.seq.num_computed_tokens
        end = start + self.num_tokens - len(self.draft_token_ids)
        return self.seq.token_ids[start:end] + list(self.draft_token_ids)


@dataclass(frozen=True)
class ScheduledChunk(StepChunk):
    """A chunk of a Sequence, as the scheduler plans a step (see StepChunk)."""

    seq: Sequence
