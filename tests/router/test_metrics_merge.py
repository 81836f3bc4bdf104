"""router.metrics_merge: any router's /metrics shows every live router's series, each labelled
with its router, as one valid exposition (Prometheus' own parser reads it back)."""

from __future__ import annotations

import os
import time

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.parser import text_string_to_metric_families

from router.metrics_merge import RouterExposition


class Workers:
    def describe(self):
        return []

    def collect(self):
        g = GaugeMetricFamily("baton:num_requests_running", "running", labels=["worker"])
        g.add_metric(["decode-0"], 3)
        yield g


def registry(requests: int) -> CollectorRegistry:
    r = CollectorRegistry(auto_describe=False)
    Counter("baton:request_success", "ok", ["model_name"], registry=r).labels("m").inc(requests)
    Histogram("baton:time_to_first_token_seconds", "ttft", buckets=(0.1, 1.0), registry=r).observe(0.5)
    r.register(Workers())
    return r


def samples(text: str) -> dict[tuple[str, tuple], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }


def test_each_router_answers_for_all_live_routers(tmp_path):
    a, b = RouterExposition("router-0", tmp_path), RouterExposition("router-1.0", tmp_path)
    ra, rb = registry(2), registry(5)
    b.publish(rb)
    text = a.render(ra).decode()
    got = samples(text)
    assert got[("baton:request_success_total", (("model_name", "m"), ("router", "router-0")))] == 2
    assert got[("baton:request_success_total", (("model_name", "m"), ("router", "router-1.0")))] == 5
    assert got[("baton:time_to_first_token_seconds_count", (("router", "router-1.0"),))] == 1
    # Worker series: the answering router's only (the same workers in every router's view).
    running = [k for k in got if k[0] == "baton:num_requests_running"]
    assert running == [("baton:num_requests_running", (("router", "router-0"), ("worker", "decode-0")))]
    # One HELP/TYPE per family: a valid exposition.
    types = [line for line in text.splitlines() if line.startswith("# TYPE")]
    assert len(types) == len(set(types))


def test_a_router_silent_for_longer_than_the_staleness_is_dropped(tmp_path):
    a, b = RouterExposition("router-0", tmp_path, stale_after_s=10), RouterExposition("router-1.0", tmp_path)
    b.publish(registry(5))
    old = time.time() - 11
    os.utime(tmp_path / "router-1.0.prom", (old, old))
    assert not any(
        s.labels.get("router") == "router-1.0"
        for f in text_string_to_metric_families(a.render(registry(2)).decode())
        for s in f.samples
    )
