"""Per-request traces: where a request ran, why, and where its time went.

The routing policy fills the routing half (`RouteDecision.cached_blocks`, reason), the backend the
worker half (prefill, transfer, bytes, whether a remote prefill fell back to local), and the HTTP
layer the client-visible times (TTFT, inter-token gaps, end-to-end). A finished trace is logged at
debug level, feeds the Prometheus histograms, and is kept in a small ring for `/v1/status`.

Time split (seconds, all measured on the router's clock except the two worker-reported ones):
- queue: arrival -> the prefill starts: routing, the decode worker's reservation, and for remote
  prefill the RPC overhead not spent prefilling or transferring;
- prefill: remote: the prefill worker's own `prefill_seconds` (its queue + compute, to the first
  token); local: submit -> first token on the decode worker;
- transfer: the prefill worker's `transfer_seconds` (0 for local prefill);
- decode: first token -> last token.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import ClassVar

from common.request import DEFAULT_TENANT

__all__ = ["RequestTrace"]


@dataclass
class RequestTrace:
    request_id: str
    prompt_tokens: int
    structured_output: str | None = None  # the constraint's kind (json_schema, regex, ...), None for free text
    priority: int = 0  # its scheduling priority (lower first; 0 unless --scheduling-policy priority)
    tenant: str = DEFAULT_TENANT  # who it is billed to (x-llm-d-inference-fairness-id)
    lora_adapter: str | None = None  # the LoRA adapter it runs under (None: the base model)
    # Where its adapter stood on each chosen worker when routed ("prefill-0:resident decode-1:load"):
    # running (a request under it runs there), resident (in a slot), load (a free slot), evict.
    lora_placement: str = ""
    arrival: float = field(default_factory=time.time)  # wall clock, for display
    started: float = field(default_factory=time.perf_counter)  # monotonic, for durations
    # routing
    decode_worker: str = ""
    prefill_worker: str | None = None  # None: prefilled locally on the decode worker
    policy_reason: str = ""
    cached_blocks_found: int = 0  # leading prompt blocks the index said the prefilling worker holds
    # worker side
    fell_back_to_local: bool = False
    cached_tokens: int = 0  # prompt tokens the prefilling worker actually took from its cache
    queue_s: float = 0.0
    prefill_s: float = 0.0
    transfer_s: float = 0.0
    kv_bytes: int = 0
    kv_blocks: int = 0
    # Tensor-parallel pools: (prefill rank, decode rank, bytes) of each rank pair of the KV handoff.
    kv_rank_pairs: tuple[tuple[int, int, int], ...] = ()
    # client side
    ttft_s: float | None = None
    decode_s: float = 0.0
    e2e_s: float | None = None
    output_tokens: int = 0
    spec_draft_tokens: int = 0  # speculative decoding: draft tokens proposed for the request, on every worker
    spec_accepted_tokens: int = 0  # and accepted
    itl_s: list[float] = field(default_factory=list)  # gaps between consecutive token outputs
    finish_reason: str | None = None
    error: str | None = None
    _first_at: float | None = None
    _last_at: float | None = None
    _spec_seen: tuple[int, int] = (0, 0)  # the worker's last reported totals (speculation)

    def set_route(self, route) -> None:
        """Copy the routing policy's decision (a router.backend.RouteDecision)."""
        self.decode_worker, self.prefill_worker = route.decode_worker, route.prefill_worker
        self.policy_reason, self.cached_blocks_found = route.reason, route.cached_blocks

    @property
    def decision(self) -> str:
        return "remote" if self.prefill_worker is not None and not self.fell_back_to_local else "local"

    @property
    def reason(self) -> str:
        return "remote_prefill_failed" if self.fell_back_to_local else self.policy_reason

    def token(self, num_tokens: int, now: float | None = None) -> None:
        """The HTTP layer got an output with num_tokens new tokens."""
        now = time.perf_counter() if now is None else now
        if num_tokens <= 0:
            return
        if self._first_at is None:
            self._first_at = now
            self.ttft_s = now - self.started
        elif self._last_at is not None:
            # One output may carry several tokens: spread the gap over them, as vLLM does per token.
            gap = (now - self._last_at) / num_tokens
            self.itl_s.extend([gap] * min(num_tokens, 64))
        self._last_at = now
        self.output_tokens += num_tokens

    def speculation(self, drafted: int, accepted: int) -> None:
        """An output's speculative-decoding totals for the request on its worker. A migrated request
        counts from 0 again on its new worker: its totals there add to those of the old one."""
        seen_drafted, seen_accepted = self._spec_seen
        if drafted < seen_drafted:
            seen_drafted = seen_accepted = 0
        self.spec_draft_tokens += drafted - seen_drafted
        self.spec_accepted_tokens += accepted - seen_accepted
        self._spec_seen = (drafted, accepted)

    def finish(self, finish_reason: str | None, error: str | None = None, now: float | None = None) -> None:
        now = time.perf_counter() if now is None else now
        self.e2e_s = now - self.started
        self.finish_reason = finish_reason
        self.error = error
        if self._first_at is not None:
            self.decode_s = now - self._first_at

    @property
    def itl_mean_s(self) -> float | None:
        return sum(self.itl_s) / len(self.itl_s) if self.itl_s else None

    _FIELDS: ClassVar[tuple[str, ...]] = (
        "request_id",
        "prompt_tokens",
        "structured_output",
        "priority",
        "tenant",
        "lora_adapter",
        "lora_placement",
        "arrival",
        "decode_worker",
        "prefill_worker",
        "policy_reason",
        "cached_blocks_found",
        "fell_back_to_local",
        "cached_tokens",
        "queue_s",
        "prefill_s",
        "transfer_s",
        "kv_bytes",
        "kv_blocks",
        "kv_rank_pairs",
        "ttft_s",
        "decode_s",
        "e2e_s",
        "output_tokens",
        "spec_draft_tokens",
        "spec_accepted_tokens",
        "finish_reason",
        "error",
    )

    def to_dict(self) -> dict:
        # By hand, not dataclasses.asdict: that deep-copies itl_s, and /v1/status calls this often.
        d = {k: getattr(self, k) for k in self._FIELDS}
        d["decision"] = self.decision
        d["reason"] = self.reason
        d["itl_mean_s"] = self.itl_mean_s
        return d

    def summary(self) -> str:
        def ms(v):
            return "-" if v is None else f"{v * 1000:.1f}"

        return (
            f"{self.request_id} {self.decision} prefill ({self.reason}) P={self.prefill_worker} D={self.decode_worker} "
            f"cached_blocks={self.cached_blocks_found} cached_tokens={self.cached_tokens}/{self.prompt_tokens} "
            f"queue={ms(self.queue_s)} prefill={ms(self.prefill_s)} transfer={ms(self.transfer_s)} "
            f"decode={ms(self.decode_s)} ttft={ms(self.ttft_s)} e2e={ms(self.e2e_s)} ms "
            f"tokens={self.output_tokens} finish={self.finish_reason}"
        )
