"""Scheduler budget order: running decodes are served before a running prompt's next prefill chunk."""

from __future__ import annotations

from common.sampling_params import SamplingParams
from workers.engine.block_manager import BlockManager
from workers.engine.scheduler import Scheduler
from workers.engine.sequence import Sequence, SequenceStatus


def simulate_step(sched: Scheduler) -> dict[str, int]:
    """Schedule one step and mark its tokens computed (plus a sampled token for finished prompts)."""
    out = sched.schedule()
    for chunk in out.chunks:
        s = chunk.seq
        s.num_computed_tokens += chunk.num_tokens
        if s.num_computed_tokens == s.num_tokens:
            s.append_token(7)
    return {c.seq.request_id: c.num_tokens for c in out.chunks}


def arrive_with_remote_kv(sched: Scheduler, seq: Sequence) -> None:
    """What a decode worker does for a remotely prefilled request (LLMEngine.reserve_for_kv, then
    start_decoding): blocks reserved while waiting for KV, then the KV and first token land."""
    assert sched.add_reserved(seq)
    assert seq.status is SequenceStatus.WAITING_FOR_KV
    sched.kv_arrived(seq)
    seq.append_token(7)


def test_decodes_that_joined_after_a_long_local_prefill_are_not_starved():
    sched = Scheduler(BlockManager(num_blocks=200, block_size=16), max_num_seqs=8, max_num_batched_tokens=64)
    sched.add(Sequence("long", list(range(100, 600)), SamplingParams()))
    assert simulate_step(sched) == {"long": 64}
    arrive_with_remote_kv(sched, Sequence("remote", list(range(20)), SamplingParams()))
    assert [s.request_id for s in sched.running] == ["long", "remote"]
    for _ in range(3):  # the decode gets its token every step; the prefill takes what is left
        assert simulate_step(sched) == {"remote": 1, "long": 63}


def test_decode_first_order_keeps_preemption_off_already_scheduled_sequences():
    # 6 blocks of 4: two decodes hold 2 blocks each, the long prompt wants more than is left.
    bm = BlockManager(num_blocks=6, block_size=4, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=16)
    sched.add(Sequence("long", list(range(100, 140)), SamplingParams()))
    assert simulate_step(sched) == {"long": 16}  # 4 blocks
    for rid, base in (("d1", 0), ("d2", 50)):
        arrive_with_remote_kv(sched, Sequence(rid, list(range(base, base + 3)), SamplingParams()))
    assert bm.num_free_blocks == 0
    step = sched.schedule()
    # The decodes are served first; the prompt's next chunk finds no block and the only sequence
    # not yet given work this step, the prompt itself, is the one preempted (to be recomputed).
    assert {c.seq.request_id: c.num_tokens for c in step.chunks} == {"d1": 1, "d2": 1}
    assert [s.request_id for s in step.preempted] == ["long"]
    assert all(c.seq.status is SequenceStatus.RUNNING for c in step.chunks)
