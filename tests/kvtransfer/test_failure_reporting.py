"""How a failed KV load reaches the operator and the client: the decode worker's counts become
`baton:kv_transfer_failures_total{reason}` on the router's /metrics, and the `fail` policy's
KVLoadFailed becomes a retryable 503 in the OpenAI error envelope."""

from __future__ import annotations

import pickle
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from common.transports import KV_LOAD_FAILURE_POLICIES, KVLoadFailed
from router.backend import BackendError, WorkerInfo
from router.errors import to_api_error
from router.metrics import RouterMetrics


@dataclass
class Backend:
    """The slice of ServingBackend the worker collector reads."""

    failures: dict

    prefix_index = None
    counters: dict = None

    def workers(self):
        return [
            WorkerInfo("decode-0", "decode", kv_transfer_failures=self.failures),
            WorkerInfo("prefill-0", "prefill"),
        ]


def samples(metrics: RouterMetrics, name: str) -> dict:
    out = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for s in family.samples:
            if s.name == name:
                out[(s.labels["worker"], s.labels["reason"])] = s.value
    return out


def test_worker_failure_counts_are_exported_by_reason():
    backend = Backend({"checksum": 3, "deadline": 1})
    backend.counters = {}
    metrics = RouterMetrics("m", backend)
    assert samples(metrics, "baton:kv_transfer_failures_total") == {
        ("decode-0", "checksum"): 3.0,
        ("decode-0", "deadline"): 1.0,
    }
    backend.failures["checksum"] = 5  # counters: the worker's running totals, read at scrape time
    assert samples(metrics, "baton:kv_transfer_failures_total")[("decode-0", "checksum")] == 5.0


def test_fail_policy_error_is_a_retryable_503_envelope():
    failed = pickle.loads(pickle.dumps(KVLoadFailed("KV for r1 could not be used", "checksum")))
    assert failed.reason == "checksum"  # survives Ray's pickling
    # What router.ray_backend raises for it:
    error = to_api_error(
        BackendError(f"the KV transfer of this request failed ({failed.reason}); retry it", retryable=True), "r1"
    )
    assert error.status == 503 and error.headers.get("Retry-After")
    assert "checksum" in error.body()["error"]["message"]
    assert KV_LOAD_FAILURE_POLICIES[0] == "recompute"  # vLLM's default
