"""workers.shell.router_leases.RouterLeases on a hand-driven clock: terms, ownership, per-router
outboxes and KV-event queues (the engine-level behaviour is tests/engine/test_router_leases.py)."""

from __future__ import annotations

import pytest

from common.protocol import DEFAULT_ROUTER_ID, KVEvent, KVEventKind, RequestOutput, RouterClaim
from workers.shell.router_leases import RouterLeases


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def out(rid: str, finished: bool = False) -> RequestOutput:
    return RequestOutput(rid, [1], finished=finished)


def test_a_lease_runs_out_only_after_its_term_without_renewal():
    clock = Clock()
    leases = RouterLeases(64, clock)
    a, b = RouterClaim("a", 5.0), RouterClaim("b", 5.0)
    leases.own("a-1", a)
    leases.own("a-2", a)
    leases.own("b-1", b)
    clock.now += 4.0
    leases.renew(b)
    assert leases.take_expired() == []  # 4 s < 5 s
    clock.now += 1.5  # a: 5.5 s silent; b: 1.5 s
    assert leases.take_expired() == []  # first seen out of term: confirmed by a later check
    clock.now += 0.5
    [gone] = leases.take_expired()
    assert gone.router_id == "a" and gone.request_ids == {"a-1", "a-2"}
    assert leases.owner("a-1") is None and leases.owner("b-1") == "b"
    assert {h.router_id for h in leases.holders()} == {"b"}
    # a comes back: a new lease, with nothing of its old requests
    leases.renew(a)
    assert {h.router_id: h.requests for h in leases.holders()} == {"a": 0, "b": 1}


def test_a_renewal_between_the_two_checks_keeps_the_lease():
    """A worker that was frozen finds every lease out of term; the renewals queued meanwhile win."""
    clock = Clock()
    leases = RouterLeases(64, clock)
    a = RouterClaim("a", 5.0)
    leases.own("a-1", a)
    clock.now += 30.0  # frozen
    assert leases.take_expired() == []
    leases.renew(a)
    clock.now += 1.0
    assert leases.take_expired() == [] and leases.owner("a-1") == "a"


def test_calls_without_a_claim_belong_to_the_default_router_whose_lease_never_runs_out():
    clock = Clock()
    leases = RouterLeases(64, clock)
    leases.own("r", None)
    clock.now += 1e6
    assert leases.take_expired() == []
    assert leases.owner("r") == DEFAULT_ROUTER_ID


def test_outputs_go_to_their_routers_outbox_and_finished_requests_are_forgotten():
    leases = RouterLeases(64, Clock())
    a, b = RouterClaim("a", 5.0), RouterClaim("b", 5.0)
    leases.own("a-1", a)
    leases.own("b-1", b)
    leases.deliver([out("a-1"), out("b-1"), out("a-1", finished=True), out("unknown")])
    assert [o.request_id for o in leases.take_outputs(b, 0)] == ["b-1"]
    assert [(o.request_id, o.finished) for o in leases.take_outputs(a, 0)] == [("a-1", False), ("a-1", True)]
    assert leases.owner("a-1") is None and leases.take_outputs(a, 0) == []


def test_each_router_gets_every_kv_event_once_and_a_new_router_a_snapshot_first():
    leases = RouterLeases(8, Clock())
    a, b = RouterClaim("a", 5.0), RouterClaim("b", 5.0)
    cache = [11, 12]
    assert leases.take_kv_events(a, lambda: cache, 16).snapshot == (11, 12)  # joined late: snapshot
    stored = KVEvent(KVEventKind.STORED, (13,))
    leases.publish_kv_events([stored])
    assert leases.take_kv_events(a, lambda: cache, 16).events == [stored]
    assert leases.take_kv_events(a, lambda: cache, 16).events == []
    assert leases.take_kv_events(b, lambda: cache, 16).snapshot == (11, 12)
    # a's queue overflows (more than 8 hashes uncollected): it gets a snapshot, b its events
    leases.publish_kv_events([KVEvent(KVEventKind.STORED, tuple(range(5)))])
    leases.take_kv_events(b, lambda: cache, 16)
    leases.publish_kv_events([KVEvent(KVEventKind.STORED, tuple(range(5, 10)))])
    assert leases.pending_kv_hashes("a") == 0  # dropped at the bound
    assert leases.take_kv_events(a, lambda: cache, 16).snapshot == (11, 12)
    assert [e.block_hashes for e in leases.take_kv_events(b, lambda: cache, 16).events] == [tuple(range(5, 10))]


def test_a_claim_needs_a_name_and_a_positive_term():
    with pytest.raises(ValueError, match="router_id"):
        RouterClaim("", 5.0)
    with pytest.raises(ValueError, match="lease_s"):
        RouterClaim("a", 0)


def test_outputs_carry_the_attempt_that_created_the_request_and_a_new_attempt_is_told_apart():
    leases = RouterLeases(64, Clock())
    a = RouterClaim("a", 5.0)
    leases.own("r", a, attempt=0)
    leases.deliver([out("r")])  # queued, not yet collected, when the router gives up and comes back
    leases.forget("r")  # the router's abort before its second attempt here
    leases.own("r", a, attempt=1)
    leases.deliver([out("r"), out("r", finished=True)])
    assert [o.attempt for o in leases.take_outputs(a, 0)] == [0, 1, 1]
    leases.deliver([out("r")])  # finished: no owner any more, dropped
    assert leases.take_outputs(a, 0) == []
