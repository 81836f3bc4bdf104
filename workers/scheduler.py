"""Iteration-level scheduling: which sequences compute how many tokens in the next step.

Each step spends a token budget (max_num_batched_tokens). Running sequences come first, in
arrival order, the decoding ones (one token each) before those still prefilling (the rest of the
prompt, cut to what the budget has left: chunked prefill). Waiting sequences are admitted after, while
budget, sequence slots and KV blocks last. When a running sequence cannot get a block, the most
recently arrived running sequence is preempted: its blocks are freed (cached full blocks stay in
the prefix cache) and it is recomputed later from its prompt and the tokens it already produced.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from workers.block_manager import BlockManager
from workers.sequence import ScheduledChunk, Sequence, SequenceStatus


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)  # decode (1-token) chunks first
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        bm = self.block_manager
        scheduled: list[ScheduledChunk] = []

        # Decodes first, then the running prefills' next chunks: a long prompt being prefilled must
        # not take the budget from sequences that joined the batch after it and only need a token.
        computing: set[int] = set()
        for decode_pass in (True, False):
            i = 0
            while i < len(self.running) and budget > 0:
                seq = self.running[i]
                # Not RUNNING: waiting for KV from another worker, holds blocks, computes nothing.
                if (seq.status is not SequenceStatus.RUNNING or id(seq) in computing
                        or (seq.num_uncomputed_tokens == 1) != decode_pass):
                    i += 1
                    continue
                n = min(seq.num_uncomputed_tokens, budget)
                while not bm.can_allocate(seq, n):
                    victim = self._pick_victim(seq, computing)
                    self._preempt(victim)
                    out.preempted.append(victim)
                    if victim is seq:
                        break
                if seq.status is not SequenceStatus.RUNNING:
                    continue  # seq itself was preempted; self.running shrank past it
                bm.allocate(seq, n)
                scheduled.append(ScheduledChunk(seq, n))
                computing.add(id(seq))
                budget -= n
                i = self.running.index(seq) + 1  # preempting later sequences never moves seq

        # Admitting new work while preempting would only thrash.
        while not out.preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            cached = bm.find_cached_prefix(seq) if not seq.block_ids else []
            n = min(seq.num_tokens - len(cached) * bm.block_size, budget)
            if not bm.allocate_prefix_and_new(seq, cached, n):
                break
            if seq.num_output_tokens == 0 and seq.num_preemptions == 0:
                seq.num_cached_tokens = seq.num_computed_tokens
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled.append(ScheduledChunk(seq, n))
            budget -= n

        # The model runner wants single-token chunks first.
        out.chunks = [c for c in scheduled if c.num_tokens == 1] + [c for c in scheduled if c.num_tokens != 1]
        return out

    def _pick_victim(self, current: Sequence, computing: set[int]) -> Sequence:
        """The latest-arrived running sequence not yet given work this step (current last of all)."""
        for seq in reversed(self.running):
            if seq.status is SequenceStatus.RUNNING and id(seq) not in computing and seq is not current:
                return seq
        return current

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def detach(self, seq: Sequence) -> None:
        """Take a sequence out of scheduling but keep its blocks (a prefill awaiting its send)."""
        self.running.remove(seq)
        seq.status = SequenceStatus.FINISHED

    def finish(self, seq: Sequence) -> None:
        """Take a finished or aborted sequence out and release its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
