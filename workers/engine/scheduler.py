"""Iteration-level scheduling: which sequences compute how many tokens in the next step.

Each step spends a token budget (max_num_batched_tokens). Running sequences come first, in
arrival order, the decoding ones (one token each) before those still prefilling (the rest of the
prompt, cut to what the budget has left: chunked prefill). Waiting sequences are admitted after, while
budget, sequence slots and KV blocks last. When a running sequence cannot get a block, the most
recently arrived running sequence is preempted: its blocks are freed (cached full blocks stay in
the prefix cache) and it is recomputed later from its prompt and the tokens it already produced.
With speculative decoding (a drafter), the decode chunks are then extended by their drafts, in the
budget and free blocks the decodes left (drafts never preempt), before the prefill chunks are cut.

The scheduler owns every sequence's status (workers.engine.sequence.SequenceStatus) and changes it only
through the methods below, each checked against TRANSITIONS:

    waiting --schedule--> running --finish--> finished          (a request served here)
    running --preempt--> waiting
    waiting --add_reserved--> waiting_for_kv --kv_arrived--> running     (decode side, remote prefill)
    running --hold--> held_for_peer --begin_send--> sending_kv --release_held--> finished   (prefill side)

`waiting` and `running` (running and waiting-for-KV sequences, in arrival order) and `held`
(held-for-peer and sending sequences, by request id) are for reading; change them through methods.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from workers.engine.block_manager import BlockManager
from workers.engine.scheduling_policy import SchedulingPolicy
from workers.engine.sequence import TRANSITIONS, ScheduledChunk, Sequence, SequenceStatus

# Speculative decoding: (this step's decoding sequences, tokens of budget left after their one token
# each) -> draft tokens for each of them (empty: none), at most that many in all.
Drafter = Callable[[list[Sequence], int], list[list[int]]]


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)  # decode (1-token) chunks first
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        drafter: Drafter | None = None,
        max_adapters: int | None = None,
        policy: SchedulingPolicy | None = None,
    ) -> None:
        self.block_manager = block_manager
        # Which waiting sequence goes first and which running one is preempted (fcfs or priority).
        self.policy = policy or SchedulingPolicy()
        # LoRA: distinct adapters one step may run (the worker's device slots); None: no limit.
        self.max_adapters = max_adapters
        self.drafter = drafter
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.held: dict[str, Sequence] = {}
        self.num_preemptions = 0

    # ---- admission -----------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        """Queue a new sequence to be computed here."""
        self._check_new(seq)
        self.policy.arrived(seq, [*self.waiting, *self.running])
        self.policy.enqueue(self.waiting, seq)

    def add_reserved(self, seq: Sequence) -> bool:
        """Decode side: reserve blocks for a new sequence whose prompt KV a peer will push.

        Cached prefix blocks are reused (they need not be sent). Returns False, changing nothing,
        when there is no sequence slot or not enough free blocks right now.
        """
        self._check_new(seq)
        if len(self.running) >= self.max_num_seqs:
            return False
        self.policy.arrived(seq, [*self.waiting, *self.running])
        bm = self.block_manager
        cached = bm.find_cached_prefix(seq)
        if not bm.allocate_prefix_and_new(seq, cached, seq.num_tokens - len(cached) * bm.block_size):
            return False
        # Blocks are reserved, KV not yet there: computed tokens count only what the cache held.
        seq.num_cached_tokens = seq.num_computed_tokens
        self._move(seq, SequenceStatus.WAITING_FOR_KV)
        self.running.append(seq)
        return True

    def kv_arrived(self, seq: Sequence) -> None:
        """Decode side: the prompt's KV landed in the reserved blocks; the sequence joins the batch."""
        self._move(seq, SequenceStatus.RUNNING, expect=SequenceStatus.WAITING_FOR_KV)
        seq.num_computed_tokens = seq.num_prompt_tokens
        self.block_manager.cache_computed_blocks(seq)

    def has_schedulable_work(self) -> bool:
        """Whether schedule() would compute anything (sequences waiting for KV do not count)."""
        return bool(self.waiting) or any(s.status is SequenceStatus.RUNNING for s in self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        bm = self.block_manager
        scheduled: list[ScheduledChunk] = []

        # Under the priority policy, a waiting sequence that finds no room first preempts running
        # ones of a lower priority (they go back to waiting, recomputed later).
        made_room = self._make_room(out, budget)
        # Decodes first, then the running prefills' next chunks: a long prompt being prefilled must
        # not take the budget from sequences that joined the batch after it and only need a token.
        computing: set[int] = set()
        adapters: set[str] = set()  # this step's LoRA adapters
        for decode_pass in (True, False):
            if not decode_pass and self.drafter is not None and scheduled:
                budget -= self._add_drafts(scheduled, budget)
            i = 0
            while i < len(self.running) and budget > 0:
                seq = self.running[i]
                # Not RUNNING: waiting for KV from another worker, holds blocks, computes nothing.
                if (
                    seq.status is not SequenceStatus.RUNNING
                    or id(seq) in computing
                    or (seq.num_uncomputed_tokens == 1) != decode_pass
                    or not self._adapter_fits(seq, adapters)
                ):
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

        # Admitting new work while running sequences lack blocks would only thrash.
        thrashing = len(out.preempted) > made_room
        while not thrashing and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.policy.next_waiting(self.waiting)
            if not self._adapter_fits(seq, adapters):
                break  # first come, first served: it waits for a step with room for its adapter
            cached = bm.find_cached_prefix(seq) if not seq.block_ids else []
            n = min(seq.num_tokens - len(cached) * bm.block_size, budget)
            if not bm.allocate_prefix_and_new(seq, cached, n):
                break
            if seq.num_output_tokens == 0 and seq.num_preemptions == 0:
                seq.num_cached_tokens = seq.num_computed_tokens
            self.waiting.remove(seq)
            assert seq.status is SequenceStatus.WAITING, seq
            self._move(seq, SequenceStatus.RUNNING)
            self.running.append(seq)
            scheduled.append(ScheduledChunk(seq, n))
            budget -= n

        # The model runner wants single-token chunks first.
        out.chunks = [c for c in scheduled if c.num_tokens == 1] + [c for c in scheduled if c.num_tokens != 1]
        self.policy.charge(out.chunks)
        return out

    def _adapter_fits(self, seq: Sequence, adapters: set[str]) -> bool:
        """Whether seq may join this step under the adapter limit; if so its adapter joins `adapters`."""
        name = seq.adapter
        if name is None or self.max_adapters is None or name in adapters:
            return True
        if len(adapters) >= self.max_adapters:
            return False
        adapters.add(name)
        return True

    def _add_drafts(self, scheduled: list[ScheduledChunk], spare: int) -> int:
        """Extend this step's decode chunks (all of `scheduled` so far) with the drafter's tokens, in the
        budget the decodes left and the blocks free now: drafts never preempt anything and never take a
        decode's place. Returns the budget they use."""
        bm, drafter = self.block_manager, self.drafter
        assert drafter is not None  # _schedule adds drafts only with a drafter
        if spare <= 0:
            return 0
        # A block left free for each running sequence not in the step yet (its prefill chunk may need
        # one): drafts must not make the prefill pass preempt.
        others = sum(1 for s in self.running if s.status is SequenceStatus.RUNNING) - len(scheduled)
        used = 0
        for i, drafts in enumerate(drafter([c.seq for c in scheduled], spare)):
            drafts = drafts[: spare - used]
            seq = scheduled[i].seq
            if not drafts or bm.blocks_needed(seq, 1 + len(drafts)) > bm.num_free_blocks - others:
                continue
            bm.allocate(seq, 1 + len(drafts))
            scheduled[i] = ScheduledChunk(seq, 1 + len(drafts), tuple(drafts))
            used += len(drafts)
        return used

    def _make_room(self, out: SchedulerOutput, budget: int) -> int:
        """Priority policy: preempt running sequences of a lower priority than the first waiting
        one while it lacks a sequence slot or the blocks of its first chunk. Returns how many."""
        if not self.policy.by_priority or not self.waiting:
            return 0
        head, bm, made = self.policy.next_waiting(self.waiting), self.block_manager, 0
        blocks = -(-min(head.num_tokens, budget) // bm.block_size)
        while len(self.running) >= self.max_num_seqs or bm.num_free_blocks < blocks:
            victim = self.policy.victim(s for s in self.running if s.status is SequenceStatus.RUNNING)
            if victim is None or not self.policy.outranks(head, victim):
                break
            self._preempt(victim)
            out.preempted.append(victim)
            made += 1
        return made

    def _pick_victim(self, current: Sequence, computing: set[int]) -> Sequence:
        """The running sequence to preempt so `current` gets its blocks: under fcfs the
        latest-arrived one not yet given work this step (current last of all); under priority the
        lowest-priority one, latest arrived first (current itself when it ranks lowest)."""
        others = [
            s
            for s in self.running
            if s.status is SequenceStatus.RUNNING and id(s) not in computing and s is not current
        ]
        if self.policy.by_priority:
            return self.policy.victim([*others, current]) or current
        return self.policy.victim(others) or current

    def _preempt(self, seq: Sequence) -> None:
        assert seq.status is SequenceStatus.RUNNING, seq
        self.running.remove(seq)
        self.block_manager.free(seq)
        self._move(seq, SequenceStatus.WAITING)
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.policy.enqueue(self.waiting, seq, front=True)

    # ---- prefill side of a remote prefill --------------------------------------------------
    def hold(self, seq: Sequence) -> None:
        """A prefilled sequence leaves the batch but keeps its blocks for sending to a peer."""
        self._move(seq, SequenceStatus.HELD_FOR_PEER, expect=SequenceStatus.RUNNING)
        self.running.remove(seq)
        self.held[seq.request_id] = seq

    def held_block_ids(self, request_id: str) -> list[int]:
        """A held sequence's blocks, in token order."""
        return list(self._held(request_id).block_ids)

    def begin_send(self, request_id: str) -> list[int]:
        """A transfer starts reading the held sequence's blocks; returns them, in token order.
        From now on they are freed only by release_held, once the transfer has ended."""
        seq = self._held(request_id)
        self._move(seq, SequenceStatus.SENDING_KV, expect=SequenceStatus.HELD_FOR_PEER)
        return list(seq.block_ids)

    def release_held(self, request_id: str) -> bool:
        """Free a held or sending sequence's blocks (full ones stay in the prefix cache).
        Returns False if no sequence is held under that id."""
        seq = self.held.pop(request_id, None)
        if seq is None:
            return False
        self.block_manager.free(seq)
        self._move(seq, SequenceStatus.FINISHED)
        return True

    def abort_held(self, request_id: str) -> bool:
        """Abort a held sequence: freed now, or, while a transfer reads its blocks, by the
        release_held that follows the transfer. Returns False if none is held under that id."""
        seq = self.held.get(request_id)
        if seq is None:
            return False
        seq.finish_reason = "abort"
        if seq.status is SequenceStatus.HELD_FOR_PEER:
            self.release_held(request_id)
        return True

    # ---- leaving -------------------------------------------------------------------------
    def finish(self, seq: Sequence) -> None:
        """Take a finished or aborted sequence out and release its blocks."""
        if seq.status is SequenceStatus.FINISHED or seq.request_id in self.held:
            raise ValueError(
                f"request {seq.request_id!r} is {seq.status.value}; finish only waiting or running "
                "sequences (held ones: release_held)"
            )
        queue = self.running if seq.status in (SequenceStatus.RUNNING, SequenceStatus.WAITING_FOR_KV) else self.waiting
        if seq not in queue:
            raise ValueError(f"request {seq.request_id!r} ({seq.status.value}) is not scheduled here")
        queue.remove(seq)
        self.block_manager.free(seq)
        self._move(seq, SequenceStatus.FINISHED)

    # ---- state ---------------------------------------------------------------------------
    def _check_new(self, seq: Sequence) -> None:
        if seq.status is not SequenceStatus.WAITING or seq.block_ids:
            raise ValueError(
                f"request {seq.request_id!r} is {seq.status.value} with {len(seq.block_ids)} blocks; "
                "only a new waiting sequence without blocks can be added"
            )

    def _held(self, request_id: str) -> Sequence:
        seq = self.held.get(request_id)
        if seq is None:
            raise ValueError(f"no prefilled request {request_id!r} holds blocks here")
        return seq

    @staticmethod
    def _move(seq: Sequence, to: SequenceStatus, expect: SequenceStatus | None = None) -> None:
        """Change seq's status; ValueError naming both states when the change is not legal."""
        if (expect is not None and seq.status is not expect) or to not in TRANSITIONS[seq.status]:
            wanted = f" (needs {expect.value})" if expect is not None else ""
            raise ValueError(f"request {seq.request_id!r} cannot go from {seq.status.value} to {to.value}{wanted}")
        seq.status = to

    def check_invariants(self) -> None:
        """Assert every sequence is where its status says and every referenced block is
        accounted for by the sequences here (tests call this; so does nothing on the hot path)."""
        for seq in self.waiting:
            assert seq.status is SequenceStatus.WAITING and not seq.block_ids, seq
        for seq in self.running:
            assert seq.status in (SequenceStatus.RUNNING, SequenceStatus.WAITING_FOR_KV), seq
        for rid, seq in self.held.items():
            assert seq.request_id == rid and seq.status in (SequenceStatus.HELD_FOR_PEER, SequenceStatus.SENDING_KV), (
                seq
            )
        refs = Counter(b for seq in [*self.running, *self.held.values()] for b in seq.block_ids)
        self.block_manager.check_invariants(refs)
