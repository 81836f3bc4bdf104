"""router.flow.RequestFlow without Ray or a simulator: every handler's commands, the healing logic,
every exit's end state and reason, what stale events do, and every move the transition table
refuses. The oracle is the lifecycle written out by hand."""

from __future__ import annotations

import itertools

import pytest

from common.protocol import KVReservation, PrefillFailed, PrefillResult, RequestOutput, ResumeState
from common.request import RequestContext
from common.roles import Role
from router.backend import RouteDecision
from router.flow import TERMINAL, TRANSITIONS, FlowLimits, FlowState, IllegalTransition, RequestFlow
from router.flow_commands import (
    Abort,
    Count,
    Emit,
    EndReason,
    Fail,
    MigrationGap,
    Prefill,
    QueueTokens,
    Reserve,
    StartDecode,
    Submit,
    WaitForDecode,
)
from router.trace import RequestTrace

S = FlowState


class Pools:
    """A WorkerPicker over a fixed set of live workers (the least busy one is the lowest id)."""

    def __init__(self, *live: str) -> None:
        self.live = set(live)

    def usable(self, worker_id: str) -> bool:
        return worker_id in self.live

    def pick(self, role: Role, exclude: frozenset[str] = frozenset(), context=None) -> str | None:
        ids = sorted(w for w in self.live if w.startswith(role.value) and w not in exclude)
        return ids[0] if ids else None


def new_flow(route: RouteDecision, pools: Pools, **limits) -> RequestFlow:
    return RequestFlow(RequestContext("r"), 40, route, pools, RequestTrace("r", 40), FlowLimits(**limits))


def flow_for(route: RouteDecision, *live: str, **limits) -> RequestFlow:
    return new_flow(route, Pools(*live), **limits)


REMOTE = RouteDecision("decode-0", "prefill-0")
LOCAL = RouteDecision("decode-0", None)
RESERVATION = KVReservation("r", [3, 4, 5], 16)


def out(*tokens: int, finished: bool = False, text: str = "", cached: int = 0, attempt: int = 0) -> RequestOutput:
    return RequestOutput("r", list(tokens), text=text, finished=finished, num_cached_tokens=cached, attempt=attempt)


def prefilled(first: int = 7, finished: bool = False) -> PrefillResult:
    return PrefillResult(
        out(first, finished=finished, text="a", cached=16),
        num_blocks_sent=2,
        bytes_sent=2048,
        transfer_seconds=0.25,
        prefill_seconds=0.5,
    )


def decoding(route=REMOTE, *live) -> RequestFlow:
    f = flow_for(route, *(live or ("decode-0", "decode-1", "prefill-0")))
    f.start(0.0)
    if route.prefill_worker is not None:
        f.on_reserved(RESERVATION, 0.1)
        f.on_prefill_done("prefill-0", prefilled(), 1.0)
    return f


def test_remote_prefill_reserve_prefill_first_token_decode():
    f = flow_for(REMOTE, "decode-0", "prefill-0")
    assert f.start(0.0) == [QueueTokens("prefill-0", 40), Reserve("decode-0", 0)]
    assert f.state is S.RESERVING and f.trace.prefill_worker == "prefill-0"
    assert f.workers() == ("decode-0", "prefill-0")
    assert f.on_reserved(RESERVATION, 0.1) == [Prefill("prefill-0", "decode-0", RESERVATION)]
    assert f.state is S.PREFILLING
    first = prefilled()
    assert f.on_worker_output("prefill-0", first, 1.0) == [
        Count("remote_prefill"),
        Count("kv_blocks_transferred", 2),
        Count("kv_bytes_transferred", 2048),
        QueueTokens("prefill-0", -40),
        StartDecode("decode-0", 7),
        Emit(first.output),
    ]
    assert f.state is S.DECODING and f.workers() == ("decode-0",)
    # queue: 0.1 s before the call + (0.9 s of RPC - 0.5 prefill - 0.25 transfer) = 0.25 s
    assert f.trace.queue_s == pytest.approx(0.25) and f.trace.prefill_s == 0.5 and f.trace.transfer_s == 0.25
    assert f.trace.kv_blocks == 2 and f.trace.kv_bytes == 2048 and f.trace.cached_tokens == 16
    last = out(8, 9, finished=True, text="bc")
    assert f.on_worker_output("decode-0", last, 1.2) == [Emit(last)]
    assert f.state is S.FINISHED and f.end_reason is EndReason.FINISHED and f.done and f.workers() == ()
    assert f.output_token_ids == [7, 8, 9] and f.text_chars == 3
    assert f.on_client_gone(1.3) == []  # nothing left to free


def test_local_prefill_runs_the_whole_request_on_d():
    f = flow_for(LOCAL, "decode-0")
    assert f.start(2.0) == [QueueTokens("decode-0", 40), Count("local_prefill"), Submit("decode-0", 0, None)]
    assert f.state is S.DECODING
    first = out(5, cached=32)
    assert f.on_output("decode-0", first, 2.5) == [QueueTokens("decode-0", -40), Emit(first)]
    assert f.trace.prefill_s == pytest.approx(0.5) and f.trace.cached_tokens == 32
    nxt = out(6)
    assert f.on_output("decode-0", nxt, 2.6) == [Emit(nxt)]  # counted off the queue once


def test_route_to_dead_workers_picks_others_or_fails():
    f = flow_for(REMOTE, "decode-1", "prefill-1")
    assert f.start(0.0)[-1] == Reserve("decode-1", 0) and f.prefill_worker == "prefill-1"
    f = flow_for(REMOTE, "decode-0")  # no prefill worker left: D prefills
    assert f.start(0.0)[-1] == Submit("decode-0") and f.trace.fell_back_to_local
    f = flow_for(REMOTE, "prefill-0")
    assert f.start(0.0) == [Fail("no live decode worker", EndReason.NO_WORKER)]
    assert f.state is S.FAILED and f.end_reason is EndReason.NO_WORKER and EndReason.NO_WORKER.retryable


def test_no_room_on_d_means_a_local_prefill_there():
    f = flow_for(REMOTE, "decode-0", "prefill-0")
    f.start(0.0)
    assert f.on_reserved(None, 0.1) == [Count("local_prefill"), Submit("decode-0")]
    assert f.trace.fell_back_to_local and f.trace.prefill_worker is None and f.state is S.DECODING


def test_a_one_token_answer_frees_the_reservation_beside_it():
    f = flow_for(REMOTE, "decode-0", "prefill-0")
    f.start(0.0)
    f.on_reserved(RESERVATION, 0.1)
    first = prefilled(finished=True)
    commands = f.on_prefill_done("prefill-0", first, 1.0)
    assert commands[-2:] == [Emit(first.output), Abort("decode-0", final=True)]
    assert not any(isinstance(c, StartDecode) for c in commands) and f.state is S.FINISHED


def test_a_dead_prefill_worker_is_replaced_then_d_prefills():
    f = flow_for(REMOTE, "decode-0", "prefill-0", "prefill-1")
    f.start(0.0)
    f.on_reserved(RESERVATION, 0.1)
    # P's loss reaches the flow as a lost worker (the health loop) or a failed call: the same answer
    assert f.on_worker_lost("prefill-0", failure=True, now=0.5) == [
        Count("prefill_fallbacks"),
        Abort("decode-0", final=False, wait=True),
        Count("prefill_retries"),
        Reserve("decode-0", 0),
    ]
    assert f.state is S.RESERVING and f.prefill_worker == "prefill-1"
    assert f.on_prefill_failed("prefill-0", died=True, now=0.55) == []  # the same loss told twice
    f.on_reserved(RESERVATION, 0.6)
    # prefill-1 dies too; prefill-0 was tried already: D prefills itself.
    assert f.on_prefill_failed("prefill-1", died=True, now=0.7) == [
        Count("prefill_fallbacks"),
        Abort("decode-0", final=False, wait=True),
        Count("local_prefill"),
        Submit("decode-0"),
    ]
    assert f.trace.fell_back_to_local and f.tried_prefill == {"prefill-0", "prefill-1"}
    assert f.on_prefill_done("prefill-1", prefilled(), 0.8) == []  # a late answer of a prefill it left


def test_a_failed_prefill_is_done_by_d_without_retrying_elsewhere():
    f = flow_for(REMOTE, "decode-0", "prefill-0", "prefill-1")
    f.start(0.0)
    f.on_reserved(RESERVATION, 0.1)
    assert f.on_worker_output("prefill-0", PrefillFailed("r", "timed out"), 0.2)[-1] == Submit("decode-0")


def test_a_lost_decode_worker_migrates_with_what_the_client_has():
    f = decoding()
    f.on_output("decode-0", out(8, text="b"), 1.1)
    commands = f.on_worker_lost("decode-0", failure=True, now=2.0)
    assert commands == [
        Abort("decode-0", final=False),
        Count("migrations"),
        Submit("decode-1", 1, ResumeState((7, 8), 2)),
    ]
    assert f.state is S.DECODING and f.decode_worker == "decode-1" and f.migrations == 1 and f.moves == 1
    assert f.trace.decode_worker == "decode-1"
    # what the old worker, or this one's earlier attempt, still says is dropped
    assert f.on_output("decode-0", out(99, attempt=0), 2.1) == []
    assert f.on_output("decode-1", out(99, attempt=0), 2.2) == []
    nxt = out(9, attempt=1)
    assert f.on_output("decode-1", nxt, 2.5) == [MigrationGap(0.5), Emit(nxt)]
    assert f.on_output("decode-1", out(10, attempt=1), 2.6) == [Emit(out(10, attempt=1))]  # the gap is measured once
    assert f.output_token_ids == [7, 8, 9, 10]


def test_a_loss_before_the_first_token_starts_afresh_on_another_worker():
    f = flow_for(REMOTE, "decode-0", "decode-1", "prefill-0")
    f.start(0.0)
    assert f.on_worker_lost("decode-0", failure=True, now=0.1)[-1] == Submit("decode-1", 1, None)


def test_a_drain_moves_without_using_an_attempt():
    f = decoding()
    f.on_drain("decode-0", 1.5)
    assert f.migrations == 0 and f.moves == 1 and f.decode_worker == "decode-1"


def test_losses_past_max_migrations_fail_retryably_and_free_everything():
    f = decoding(REMOTE, "decode-0", "decode-1", "prefill-0")
    f.limits = FlowLimits(max_migrations=1)
    f.on_worker_lost("decode-0", failure=True, now=1.0)
    commands = f.on_worker_lost("decode-1", failure=True, now=2.0)
    assert commands[0] == Count("migrations_failed") and commands[1] == Abort("decode-1", final=True)
    assert isinstance(commands[-1], Fail) and commands[-1].retryable and "2 times" in commands[-1].message
    assert f.state is S.FAILED and f.error == commands[-1].message and f.end_reason is EndReason.WORKER_LOST


def test_waiting_for_a_decode_worker_until_one_comes_back_or_the_wait_ends():
    pools = Pools("decode-0", "prefill-0")
    f = new_flow(REMOTE, pools, migration_wait_s=5.0)
    f.start(0.0)
    f.on_reserved(RESERVATION, 0.1)
    f.on_prefill_done("prefill-0", prefilled(), 1.0)
    pools.live.discard("decode-0")
    assert f.on_worker_lost("decode-0", failure=True, now=2.0) == [Abort("decode-0", final=False), WaitForDecode(7.0)]
    assert f.state is S.MIGRATING
    assert f.on_worker_lost("decode-0", failure=True, now=2.1) == []  # already moving off it
    assert f.on_wait(3.0) == [WaitForDecode(7.0)]
    pools.live.add("decode-0")  # restarted: free it of the request, then continue there
    assert f.on_wait(4.0) == [
        Abort("decode-0", final=False, wait=True),
        Count("migrations"),
        Submit("decode-0", 1, ResumeState((7,), 1)),
    ]
    # the same once more, but nothing comes back in time
    pools.live.clear()
    f.on_worker_lost("decode-0", failure=True, now=5.0)
    assert f.on_wait(9.0) == [WaitForDecode(10.0)]
    commands = f.on_wait(10.5)
    assert commands[0] == Count("migrations_failed") and isinstance(commands[-1], Fail)
    assert "within 5 s" in commands[-1].message and f.state is S.FAILED


def test_a_stale_loss_is_ignored():
    f = decoding()
    assert f.on_worker_lost("decode-7", failure=True, now=1.0) == [] and f.state is S.DECODING


def test_a_refused_resubmit_fails_for_good():
    f = decoding()
    f.on_worker_lost("decode-0", failure=True, now=1.0)
    commands = f.on_submit_refused("decode-1", "context too long", 1.1)
    assert commands[0] == Count("migrations_failed") and commands[-1] == Fail(
        "request r could not run on decode-1: context too long", EndReason.REFUSED
    )
    assert not commands[-1].retryable and f.end_reason is EndReason.REFUSED


def test_a_client_that_goes_away_frees_both_pools():
    f = flow_for(REMOTE, "decode-0", "prefill-0")
    f.start(0.0)
    f.on_reserved(RESERVATION, 0.1)
    assert f.on_client_gone(0.2) == [
        QueueTokens("prefill-0", -40),
        Abort("decode-0", final=True),
        Abort("prefill-0", final=True),
    ]
    assert f.state is S.ABORTED and f.end_reason is EndReason.CLIENT_GONE
    assert f.on_worker_lost("decode-0", True, 0.3) == [] and f.on_wait(0.3) == []
    assert f.on_reserved(RESERVATION, 0.4) == []  # a call that was in flight answers after the end


@pytest.mark.parametrize(
    "end,reason,retryable",
    [
        (lambda f: f.on_kv_load_failed("decode-0", "checksum", 2.0), EndReason.KV_LOAD_FAILED, True),
        (lambda f: f.on_bad_input("json_schema: unsupported keyword", 2.0), EndReason.BAD_INPUT, False),
        (lambda f: f.on_error("a call to decode-0 failed: boom", 2.0), EndReason.ERROR, False),
        (lambda f: f.on_deadline(2.0), EndReason.DEADLINE, False),
    ],
    ids=["kv_load_failed", "bad_input", "error", "deadline"],
)
def test_every_failure_ends_failed_with_its_reason_and_frees_the_workers(end, reason, retryable):
    f = decoding()
    commands = end(f)
    assert commands[:-1] == [Abort("decode-0", final=True)]
    assert commands[-1].reason is reason and commands[-1].retryable is retryable
    assert f.state is S.FAILED and f.end_reason is reason and f.error == commands[-1].message
    assert end(f) == [] and f.on_client_gone(2.1) == []  # an end is told once


def test_a_kv_load_failure_of_a_worker_the_request_left_is_stale():
    f = decoding()
    f.on_drain("decode-0", 1.5)
    assert f.on_kv_load_failed("decode-0", "checksum", 1.6) == [] and f.state is S.DECODING


# Handlers that check the state they are called in (the others drop what does not belong to it).
HANDLERS = {
    "start": lambda f: f.start(1.0),
    "on_reserved": lambda f: f.on_reserved(RESERVATION, 1.0),
}
ALLOWED = {"start": {S.ROUTED}, "on_reserved": {S.RESERVING} | TERMINAL}


@pytest.mark.parametrize("handler,state", [(h, s) for h in HANDLERS for s in S if s not in ALLOWED[h]])
def test_every_checking_handler_refuses_the_states_it_does_not_belong_to(handler, state):
    f = flow_for(REMOTE, "decode-0", "prefill-0")
    f.state = state
    with pytest.raises(IllegalTransition):
        HANDLERS[handler](f)


STALE = {
    "on_prefill_done": lambda f: f.on_prefill_done("prefill-0", prefilled(), 1.0),
    "on_prefill_failed": lambda f: f.on_prefill_failed("prefill-0", True, 1.0),
    "on_output": lambda f: f.on_output("decode-0", out(1), 1.0),
    "on_wait": lambda f: f.on_wait(1.0),
}
EXPECTED = {
    "on_prefill_done": S.PREFILLING,
    "on_prefill_failed": S.PREFILLING,
    "on_output": S.DECODING,
    "on_wait": S.MIGRATING,
}


@pytest.mark.parametrize("handler,state", [(h, s) for h in STALE for s in S if s is not EXPECTED[h]])
def test_events_for_another_state_are_dropped(handler, state):
    f = flow_for(REMOTE, "decode-0", "prefill-0")
    f.decode_worker, f.prefill_worker, f.state = "decode-0", "prefill-0", state
    assert STALE[handler](f) == [] and f.state is state


@pytest.mark.parametrize("old,new", [(a, b) for a, b in itertools.product(S, S) if b not in TRANSITIONS[a]])
def test_every_move_outside_the_table_is_refused(old, new):
    f = flow_for(REMOTE, "decode-0", "prefill-0")
    f.state = old
    with pytest.raises(IllegalTransition):
        f._move(new)
    assert f.state is old


def test_every_state_can_end():
    ends = set(TERMINAL)
    for _ in S:
        ends |= {s for s, nxt in TRANSITIONS.items() if nxt & ends}
    assert ends == set(S) and TERMINAL == {S.FINISHED, S.ABORTED, S.FAILED}
