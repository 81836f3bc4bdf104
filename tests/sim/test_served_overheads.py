"""The serving overheads read off a real server's step logs and client (cluster.sim.served_overheads), and
its routing decisions off /metrics (served_routes there), on made-up logs worked out
by hand."""

from __future__ import annotations

import pytest

from cluster.sim.served_overheads import served_overheads, served_routes

RPC_S = 0.002


def test_stream_and_router_overheads_from_steps_and_token_times():
    # A: 10 tokens, prefilled by the decode worker: sent at 0, its prompt's step runs 0.010-0.040,
    # then its rows (10, 1) and (11, 1) at 0.040-0.070 and 0.070-0.100; each token reaches the
    # client 8 ms after its step ends. B: 100 tokens, prefilled by the prefill worker 1.020-1.250,
    # its first token at the client 12 ms later.
    decode = [(0.010, 0.040, [(0, 10, True)]), (0.040, 0.070, [(10, 1, True)]), (0.070, 0.100, [(11, 1, True)])]
    prefill = [(1.020, 1.250, [(0, 100, True)])]
    a = {"prompt_len": 10, "sent_monotonic": 0.0, "token_times": [0.048, 0.078, 0.108]}
    b = {"prompt_len": 100, "sent_monotonic": 1.0, "token_times": [1.262]}
    got = served_overheads([a, b], prefill, decode, RPC_S, isolated=[a, b])
    assert got["stream_s"] == pytest.approx(0.008)  # the decoded tokens' lags: 8 ms, 8 ms
    # A: 10 ms to its step, less half a call to the decode worker; B: 20 ms, less the reservation's
    # round trip and half the prefill call: the median of 9 and 17 ms.
    assert got["router_s"] == pytest.approx((0.010 - RPC_S / 2 + 0.020 - 1.5 * RPC_S) / 2)
    assert got["remote_first_token_s"] == pytest.approx(0.012)
    assert (got["tokens"], got["isolated_requests"]) == (2, 2)


def test_without_matching_steps_nothing_is_measured():
    got = served_overheads([{"prompt_len": 5, "sent_monotonic": 0.0, "token_times": [1.0, 2.0]}], [], [], RPC_S)
    assert got["stream_s"] is None and got["router_s"] is None and got["tokens"] == 0


def test_routing_decisions_by_reason_from_the_routers_metrics():
    metrics = "\n".join(
        [
            "# TYPE baton:routing_decisions counter",
            'baton:routing_decisions_total{decision="remote",model_name="m",reason="remote_prefill"} 12.0',
            'baton:routing_decisions_total{decision="local",model_name="m",reason="local_prefill_busy"} 3.0',
            'baton:routing_decisions_total{decision="local",model_name="m",reason="remote_prefill_failed"} 1.0',
            'baton:routing_decisions_created{decision="local",model_name="m",reason="local_prefill_busy"} 1.7e9',
        ]
    )
    assert served_routes(metrics) == {
        "remote_prefill": 12,
        "local_prefill_busy": 3,
        "remote_prefill_fallback_local": 1,
    }
