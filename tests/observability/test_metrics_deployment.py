"""A real deployment of its own (Ray on 127.0.0.1, 1 prefill + 1 decode, small KV cache): metrics
move after real requests, KV events reach the router's prefix index, KV usage returns to idle, and
a prefill worker killed with ray.kill shows as down (and leaves the index) while requests still work."""

from __future__ import annotations

import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from testkit.cluster import leave_ray, serving
from testkit.harness import free_port, wait_until


def scrape(url: str) -> dict[tuple[str, frozenset], float]:
    out = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def per_worker(samples, name: str) -> dict[str, float]:
    return {dict(k[1])["worker"]: v for k, v in samples.items() if k[0] == name}


def total(samples, name: str, **labels) -> float:
    return sum(v for k, v in samples.items() if k[0] == name and all(dict(k[1]).get(a) == b for a, b in labels.items()))


@pytest.fixture(scope="module")
def deployment():
    from cluster.config import BatonConfig

    config = BatonConfig.from_options(
        port=free_port(),
        prefill_workers=1,
        decode_workers=1,
        kv_cache_memory="24MiB",
        max_num_seqs=8,
        local_prefill_threshold=32,
    )
    leave_ray()  # a private Ray of this module's own, which the deployment shuts down after it
    with serving(config, actor_name_prefix="obs-test") as running:
        yield running.deployment, running.base_url


@pytest.mark.slow
def test_real_metrics_index_idle_and_killed_worker(deployment):
    import ray

    dep, url = deployment
    # Left automatic, the routing's queue threshold is the one for a prefill pool on CPUs.
    assert dep.config.routing.prefill_queue_threshold == 1024
    interval = dep.backend.pools.health_interval_s
    before = scrape(url)
    short = httpx.post(url + "/v1/completions", timeout=120, json={"prompt": "Hi", "max_tokens": 4, "temperature": 0})
    long_prompt = "The history of the city goes back many centuries, and " * 6
    long = httpx.post(
        url + "/v1/completions", timeout=120, json={"prompt": long_prompt, "max_tokens": 4, "temperature": 0}
    )
    assert short.status_code == 200 and long.status_code == 200
    m = scrape(url)

    def d(name, **lb):
        return total(m, name, **lb) - total(before, name, **lb)

    assert (
        d("baton:generation_tokens_total")
        == short.json()["usage"]["completion_tokens"] + long.json()["usage"]["completion_tokens"]
    )
    assert (
        d("baton:prompt_tokens_total") == short.json()["usage"]["prompt_tokens"] + long.json()["usage"]["prompt_tokens"]
    )
    assert d("baton:time_to_first_token_seconds_count") == 2
    assert d("baton:routing_decisions_total", decision="local", reason="local_short_uncached") == 1
    assert d("baton:routing_decisions_total", decision="remote", reason="remote_prefill") == 1
    assert d("baton:kv_transfer_bytes_total") > 0
    assert per_worker(m, "baton:worker_up") == {"prefill-0": 1.0, "decode-0": 1.0}

    # KV events flow: the long prompt's blocks show up in the router's index for both workers (the
    # prefill worker computed them; the decode worker cached what it received), and usage goes idle.
    def settled():
        s = scrape(url)
        blocks = per_worker(s, "baton:prefix_index_blocks")
        idle = all(v == 0 for v in per_worker(s, "baton:kv_cache_usage_perc").values())
        return s if idle and blocks.get("prefill-0", 0) > 0 and blocks.get("decode-0", 0) > 0 else None

    s = wait_until(settled, 3 * interval + 5, "idle KV usage and indexed blocks")
    assert all(v == 0 for v in per_worker(s, "baton:num_requests_running").values())
    assert total(s, "baton:prefix_cache_queries_total") > 0

    # Kill the prefill worker: it shows as down within a health interval (plus the RPC failing fast)
    # and its index entries are gone; requests still succeed, prefilled on the decode worker.
    prefill = next(w.handle for w in dep.workers if w.worker_id == "prefill-0")
    ray.kill(prefill)
    killed = time.monotonic()
    s = wait_until(
        lambda: (lambda x: x if per_worker(x, "baton:worker_up").get("prefill-0") == 0.0 else None)(scrape(url)),
        interval + 10,
        "the killed worker to show as down",
    )
    assert time.monotonic() - killed <= interval + 10
    assert per_worker(s, "baton:worker_up")["decode-0"] == 1.0
    assert per_worker(s, "baton:prefix_index_blocks").get("prefill-0", 0) == 0
    assert total(s, "baton:workers_up", role="prefill") == 0
    fresh = "Rivers carry water from the mountains down to the sea, slowly, " * 6  # nothing of it is cached
    after = httpx.post(url + "/v1/completions", timeout=120, json={"prompt": fresh, "max_tokens": 3})
    assert after.status_code == 200
    status = httpx.get(url + "/v1/status", timeout=10).json()
    assert [w["alive"] for w in status["pools"]["prefill"]] == [False]
    assert status["recent"][0]["decision"] == "local" and status["recent"][0]["reason"] == "local_no_prefill_worker"
