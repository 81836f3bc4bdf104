"""The serving overheads of a real `baton serve`, read off its workers' step logs and its client's
token times (both on the host's monotonic clock), for the simulator's `ServingOverheads`.

- `stream_s`, a worker's output to the client: for every decoded token, the time from the end of
  the decode step that computed it to its arrival at the client (the step is the one with that
  sequence's row at that context: token k of a prompt of L tokens comes from the row (L + k - 2,
  1 token, sampled)); the median over every token.
- `router_s`, a request's arrival to its route (HTTP, the router's work): for requests sent to an
  idle server one at a time, the time from the send to the start of the step that computes the
  prompt's first chunk, less the Ray calls the simulator counts on the way (a local prefill: half a
  call to the decode worker; a remote one: the reservation's round trip and half the prefill call).
  The median over those requests.
- `remote_first_token_s` (reported, not used): from the end of the prefill step that sampled the
  first token to its arrival, a remote prefill's KV handoff plus `stream_s`.
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Iterable

__all__ = ["served_overheads"]

Step = tuple[float, float, list[tuple[int, int, bool]]]  # (start, end, chunks)


def _latest(steps: list[Step], want: tuple[int, int, bool] | None, lo: float, hi: float, first=None) -> Step | None:
    """The last step ending in [lo, hi] with the chunk `want` (or one satisfying `first`)."""
    found = None
    for step in steps:
        start, end, chunks = step
        if end < lo:
            continue
        if start > hi:
            break
        if end <= hi and any(c == want if first is None else first(c) for c in chunks):
            found = step
    return found


def _first_chunk(steps: list[Step], length: int, lo: float, hi: float, chunk: int) -> Step | None:
    """The first step starting in [lo, hi] with the first chunk of a prompt of `length` tokens (at
    most `chunk` tokens)."""
    for step in steps:
        if step[0] < lo:
            continue
        if step[0] > hi:
            return None
        if any(c[0] == 0 and c[1] == min(length, chunk) for c in step[2]):
            return step
    return None


def served_overheads(
    rows: Iterable[dict],
    prefill_steps: list[Step],
    decode_steps: list[Step],
    rpc_s: float,
    isolated: Iterable[dict] = (),
    local_threshold: int = 64,
    chunk_tokens: int = 256,
) -> dict:
    """rows: every request (`prompt_len`, `sent_monotonic`, `token_times`); isolated: those sent to
    an idle server one at a time (prompts of at most `local_threshold` tokens are prefilled by the
    decode worker, in one chunk of at most `chunk_tokens`). Steps sorted by start. Returns stream_s, router_s and
    remote_first_token_s (medians, seconds) with the counts they come from."""
    lags = []
    for r in rows:
        times, length = r.get("token_times") or [], r["prompt_len"]
        for k in range(2, len(times) + 1):
            step = _latest(decode_steps, (length + k - 2, 1, True), r["sent_monotonic"], times[k - 1])
            if step is not None:
                lags.append(times[k - 1] - step[1])
    routes, firsts = [], []
    for r in isolated:
        times, length, sent = r.get("token_times") or [], r["prompt_len"], r["sent_monotonic"]
        if not times:
            continue
        local = length <= local_threshold
        step = _first_chunk(decode_steps if local else prefill_steps, length, sent, times[0], chunk_tokens)
        if step is not None:
            routes.append(step[0] - sent - (rpc_s / 2 if local else 1.5 * rpc_s))
        if not local:
            last = _latest(prefill_steps, None, sent, times[0], lambda c, n=length: c[0] + c[1] == n and c[2])
            if last is not None:
                firsts.append(times[0] - last[1])

    def median(values: list[float]) -> float | None:
        return statistics.median(values) if values else None

    return {
        "stream_s": median(lags),
        "router_s": median(routes),
        "remote_first_token_s": median(firsts),
        "tokens": len(lags),
        "isolated_requests": len(routes),
    }


def served_routes(metrics: str) -> dict[str, int]:
    """The router's routing decisions by reason (baton:routing_decisions_total in /metrics), named
    as the simulator's routes are (a remote prefill that fell back to local: remote_prefill_fallback_local)."""
    routes: dict[str, int] = {}
    for m in re.finditer(r'^baton:routing_decisions_total\{[^}]*reason="([^"]+)"[^}]*\} ([0-9.e+]+)$', metrics, re.M):
        reason = "remote_prefill_fallback_local" if m[1] == "remote_prefill_failed" else m[1]
        routes[reason] = routes.get(reason, 0) + int(float(m[2]))
    return routes
