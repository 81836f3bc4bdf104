"""Sequence states of the disaggregated lifecycle, owned by the scheduler: every legal path ends
with every block accounted for, every illegal step is refused by name and changes nothing."""

from __future__ import annotations

import pytest

from common.sampling_params import SamplingParams
from workers.engine.block_manager import BlockManager
from workers.engine.scheduler import Scheduler
from workers.engine.sequence import TRANSITIONS, Sequence, SequenceStatus

S = SequenceStatus


def make(num_blocks: int = 16, block_size: int = 4, max_num_seqs: int = 8) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, block_size), max_num_seqs=max_num_seqs, max_num_batched_tokens=64)


def seq(rid: str, n: int = 10, base: int = 100) -> Sequence:
    return Sequence(rid, list(range(base, base + n)), SamplingParams())


def run_step(sched: Scheduler) -> None:
    """Schedule once and mark the chunks computed; a finished prompt gets its first token."""
    for chunk in sched.schedule().chunks:
        s = chunk.seq
        s.num_computed_tokens += chunk.num_tokens
        sched.block_manager.cache_computed_blocks(s)
        if s.num_computed_tokens == s.num_tokens:
            s.append_token(7)


def assert_all_free(sched: Scheduler, start_free: int) -> None:
    sched.check_invariants()
    assert sched.block_manager.num_free_blocks == start_free
    assert not sched.running and not sched.waiting and not sched.held


def test_every_status_has_its_transitions_and_finished_is_final():
    assert set(TRANSITIONS) == set(SequenceStatus)
    assert TRANSITIONS[S.FINISHED] == frozenset()
    assert S.FINISHED in TRANSITIONS[S.SENDING_KV] and TRANSITIONS[S.SENDING_KV] == {S.FINISHED}


def test_decode_side_reserve_then_abort_frees_every_block():
    sched = make()
    start = sched.block_manager.num_free_blocks
    s = seq("r")
    assert sched.add_reserved(s)
    assert s.status is S.WAITING_FOR_KV and len(s.block_ids) == 3 and s.num_computed_tokens == 0
    sched.check_invariants()
    assert not sched.has_schedulable_work()  # waiting for KV computes nothing
    assert sched.schedule().chunks == []
    sched.finish(s)  # the abort path
    assert s.status is S.FINISHED
    assert_all_free(sched, start)


def test_decode_side_reserve_kv_arrives_decode_finish():
    sched = make()
    start = sched.block_manager.num_free_blocks
    s = seq("r")
    assert sched.add_reserved(s)
    sched.kv_arrived(s)
    s.append_token(7)  # the first token, sampled by the prefill worker
    assert s.status is S.RUNNING and s.num_computed_tokens == 10
    assert [(c.seq.request_id, c.num_tokens) for c in sched.schedule().chunks] == [("r", 1)]
    sched.finish(s)
    assert_all_free(sched, start)


def test_reservation_refused_without_room_changes_nothing():
    sched = make(num_blocks=2)
    s = seq("big", n=12)
    assert not sched.add_reserved(s)
    assert s.status is S.WAITING and s.block_ids == [] and not sched.running
    full = make(max_num_seqs=1)
    assert full.add_reserved(seq("a"))
    assert not full.add_reserved(seq("b", base=200))  # no sequence slot left
    full.check_invariants()


def test_reservation_reuses_cached_prefix_blocks():
    sched = make()
    first = seq("a", n=10)
    sched.add(first)
    run_step(sched)
    sched.finish(first)
    second = seq("b", n=12)  # shares a's two full blocks
    assert sched.add_reserved(second)
    assert second.num_cached_tokens == 8 and second.num_computed_tokens == 8
    sched.kv_arrived(second)
    assert second.num_computed_tokens == 12
    sched.finish(second)
    sched.check_invariants()


def test_prefill_side_hold_send_release_cycle():
    sched = make()
    start = sched.block_manager.num_free_blocks
    s = seq("p")
    sched.add(s)
    run_step(sched)
    sched.hold(s)
    assert s.status is S.HELD_FOR_PEER and s not in sched.running and sched.held == {"p": s}
    assert not sched.has_schedulable_work()
    sched.check_invariants()
    blocks = sched.held_block_ids("p")
    assert sched.begin_send("p") == blocks and s.status is S.SENDING_KV
    assert sched.held_block_ids("p") == blocks
    assert sched.release_held("p") and s.status is S.FINISHED
    assert not sched.release_held("p")  # once only
    assert_all_free(sched, start)
    # Its full blocks stay in the prefix cache.
    assert len(sched.block_manager.cached_hashes()) == 2


def test_abort_of_a_held_sequence_frees_at_once():
    sched = make()
    start = sched.block_manager.num_free_blocks
    s = seq("p")
    sched.add(s)
    run_step(sched)
    sched.hold(s)
    assert sched.abort_held("p")
    assert s.status is S.FINISHED and s.finish_reason == "abort"
    assert_all_free(sched, start)
    assert not sched.abort_held("p")


def test_abort_while_sending_keeps_blocks_until_the_transfer_ends():
    sched = make()
    start = sched.block_manager.num_free_blocks
    s = seq("p")
    sched.add(s)
    run_step(sched)
    sched.hold(s)
    sched.begin_send("p")
    assert sched.abort_held("p")
    # A transfer still reads the blocks: nothing may reuse them yet.
    assert s.status is S.SENDING_KV and sched.block_manager.num_free_blocks == start - 3
    sched.check_invariants()
    assert sched.release_held("p")
    assert_all_free(sched, start)


@pytest.mark.parametrize(
    "step, match",
    [
        (lambda sched, s: sched.kv_arrived(s), "cannot go from running to running"),
        (lambda sched, s: sched.add(s), "only a new waiting sequence"),
        (lambda sched, s: sched.add_reserved(s), "only a new waiting sequence"),
        (lambda sched, s: sched.begin_send("r"), "no prefilled request 'r'"),
        (lambda sched, s: sched.held_block_ids("r"), "no prefilled request 'r'"),
    ],
)
def test_illegal_steps_on_a_running_sequence_are_refused(step, match):
    sched = make()
    s = seq("r")
    sched.add(s)
    run_step(sched)
    before = (s.status, list(s.block_ids), sched.block_manager.num_free_blocks)
    with pytest.raises(ValueError, match=match):
        step(sched, s)
    assert (s.status, s.block_ids, sched.block_manager.num_free_blocks) == before
    sched.check_invariants()


def test_illegal_steps_on_held_waiting_and_finished_sequences():
    sched = make()
    s = seq("p")
    sched.add(s)
    with pytest.raises(ValueError, match="'p' cannot go from waiting to held_for_peer"):
        sched.hold(s)  # never ran
    run_step(sched)
    sched.hold(s)
    with pytest.raises(ValueError, match="held_for_peer; finish only waiting or running"):
        sched.finish(s)
    with pytest.raises(ValueError, match="cannot go from held_for_peer to held_for_peer"):
        sched.hold(s)
    sched.begin_send("p")
    with pytest.raises(ValueError, match="cannot go from sending_kv to sending_kv"):
        sched.begin_send("p")
    sched.release_held("p")
    with pytest.raises(ValueError, match="'p' is finished"):
        sched.finish(s)
    with pytest.raises(ValueError, match="cannot go from finished to running"):
        sched.kv_arrived(s)
    other = seq("w", base=300)
    with pytest.raises(ValueError, match="'w' .* is not scheduled here"):
        sched.finish(other)  # never added
    sched.check_invariants()


def test_preempted_sequence_goes_back_to_waiting_without_blocks():
    bm = BlockManager(num_blocks=4, block_size=4, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    a, b = seq("a", n=8), seq("b", n=8, base=200)
    sched.add(a)
    sched.add(b)
    run_step(sched)  # 2 blocks each: the cache is full
    out = sched.schedule()  # both need a third block: the later one is preempted
    assert [s.request_id for s in out.preempted] == ["b"]
    assert b.status is S.WAITING and b.block_ids == [] and sched.waiting[0] is b
    for chunk in out.chunks:
        chunk.seq.num_computed_tokens += chunk.num_tokens
    sched.check_invariants()
    sched.finish(a)
    sched.finish(b)
    assert_all_free(sched, 4)
