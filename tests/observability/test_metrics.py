"""/metrics, /v1/status and /dashboard over a FakeBackend: values move by exactly what known requests imply."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from router.app import build_app
from testkit.backend import KV_BYTES_PER_TOKEN, FakeBackend
from tests.router.conftest import running_server

MODEL = "test-model"


def scrape(client) -> dict[tuple[str, frozenset], float]:
    resp = client.get("/metrics")
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(resp.text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(samples, name, **labels) -> float:
    labels.setdefault("model_name", MODEL)
    return samples.get((name, frozenset(labels.items())), 0.0)


def make(tokenizer, **kw):
    backend = FakeBackend(tokenizer, num_prefill=2, num_decode=2, **kw)
    return backend, TestClient(build_app(backend, tokenizer, MODEL, 8192), raise_server_exceptions=False)


def test_no_traffic_metrics_status_and_dashboard(tokenizer):
    _, client = make(tokenizer)
    m = scrape(client)
    for wid, role in (
        ("prefill-0", "prefill"),
        ("prefill-1", "prefill"),
        ("decode-0", "decode"),
        ("decode-1", "decode"),
    ):
        assert value(m, "baton:worker_up", worker=wid, role=role) == 1.0
        assert value(m, "baton:kv_cache_usage_perc", worker=wid, role=role) == 0.0
    assert value(m, "baton:workers_up", role="prefill") == 2 and value(m, "baton:workers_up", role="decode") == 2
    assert value(m, "baton:time_to_first_token_seconds_count") == 0
    st = client.get("/v1/status").json()
    assert [w["worker_id"] for w in st["pools"]["prefill"]] == ["prefill-0", "prefill-1"]
    assert [w["worker_id"] for w in st["pools"]["decode"]] == ["decode-0", "decode-1"]
    assert st["recent"] == [] and st["series"] == [] and st["window"]["ttft_p50_s"] is None
    assert st["totals"]["requests"] == 0 and st["routing"]["remote"] == 0
    page = client.get("/dashboard")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    for element in ('id="ttft-chart"', 'id="recent"', 'id="workers"', "/v1/status"):
        assert element in page.text


def test_counters_and_histograms_move_by_what_the_requests_imply(tokenizer):
    backend, client = make(tokenizer, first_token_delay=0.02, token_delay=0.005)
    reply_tokens = len(backend.reply_ids) + 1  # + EOS
    before = scrape(client)
    usages = []
    for i in range(3):
        r = client.post(
            "/v1/chat/completions", json={"messages": [{"role": "user", "content": f"question {i}"}], "max_tokens": 5}
        )
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
        usages.append(r.json()["usage"])
    with client.stream(
        "POST", "/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 100, "stream": True}
    ) as r:
        assert r.status_code == 200
        body = "".join(r.iter_text())
    assert body.endswith("data: [DONE]\n\n")
    prompt_stream = len(tokenizer.encode("Once upon a time"))
    m = scrape(client)

    def d(name, **lb):
        return value(m, name, **lb) - value(before, name, **lb)

    assert d("baton:prompt_tokens_total") == sum(u["prompt_tokens"] for u in usages) + prompt_stream
    assert d("baton:generation_tokens_total") == 3 * 5 + reply_tokens
    assert d("baton:request_success_total", finished_reason="length") == 3
    assert d("baton:request_success_total", finished_reason="stop") == 1
    assert d("baton:time_to_first_token_seconds_count") == 4
    assert d("baton:time_to_first_token_seconds_sum") >= 4 * 0.02
    assert d("baton:e2e_request_latency_seconds_count") == 4
    assert d("baton:inter_token_latency_seconds_count") == 3 * 4 + (reply_tokens - 1)
    assert d("baton:inter_token_latency_seconds_sum") >= 0.9 * 0.005 * (3 * 4 + reply_tokens - 1)
    for h in ("request_queue_time", "request_prefill_time", "request_decode_time"):
        assert d(f"baton:{h}_seconds_count") == 4
    assert d("baton:routing_decisions_total", decision="remote", reason="round_robin") == 4
    # The backend reports KV_BYTES_PER_TOKEN per uncached prompt token as moved KV.
    assert d("baton:kv_transfer_bytes_per_request_count") == 4
    assert d("baton:kv_transfer_bytes_total") == KV_BYTES_PER_TOKEN * (
        sum(u["prompt_tokens"] - u["prompt_tokens_details"]["cached_tokens"] for u in usages) + prompt_stream
    )
    st = client.get("/v1/status").json()
    assert st["totals"]["requests"] == 4 and st["window"]["requests"] == 4
    assert len(st["recent"]) == 4 and st["recent"][0]["output_tokens"] == reply_tokens  # newest first
    assert st["window"]["ttft_p50_s"] >= 0.02 and st["window"]["itl_p99_s"] >= st["window"]["itl_p50_s"] > 0
    r0 = st["recent"][-1]
    assert r0["decision"] == "remote" and r0["prefill_worker"] and r0["decode_worker"] and r0["ttft_s"] >= 0.02


def test_kv_usage_and_running_return_to_idle_after_requests_finish(tokenizer):
    backend, _ = make(tokenizer, token_delay=0.02)
    app = build_app(backend, tokenizer, MODEL, 8192)
    with running_server(app) as url:
        done = threading.Event()

        def slow():
            httpx.post(url + "/v1/completions", json={"prompt": "hello", "max_tokens": 40}, timeout=30)
            done.set()

        threading.Thread(target=slow, daemon=True).start()
        deadline = time.monotonic() + 5
        busy = None
        while time.monotonic() < deadline:
            m = {k: v for k, v in _scrape_url(url).items() if k[0] == "baton:kv_cache_usage_perc"}
            if any(v > 0 for v in m.values()):
                busy = m
                break
            time.sleep(0.01)
        assert busy is not None, "KV usage never rose while a request ran"
        assert done.wait(10)
        m = _scrape_url(url)
        assert [v for k, v in m.items() if k[0] in ("baton:kv_cache_usage_perc", "baton:num_requests_running")] == [
            0.0
        ] * 8


def _scrape_url(url):
    out = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def test_dead_worker_shows_down_and_failures_count(tokenizer):
    backend, client = make(tokenizer)
    backend.dead.add("prefill-1")
    m = scrape(client)
    assert value(m, "baton:worker_up", worker="prefill-1", role="prefill") == 0.0
    assert value(m, "baton:worker_up", worker="prefill-0", role="prefill") == 1.0
    assert value(m, "baton:workers_up", role="prefill") == 1
    st = client.get("/v1/status").json()
    assert [w["alive"] for w in st["pools"]["prefill"]] == [True, False]
    backend.fail_after = 0
    r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 3})
    assert r.status_code == 500
    m = scrape(client)
    assert value(m, "baton:request_failure_total") == 1
    assert sum(v for k, v in m.items() if k[0] == "baton:request_success_total") == 0
    assert client.get("/v1/status").json()["recent"][0]["error"]


def test_two_apps_keep_separate_registries(tokenizer):
    _, a = make(tokenizer)
    _, b = make(tokenizer)
    assert a.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200
    assert value(scrape(a), "baton:request_success_total", finished_reason="length") == 1
    assert value(scrape(b), "baton:request_success_total", finished_reason="length") == 0


def test_the_event_loop_lag_histogram_sees_a_blocked_loop(tokenizer):
    backend = FakeBackend(tokenizer)
    app = build_app(backend, tokenizer, MODEL, 8192)

    async def run():
        async with app.router.lifespan_context(app):
            await asyncio.sleep(0.2)  # a few samples of an idle loop
            time.sleep(0.2)  # a handler that blocks the loop for 200 ms: one sample lags by over 150 ms
            await asyncio.sleep(0.1)

    asyncio.run(run())
    with TestClient(app) as client:
        samples = scrape(client)
    count = value(samples, "baton:router_event_loop_lag_seconds_count")
    under_50ms = value(samples, "baton:router_event_loop_lag_seconds_bucket", le="0.05")
    over_100ms = count - value(samples, "baton:router_event_loop_lag_seconds_bucket", le="0.1")
    assert count >= 4 and under_50ms >= 3 and over_100ms >= 1, samples
