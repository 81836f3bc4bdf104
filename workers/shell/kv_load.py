"""The decode side of a failed KV load: what `EngineWorker.start_decode` does when the KV a
prefill worker pushed did not arrive intact (kvtransfer.integrity: a failed checksum, a short
or missing part, another request's or layout's data, a deadline).

`--kv-load-failure-policy` (vLLM's name) decides: `recompute` (the default) frees the reserved
blocks, whose contents are never cached, and prefills prompt + the first token (which the client
already has) on this worker, so the request goes on with the tokens it would have had, only
later; `fail` frees the request and raises `KVLoadFailed`, which the router answers with a
retryable 503. Either way the failure is logged and counted by reason
(`baton:kv_transfer_failures_total{reason}`): never hidden.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

from common.detokenizer import IncrementalDetokenizer
from common.protocol import ResumeState
from common.sampling_params import SamplingParams
from common.transports import KV_LOAD_FAILURE_POLICIES, KVLoadFailed
from kvtransfer import TransferResult
from kvtransfer.integrity import FAILURE_REASONS, FailureReason

log = logging.getLogger(__name__)


def check_policy(policy: str) -> str:
    if policy not in KV_LOAD_FAILURE_POLICIES:
        raise ValueError(f"kv_load_failure_policy must be one of {KV_LOAD_FAILURE_POLICIES}, got {policy!r}")
    return policy


@dataclass(frozen=True)
class PendingLoad:
    """A reservation waiting for its KV: its size, and what recomputing it would need."""

    num_blocks: int  # the blocks the prefill worker pushes (those the decode worker had cached are not)
    prompt_token_ids: list[int]
    params: SamplingParams


def recompute(engine, request_id: str, load: PendingLoad, first_token: int) -> None:
    """Engine thread: drop the reserved blocks and prefill prompt + first token here
    (LLMEngine.resume_request, as a migration would), then decode on."""
    text_chars = 0
    if engine.decode is not None:  # the text of the first token, which the client already has
        detok = IncrementalDetokenizer(engine.decode, load.params.stop)
        detok.add([first_token])
        text_chars = len(detok.take(final=False))
    engine.abort(request_id)
    engine.resume_request(load.prompt_token_ids, load.params, request_id, ResumeState((first_token,), text_chars))


class KVLoadFailures:
    """Counts of received transfers that failed, by reason (any thread), and the policy."""

    def __init__(self, worker_id: str, policy: str) -> None:
        self.worker_id, self.policy = worker_id, check_policy(policy)
        self._counts = dict.fromkeys(FAILURE_REASONS, 0)
        self.recomputed = 0
        self._lock = threading.Lock()

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    def record(self, request_id: str, result: TransferResult) -> str:
        """Count and log one failed load; returns its reason."""
        reason = result.reason if result.reason in FAILURE_REASONS else FailureReason.SENDER_FAILED.value
        with self._lock:
            self._counts[reason] += 1
            self.recomputed += self.policy == "recompute"
        log.warning(
            "worker %s: KV for %s failed (%s: %s %s); policy %s",
            self.worker_id,
            request_id,
            reason,
            result.status.name,
            result.error or "",
            self.policy,
        )
        return reason

    def error(self, request_id: str, reason: str, result: TransferResult) -> KVLoadFailed:
        return KVLoadFailed(
            f"KV for {request_id} could not be used ({reason}): {result.status.name} {result.error or ''}", reason
        )
