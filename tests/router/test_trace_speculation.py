"""A request's speculative-decoding totals in its trace (router.trace.RequestTrace.speculation): the
worker reports its running totals with each output; a migrated request's new worker counts from 0,
and its totals add to the old worker's. Hand-computed expectations."""

from __future__ import annotations

from router.trace import RequestTrace


def test_the_trace_adds_a_workers_running_totals_across_a_migration():
    trace = RequestTrace("r", 10)
    for drafted, accepted in ((2, 1), (6, 4), (6, 4)):  # the first worker: 6 proposed, 4 accepted
        trace.speculation(drafted, accepted)
    for drafted, accepted in ((3, 2), (5, 3)):  # the second one, after a migration: 5 and 3 more
        trace.speculation(drafted, accepted)
    assert (trace.spec_draft_tokens, trace.spec_accepted_tokens) == (11, 7)
    assert trace.to_dict()["spec_draft_tokens"] == 11 and trace.to_dict()["spec_accepted_tokens"] == 7
