"""Prometheus metrics and the `/v1/status` snapshot behind the operator dashboard.

One `RouterMetrics` per app, with its own `CollectorRegistry` (never the global one), so several
apps and tests coexist in one process. Names follow vLLM's with the `baton:` prefix and a
`model_name` label; per-worker series add `worker` and `role`.

Two sources:
- request metrics, observed by the router when a request finishes (its `RequestTrace`):
  token counters, latency histograms, KV transfer bytes/seconds, routing decisions;
- worker metrics, read from the backend's worker snapshot at scrape time (a custom collector):
  running/waiting, KV usage, prefix cache queries/hits, worker up/down, structured output's grammar
  cache hits/misses and compile-time histogram (the worker's GrammarCounts). Nothing polls workers
  for a scrape: the backend's health loop already keeps that snapshot fresh;
- admission, read from the router's gates at scrape time: requests running and waiting per pool,
  and requests refused (429 queue full, 503 deadline while waiting) by reason.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import Counter as Tally
from collections import deque
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from common.protocol import COMPILE_SECONDS_BUCKETS
from common.roles import Role
from common.stats import percentiles
from router.backend import ServingBackend
from router.trace import RequestTrace

__all__ = ["CONTENT_TYPE", "RouterMetrics"]

log = logging.getLogger("baton.router.trace")

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# A thinned version of vLLM's buckets reaching lower (GPU runs are fast) and higher (CPU runs are
# slow). Thinned because every bucket is a series to scrape: /metrics must stay cheap (< 5 ms).
MAX_CLASS_LABELS = 32  # distinct priorities and tenants labelled on their own
TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
LOOP_LAG_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.4, 0.75, 1.0, 2.5, 5.0, 10.0)
REQUEST_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 480.0)
BYTES_BUCKETS = tuple(float(1 << k) for k in range(10, 34, 3))  # 1 KiB .. 8 GiB

STATUS_WINDOW_S = 60.0


class _WorkerCollector:
    """Per-worker gauges and counters, read from the backend's snapshot at scrape time."""

    def __init__(self, owner: RouterMetrics) -> None:
        self.owner = owner

    def describe(self):  # no describe-time collection (the registry would call collect otherwise)
        return []

    def collect(self):
        m = self.owner.model_name
        labels = ["model_name", "worker", "role"]
        running = GaugeMetricFamily("baton:num_requests_running", "Requests running on the worker.", labels=labels)
        waiting = GaugeMetricFamily("baton:num_requests_waiting", "Requests waiting on the worker.", labels=labels)
        kv = GaugeMetricFamily("baton:kv_cache_usage_perc", "KV cache usage, 0 to 1 (1 = full).", labels=labels)
        queued = GaugeMetricFamily(
            "baton:queued_prefill_tokens", "Prompt tokens routed to the worker and not yet prefilled.", labels=labels
        )
        up = GaugeMetricFamily("baton:worker_up", "1 when the worker answers its health checks, else 0.", labels=labels)
        pool = GaugeMetricFamily("baton:workers_up", "Live workers per pool.", labels=["model_name", "role"])
        queries = CounterMetricFamily(
            "baton:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", labels=labels
        )
        hits = CounterMetricFamily("baton:prefix_cache_hits", "Prompt tokens found in the prefix cache.", labels=labels)
        kv_failures = CounterMetricFamily(
            "baton:kv_transfer_failures",
            "Received KV transfers that failed (checksum, incomplete, deadline, ...), "
            "by reason; the decode worker recomputed or failed the request (--kv-load-failure-policy).",
            labels=labels + ["reason"],
        )
        grammar_hits = CounterMetricFamily(
            "baton:structured_output_cache_hits",
            "Structured-output grammar lookups found compiled in the worker's cache.",
            labels=labels,
        )
        grammar_misses = CounterMetricFamily(
            "baton:structured_output_cache_misses",
            "Structured-output grammar lookups that had to compile (or failed to).",
            labels=labels,
        )
        compile_seconds = HistogramMetricFamily(
            "baton:structured_output_compile_seconds",
            "Seconds the worker took to compile a structured output's grammar.",
            labels=labels,
        )
        # Speculative decoding, with vLLM's names (zeros on a worker without it).
        drafts = CounterMetricFamily(
            "baton:spec_decode_num_drafts",
            "Speculative verifications: sequences that had draft tokens in a step.",
            labels=labels,
        )
        draft_tokens = CounterMetricFamily(
            "baton:spec_decode_num_draft_tokens", "Draft tokens proposed.", labels=labels
        )
        accepted_tokens = CounterMetricFamily(
            "baton:spec_decode_num_accepted_tokens", "Draft tokens accepted.", labels=labels
        )
        accepted_per_pos = CounterMetricFamily(
            "baton:spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by draft position (0: the first draft).",
            labels=labels + ["position"],
        )
        # vLLM's LoRA info gauge: one series per worker serving adapters, its value the scrape time.
        lora_info = GaugeMetricFamily(
            "baton:lora_requests_info",
            "LoRA adapters of the worker's running and waiting requests (comma-separated), and its max_lora.",
            labels=labels + ["running_lora_adapters", "waiting_lora_adapters", "max_lora"],
        )
        lora_loads = CounterMetricFamily(
            "baton:lora_adapter_loads",
            "LoRA adapters loaded: into a device slot (slot) or read from disk into host memory (disk).",
            labels=labels + ["source"],
        )
        now = time.time()
        indexed = GaugeMetricFamily(
            "baton:prefix_index_blocks", "KV blocks the router's prefix index holds for the worker.", labels=labels
        )
        live = {Role.PREFILL: 0, Role.DECODE: 0}
        index = self.owner.backend.prefix_index
        for w in self.owner.backend.workers():
            lv = [m, w.worker_id, w.role]
            running.add_metric(lv, w.running)
            waiting.add_metric(lv, w.waiting)
            kv.add_metric(lv, w.kv_usage)
            queued.add_metric(lv, w.queued_prefill_tokens)
            up.add_metric(lv, 1.0 if w.alive else 0.0)
            queries.add_metric(lv, w.prefix_cache_queries)
            hits.add_metric(lv, w.prefix_cache_hits)
            for reason, n in sorted(w.kv_transfer_failures.items()):
                kv_failures.add_metric(lv + [reason], n)
            g = w.grammar
            grammar_hits.add_metric(lv, g.cache_hits)
            grammar_misses.add_metric(lv, g.cache_misses)
            if g.compile_buckets:  # a worker without a grammar cache (or an old one) reports none
                compile_seconds.add_metric(
                    lv,
                    [(f"{b:g}", n) for b, n in zip(COMPILE_SECONDS_BUCKETS, g.compile_buckets)]
                    + [("+Inf", g.compiles)],
                    g.compile_seconds_sum,
                )
            spec = w.spec_decode
            drafts.add_metric(lv, spec.num_drafts)
            draft_tokens.add_metric(lv, spec.num_draft_tokens)
            accepted_tokens.add_metric(lv, spec.num_accepted_tokens)
            for position, n in enumerate(spec.accepted_per_pos):
                accepted_per_pos.add_metric(lv + [str(position)], n)
            if w.lora.max_loras:
                lo = w.lora
                lora_info.add_metric(lv + [",".join(lo.running), ",".join(lo.waiting), str(lo.max_loras)], now)
                lora_loads.add_metric(lv + ["slot"], lo.slot_loads)
                lora_loads.add_metric(lv + ["disk"], lo.disk_loads)
            if index is not None:
                indexed.add_metric(lv, index.num_blocks(w.worker_id))
            live[w.role] = live.get(w.role, 0) + (1 if w.alive else 0)
        for role, n in live.items():
            pool.add_metric([m, role], n)
        yield from (
            running,
            waiting,
            kv,
            queued,
            up,
            pool,
            queries,
            hits,
            kv_failures,
            grammar_hits,
            grammar_misses,
            compile_seconds,
            drafts,
            draft_tokens,
            accepted_tokens,
            accepted_per_pos,
            lora_info,
            lora_loads,
        )
        if index is not None:
            yield indexed
        admission = self.owner.admission
        if admission is not None:
            yield from _admission_metrics(m, admission)
        yield _healing_metrics(m, self.owner.backend.counters)


HEALING_EVENTS = ("migrations", "migrations_failed", "prefill_retries", "prefill_fallbacks")


def _healing_metrics(model_name: str, counters: dict[str, int]) -> CounterMetricFamily:
    events = CounterMetricFamily(
        "baton:healing_events",
        "Requests moved or retried after a worker failed, by event.",
        labels=["model_name", "event"],
    )
    for event in HEALING_EVENTS:
        events.add_metric([model_name, event], counters.get(event, 0))
    return events


def _admission_metrics(model_name: str, admission: Any):
    gate_labels = ["model_name", "pool"]
    running = GaugeMetricFamily(
        "baton:router_requests_admitted", "Requests holding a slot of the pool's gate.", labels=gate_labels
    )
    waiting = GaugeMetricFamily(
        "baton:router_requests_queued", "Requests waiting in the router for a slot of the pool.", labels=gate_labels
    )
    rejected = CounterMetricFamily(
        "baton:router_requests_rejected",
        "Requests refused by admission control, by reason.",
        labels=["model_name", "reason"],
    )
    for gate in (admission.decode, admission.prefill):
        state = gate.state()
        running.add_metric([model_name, gate.pool], state.running)
        waiting.add_metric([model_name, gate.pool], state.waiting)
    for reason, n in sorted(admission.rejected.items()):
        rejected.add_metric([model_name, reason], n)
    yield from (running, waiting, rejected)


def _resident_bytes() -> int | None:
    """This process's resident memory (Linux /proc; None elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


class RouterMetrics:
    def __init__(self, model_name: str, backend: ServingBackend, admission: Any = None, recent: int = 256) -> None:
        self.model_name = model_name
        self.backend = backend
        self.admission = admission  # router.admission.AdmissionControl, or None
        self.started = time.time()
        self.registry = CollectorRegistry(auto_describe=False)
        self.exposition = None  # a router.metrics_merge.RouterExposition with several router processes
        r, ml = self.registry, ["model_name"]
        self.prompt_tokens = Counter("baton:prompt_tokens", "Prompt tokens of finished requests.", ml, registry=r)
        self.generation_tokens = Counter(
            "baton:generation_tokens", "Generated tokens of finished requests.", ml, registry=r
        )
        self.success = Counter(
            "baton:request_success", "Requests that finished, by finish reason.", ml + ["finished_reason"], registry=r
        )
        self.failures = Counter("baton:request_failure", "Requests that failed in the worker pools.", ml, registry=r)
        lora = ml + ["lora_name"]
        self.lora_requests = Counter("baton:lora_requests", "Finished requests per LoRA adapter.", lora, registry=r)
        self.lora_prompt_tokens = Counter(
            "baton:lora_prompt_tokens", "Prompt tokens of finished requests per LoRA adapter.", lora, registry=r
        )
        self.lora_generation_tokens = Counter(
            "baton:lora_generation_tokens", "Generated tokens of finished requests per LoRA adapter.", lora, registry=r
        )
        self.routing = Counter(
            "baton:routing_decisions",
            "Routing decisions: remote or local prefill, and why.",
            ml + ["decision", "reason"],
            registry=r,
        )
        self.kv_bytes_total = Counter(
            "baton:kv_transfer_bytes", "KV cache bytes moved from prefill to decode workers.", ml, registry=r
        )
        self.structured = Counter(
            "baton:structured_output_requests",
            "Generation requests by structured-output kind (none, json_schema, json_object, "
            "regex, choice, grammar, tool_required, tool_named).",
            ml + ["kind"],
            registry=r,
        )

        def hist(name: str, doc: str, buckets) -> Histogram:
            return Histogram(name, doc, ml, buckets=buckets, registry=r)

        self.ttft = hist("baton:time_to_first_token_seconds", "Arrival at the router to the first token.", TTFT_BUCKETS)
        # By scheduling class: each request's priority and tenant, at most MAX_CLASS_LABELS distinct
        # values of each (later ones count as "other"), so the label sets stay bounded.
        self.ttft_by_class = Histogram(
            "baton:time_to_first_token_by_class_seconds",
            "Arrival at the router to the first token, by request priority and tenant.",
            ml + ["priority", "tenant"],
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self._labels: dict[str, set[str]] = {"priority": set(), "tenant": set()}
        self.itl = hist("baton:inter_token_latency_seconds", "Gap between consecutive output tokens.", ITL_BUCKETS)
        self.e2e = hist("baton:e2e_request_latency_seconds", "Arrival to the last token.", REQUEST_BUCKETS)
        self.queue = hist(
            "baton:request_queue_time_seconds",
            "Arrival to the start of prefill (routing, reservation, RPC).",
            REQUEST_BUCKETS,
        )
        self.prefill = hist(
            "baton:request_prefill_time_seconds",
            "Prefill to the first token (the prefilling worker's queue included).",
            REQUEST_BUCKETS,
        )
        self.decode = hist("baton:request_decode_time_seconds", "First token to the last token.", REQUEST_BUCKETS)
        self.kv_bytes = hist(
            "baton:kv_transfer_bytes_per_request", "KV bytes moved per remotely prefilled request.", BYTES_BUCKETS
        )
        self.kv_seconds = hist(
            "baton:kv_transfer_seconds", "KV transfer time per remotely prefilled request.", ITL_BUCKETS
        )
        self.loop_lag = hist(
            "baton:router_event_loop_lag_seconds",
            "How late the router's event loop ran a timer that was due (sampled every 50 ms): what "
            "any request, a 429 included, waits before the router looks at it.",
            LOOP_LAG_BUCKETS,
        )
        self.registry.register(_WorkerCollector(self))
        # Create the unlabelled-by-outcome series now, so they read 0 (not "no data") before traffic.
        for c in (self.prompt_tokens, self.generation_tokens, self.failures, self.kv_bytes_total):
            c.labels(model_name)

        # For /v1/status: recent traces and samples, and totals (cheap to summarize on each call).
        self.recent: deque[tuple[float, RequestTrace]] = deque(maxlen=recent)
        self._itl_samples: deque[tuple[float, float]] = deque(maxlen=1024)
        self.routing_counts: Tally = Tally()
        self.totals = {
            "requests": 0,
            "failed": 0,
            "prompt_tokens": 0,
            "generation_tokens": 0,
            "kv_bytes": 0,
            "cached_tokens": 0,
        }

    # ---- recording -----------------------------------------------------------------------
    def _bounded(self, label: str, value: str) -> str:
        seen = self._labels[label]
        if value in seen or len(seen) < MAX_CLASS_LABELS:
            seen.add(value)
            return value
        return "other"

    def count_structured(self, kind: str) -> None:
        self.structured.labels(self.model_name, kind).inc()

    async def watch_event_loop(self, every_s: float = 0.05) -> None:
        """Sample the event loop's lag until cancelled (runs in the app's lifespan)."""
        lag = self.loop_lag.labels(self.model_name)
        while True:
            started = time.perf_counter()
            await asyncio.sleep(every_s)
            lag.observe(max(0.0, time.perf_counter() - started - every_s))

    def observe(self, trace: RequestTrace) -> None:
        """Record a finished (or failed) request."""
        m = self.model_name
        now = time.time()
        self.routing.labels(m, trace.decision, trace.reason or "unknown").inc()
        self.routing_counts[(trace.decision, trace.reason or "unknown")] += 1
        self.prompt_tokens.labels(m).inc(trace.prompt_tokens)
        self.generation_tokens.labels(m).inc(trace.output_tokens)
        if trace.lora_adapter is not None:
            self.lora_requests.labels(m, trace.lora_adapter).inc()
            self.lora_prompt_tokens.labels(m, trace.lora_adapter).inc(trace.prompt_tokens)
            self.lora_generation_tokens.labels(m, trace.lora_adapter).inc(trace.output_tokens)
        t = self.totals
        t["requests"] += 1
        t["prompt_tokens"] += trace.prompt_tokens
        t["generation_tokens"] += trace.output_tokens
        t["cached_tokens"] += trace.cached_tokens
        if trace.error is not None:
            self.failures.labels(m).inc()
            t["failed"] += 1
        else:
            self.success.labels(m, trace.finish_reason or "abort").inc()
        if trace.ttft_s is not None:
            self.ttft.labels(m).observe(trace.ttft_s)
            priority, tenant = self._bounded("priority", str(trace.priority)), self._bounded("tenant", trace.tenant)
            self.ttft_by_class.labels(m, priority, tenant).observe(trace.ttft_s)
            self.queue.labels(m).observe(trace.queue_s)
            self.prefill.labels(m).observe(trace.prefill_s)
            self.decode.labels(m).observe(trace.decode_s)
        if trace.e2e_s is not None:
            self.e2e.labels(m).observe(trace.e2e_s)
        itl = self.itl.labels(m)
        for gap in trace.itl_s:
            itl.observe(gap)
        # Keep at most 16 gaps per request for the status percentiles (evenly spaced).
        step = max(1, len(trace.itl_s) // 16)
        self._itl_samples.extend((now, g) for g in trace.itl_s[::step])
        if trace.decision == "remote":
            self.kv_bytes.labels(m).observe(trace.kv_bytes)
            self.kv_seconds.labels(m).observe(trace.transfer_s)
            self.kv_bytes_total.labels(m).inc(trace.kv_bytes)
            t["kv_bytes"] += trace.kv_bytes
        self.recent.append((now, trace))
        if log.isEnabledFor(logging.DEBUG):
            log.debug("trace %s", trace.summary())

    def render(self) -> bytes:
        if self.exposition is not None:  # one of several router processes (router.metrics_merge)
            return self.exposition.render(self.registry)
        return generate_latest(self.registry)

    # ---- /v1/status ----------------------------------------------------------------------
    def status(self, max_recent: int = 25) -> dict:
        now = time.time()
        window = min(STATUS_WINDOW_S, max(1.0, now - self.started))
        since = now - window
        index = self.backend.prefix_index
        pools: dict[str, list[dict]] = {Role.PREFILL: [], Role.DECODE: []}
        for w in self.backend.workers():
            q, h = w.prefix_cache_queries, w.prefix_cache_hits
            pools.setdefault(w.role, []).append(
                {
                    "worker_id": w.worker_id,
                    "role": w.role,
                    "alive": w.alive,
                    "running": w.running,
                    "waiting": w.waiting,
                    "kv_usage": w.kv_usage,
                    "queued_prefill_tokens": w.queued_prefill_tokens,
                    "prefix_cache_queries": q,
                    "prefix_cache_hits": h,
                    "prefix_hit_rate": (h / q) if q else None,
                    "last_heartbeat_age_s": max(0.0, now - w.last_heartbeat) if w.last_heartbeat is not None else None,
                    "indexed_blocks": index.num_blocks(w.worker_id) if index is not None else None,
                    "pid": w.pid,
                    "tp_size": w.tp_size,
                    "rank_pids": list(w.rank_pids),
                    "spec_draft_tokens": w.spec_decode.num_draft_tokens,
                    "spec_accepted_tokens": w.spec_decode.num_accepted_tokens,
                    "lora_resident": list(w.lora.resident),
                    "lora_running": list(w.lora.running),
                    "max_loras": w.lora.max_loras,
                }
            )
        in_window = [(t, tr) for t, tr in self.recent if t >= since]
        ttfts = [tr.ttft_s for _, tr in in_window if tr.ttft_s is not None]
        itls = [g for t, g in self._itl_samples if t >= since]
        # common.stats: the one percentile definition (numpy's linear interpolation); None for no samples.
        ttft_p50, ttft_p99 = percentiles(ttfts, (50, 99)) if ttfts else (None, None)
        itl_p50, itl_p99 = percentiles(itls, (50, 99)) if itls else (None, None)
        gen = sum(tr.output_tokens for _, tr in in_window)
        kvb = sum(tr.kv_bytes for _, tr in in_window if tr.decision == "remote")
        routing: dict[str, Any] = {"remote": 0, "local": 0, "by_reason": {}}
        for (decision, reason), n in self.routing_counts.items():
            routing[decision] = routing.get(decision, 0) + n
            routing["by_reason"][f"{decision}:{reason}"] = n
        series = [
            {"t": t, "ttft_s": tr.ttft_s, "itl_s": tr.itl_mean_s, "decision": tr.decision}
            for t, tr in list(self.recent)[-120:]
        ]
        recent = [dict(tr.to_dict(), finished_at=t) for t, tr in list(self.recent)[-max_recent:]][::-1]
        return {
            "model": self.model_name,
            "time": now,
            "uptime_s": now - self.started,
            "router": {"pid": os.getpid(), "rss_bytes": _resident_bytes()},
            "admission": self.admission.state() if self.admission is not None else None,
            # The router processes holding leases on the workers (RayBackend; None for other backends).
            "routers": self.backend.routers() if hasattr(self.backend, "routers") else None,
            "pools": pools,
            "totals": dict(self.totals),
            "routing": routing,
            "window": {
                "seconds": window,
                "requests": len(in_window),
                "ttft_p50_s": ttft_p50,
                "ttft_p99_s": ttft_p99,
                "itl_p50_s": itl_p50,
                "itl_p99_s": itl_p99,
                "tokens_per_s": gen / window,
                "kv_bytes_per_s": kvb / window,
            },
            "series": series,
            "recent": recent,
        }
