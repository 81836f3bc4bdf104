"""The scheduler's priority policy (vLLM's `--scheduling-policy priority`): waiting sequences in
the order priority, then TTFT target, then arrival; a waiting sequence that finds no room preempts
running ones of a lower priority, never of its own or a higher one; a running sequence short of
blocks preempts the lowest priority first. Oracle: orders and victims worked out by hand, and the
block manager's invariants after every step of a randomized run."""

from __future__ import annotations

import random

import pytest

from common.request import RequestContext
from common.sampling_params import SamplingParams
from workers.engine.block_manager import BlockManager
from workers.engine.scheduler import Scheduler
from workers.engine.scheduling_policy import SchedulingPolicy
from workers.engine.sequence import Sequence, SequenceStatus


def make(policy: str = "priority", num_blocks: int = 16, block_size: int = 4, max_num_seqs: int = 8) -> Scheduler:
    return Scheduler(
        BlockManager(num_blocks, block_size, enable_prefix_caching=False),
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=64,
        policy=SchedulingPolicy(policy),
    )


def seq(rid: str, priority: int = 0, n: int = 6, arrival: float = 0.0, ttft_target: float | None = None) -> Sequence:
    context = RequestContext(rid, priority=priority, ttft_target=ttft_target)
    return Sequence(rid, [3 + i for i in range(n)], SamplingParams(), arrival_time=arrival, context=context)


def run_step(sched: Scheduler) -> list[str]:
    """Schedule once and mark the chunks computed (a finished prompt gets a token); the ids run."""
    ran = []
    for chunk in sched.schedule().chunks:
        s = chunk.seq
        s.num_computed_tokens += chunk.num_tokens
        sched.block_manager.cache_computed_blocks(s)
        if s.num_computed_tokens == s.num_tokens:
            s.append_token(7)
        ran.append(s.request_id)
    sched.check_invariants()
    return ran


def admission_order(sched: Scheduler) -> list[str]:
    """The order the scheduler would admit its waiting sequences in (taking each out of line)."""
    order = []
    while sched.waiting:
        seq = sched.policy.next_waiting(sched.waiting)
        sched.waiting.remove(seq)
        order.append(seq.request_id)
    return order


def test_waiting_order_is_priority_then_ttft_target_then_arrival():
    sched = make()
    for s in (
        seq("late-urgent", -5, arrival=4.0),
        seq("batch", 10, arrival=0.0),
        seq("normal-later", 0, arrival=2.0),
        seq("normal-target", 0, arrival=3.0, ttft_target=100.0),
        seq("normal-earlier", 0, arrival=1.0),
        seq("normal-tighter", 0, arrival=5.0, ttft_target=50.0),
    ):
        sched.add(s)
    assert admission_order(sched) == [
        "late-urgent",
        "normal-tighter",
        "normal-target",
        "normal-earlier",
        "normal-later",
        "batch",
    ]
    fcfs = make("fcfs")
    for s in (seq("b", 10, arrival=0.0), seq("a", -5, arrival=1.0)):
        fcfs.add(s)
    assert admission_order(fcfs) == ["b", "a"]
    with pytest.raises(ValueError, match="fcfs, priority"):
        SchedulingPolicy("lifo")


def test_an_urgent_arrival_preempts_lower_priority_running_never_the_other_way():
    sched = make(max_num_seqs=2)
    low_a, low_b = seq("low-a", 10, arrival=0.0), seq("low-b", 10, arrival=1.0)
    for s in (low_a, low_b):
        sched.add(s)
    assert run_step(sched) == ["low-a", "low-b"]
    urgent = seq("urgent", -1, arrival=2.0)
    sched.add(urgent)
    out = sched.schedule()
    # The latest-arrived of the lowest priority goes; the urgent one starts in the same step.
    assert out.preempted == [low_b] and low_b.status is SequenceStatus.WAITING
    assert {c.seq.request_id for c in out.chunks} == {"low-a", "urgent"}
    sched.check_invariants()
    # An arrival of the same priority as the running ones waits instead.
    peer = make(max_num_seqs=1)
    first, second = seq("first", 3, arrival=0.0), seq("second", 3, arrival=1.0)
    peer.add(first)
    run_step(peer)
    peer.add(second)
    out = peer.schedule()
    assert out.preempted == [] and [c.seq.request_id for c in out.chunks] == ["first"]
    # FCFS never preempts for a waiting sequence, whatever its priority.
    fcfs = make("fcfs", max_num_seqs=1)
    fcfs.add(seq("low", 10))
    run_step(fcfs)
    fcfs.add(seq("urgent", -10, arrival=1.0))
    assert fcfs.schedule().preempted == []


def test_out_of_blocks_preempts_the_lowest_priority_first():
    # 4 blocks of 4 tokens: three sequences of 5 tokens hold 2 blocks each once decoding.
    sched = make(num_blocks=6, max_num_seqs=4)
    urgent, normal, batch = (
        seq("urgent", -1, n=4, arrival=2.0),
        seq("normal", 0, n=4),
        seq("batch", 5, n=4, arrival=1.0),
    )
    for s in (normal, batch, urgent):
        sched.add(s)
    run_step(sched)  # all three prefilled: 1 block each, 3 free
    for _ in range(10):  # decode until blocks run out: the batch sequence is the one that goes
        run_step(sched)
        if sched.num_preemptions:
            break
    assert sched.num_preemptions >= 1 and batch.status is SequenceStatus.WAITING
    assert urgent.status is SequenceStatus.RUNNING and normal.status is SequenceStatus.RUNNING


def test_randomized_priorities_keep_the_block_manager_consistent_and_finish_everything():
    rng = random.Random(5)
    sched = make(num_blocks=20, max_num_seqs=4)
    start = sched.block_manager.num_free_blocks
    pending = [seq(f"r{i}", rng.choice([-2, 0, 0, 5]), n=rng.randrange(2, 14), arrival=float(i)) for i in range(24)]
    limit = {s.request_id: rng.randrange(1, 9) for s in pending}
    finished: list[Sequence] = []
    for _ in range(2000):
        if pending and rng.random() < 0.4:
            sched.add(pending.pop(0))
        run_step(sched)
        for s in list(sched.running):
            if s.status is SequenceStatus.RUNNING and s.num_output_tokens >= limit[s.request_id]:
                sched.finish(s)
                finished.append(s)
        sched.check_invariants()
        # No running sequence is of a lower priority than a waiting one that could have taken its place.
        if sched.waiting and sched.running and len(sched.running) >= sched.max_num_seqs:
            best_waiting = min(s.context.priority for s in sched.waiting)
            assert all(s.context.priority <= best_waiting for s in sched.running if s.status is SequenceStatus.RUNNING)
        if not pending and not sched.running and not sched.waiting:
            break
    assert len(finished) == 24 and sched.block_manager.num_free_blocks == start


def _tenant_seq(rid: str, tenant: str, arrival: float, n: int = 8) -> Sequence:
    context = RequestContext(rid, tenant=tenant)
    return Sequence(rid, [3 + i for i in range(n)], SamplingParams(), arrival_time=arrival, context=context)


def _token_shares(weights: dict[str, float], offered: dict[str, int], steps: int = 400) -> tuple[dict[str, int], int]:
    """Tenants offering `offered` new sequences per 10 steps (8 prompt + 8 output tokens each) to a
    scheduler of 2 sequences at a time: the tokens each got in the steps where all were backlogged,
    and the number of such steps."""
    sched = Scheduler(
        BlockManager(256, 4, enable_prefix_caching=False),
        max_num_seqs=2,
        max_num_batched_tokens=64,
        policy=SchedulingPolicy("priority", weights),
    )
    tokens = dict.fromkeys(offered, 0)
    both, count = 0, 0
    for step in range(steps):
        if step % 10 == 0:
            for tenant, n in offered.items():
                for _ in range(n):
                    count += 1
                    sched.add(_tenant_seq(f"{tenant}-{count}", tenant, float(count)))
        backlogged = {s.context.tenant for s in sched.waiting}
        out = sched.schedule()
        for chunk in out.chunks:
            s = chunk.seq
            s.num_computed_tokens += chunk.num_tokens
            if s.num_computed_tokens == s.num_tokens:
                s.append_token(7)
            if backlogged == set(offered):
                tokens[s.context.tenant] += chunk.num_tokens
        both += backlogged == set(offered)
        for s in list(sched.running):
            if s.num_output_tokens >= 8:
                sched.finish(s)
        sched.check_invariants()
    return tokens, both


@pytest.mark.parametrize("weights", [{}, {"big": 3.0}])
def test_backlogged_tenants_share_tokens_by_weight_whatever_they_offer(weights):
    # "big" offers 10 times the load of "small", and both more than their share of the 2 slots.
    tokens, both = _token_shares(weights, {"big": 20, "small": 2})
    assert both > 100
    want = weights.get("big", 1.0) / (weights.get("big", 1.0) + 1.0)
    share = tokens["big"] / (tokens["big"] + tokens["small"])
    assert abs(share - want) <= 0.1 * want, (share, want)


def test_a_tenant_alone_gets_every_token():
    sched = Scheduler(
        BlockManager(256, 4, enable_prefix_caching=False),
        max_num_seqs=4,
        max_num_batched_tokens=64,
        policy=SchedulingPolicy("priority", {"big": 9.0, "small": 1.0}),
    )
    for i in range(8):
        sched.add(_tenant_seq(f"small-{i}", "small", float(i)))
    out = sched.schedule()
    assert len(out.chunks) == 4 and sum(c.num_tokens for c in out.chunks) == 32  # the whole batch
