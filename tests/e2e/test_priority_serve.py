"""Request priority over HTTP (issue 55's first scenario): `baton serve --scheduling-policy priority
--max-num-seqs 4`, a flood of 32 requests at priority 10, then 6 at priority -10 while most of the
flood still waits. Every request completes, and the urgent requests' TTFT p50 is at most 0.2x that
of the flood requests that had no first token yet when the urgent ones arrived (they are what the
urgent ones overtake). Oracle: the client's own clock, one measurement per request."""

from __future__ import annotations

import asyncio
import statistics
import time

import httpx
import pytest

from testkit.harness import baton_serve

pytestmark = pytest.mark.slow

FLOOD, URGENT, MAX_TOKENS = 32, 6, 24


async def _one(client: httpx.AsyncClient, priority: int, index: int, out: dict) -> None:
    body = {
        "prompt": f"Request {index}: write a list of fruits.",
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "priority": priority,
    }
    sent = time.monotonic()
    first = None
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if first is None and line.startswith("data: {"):
                first = time.monotonic()
    out[(priority, index)] = (sent, first, time.monotonic())


async def _run(base_url: str) -> dict:
    out: dict = {}
    async with httpx.AsyncClient(base_url=base_url, timeout=300) as client:
        flood = [asyncio.create_task(_one(client, 10, i, out)) for i in range(FLOOD)]
        await asyncio.sleep(3.0)  # the flood fills the batch and the queues
        urgent = [asyncio.create_task(_one(client, -10, i, out)) for i in range(URGENT)]
        await asyncio.gather(*flood, *urgent)
    return out


def test_urgent_requests_overtake_a_flood():
    with baton_serve(["--scheduling-policy", "priority", "--max-num-seqs", "4"]) as server:
        out = asyncio.run(_run(server.base_url))
        assert httpx.get(server.base_url + "/health").status_code == 200
    assert len(out) == FLOOD + URGENT and all(first is not None for _, first, _ in out.values())
    urgent = [v for (p, _), v in out.items() if p == -10]
    arrived = min(sent for sent, _, _ in urgent)
    urgent_ttft = statistics.median(first - sent for sent, first, _ in urgent)
    overtaken = [first - sent for (p, _), (sent, first, _) in out.items() if p == 10 and first > arrived]
    assert len(overtaken) >= URGENT, "the flood had drained before the urgent requests arrived"
    assert urgent_ttft <= 0.2 * statistics.median(overtaken), (urgent_ttft, statistics.median(overtaken))
