"""`baton serve --api-server-count 2`: two router processes on one port, and one of them dying.

A real deployment on a private Ray with the default model. The oracle for every answer is the
engine's greedy generation of the same chat prompt, alone in this process. SO_REUSEPORT lets the kernel choose the
router of each connection, so the test sends requests on fresh connections until both routers
(named by the x-baton-router response header) have answered. Then router 1 is SIGKILLed while 32
streams run: the streams on router 0 must complete exactly, those on router 1 end for their
clients, the workers end router 1's requests once its lease runs out (5 s) and free their blocks,
and `baton serve` restarts router 1, which serves again.

Requests meant for one router go over a keep-alive connection the kernel handed to it
(`RouterClient`): asking on fresh connections until the right router answers would run most of
the chats twice.

Then the pools change at runtime: admin requests that the kernel hands to router 1 work (it
forwards them to router 0, which owns the pools), a decode worker added by the admin endpoint
joins router 1's pools too (its lease on it, its gates' share of the new size, a request it routes
there answered exactly), and router 1 drops it again when the pools shrink.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import pytest

from testkit.harness import baton_serve, wait_until

pytestmark = pytest.mark.slow
HEADER = "x-baton-router"
MAX_TOKENS = 16
QUESTIONS = [
    "Write a short poem about autumn leaves falling in a quiet park at dusk.",
    "Explain what a compiler does, in two sentences, for a beginner who has never programmed.",
    "Describe the moon in one sentence.",
    "Why do birds migrate? Answer briefly.",
]
# Asked once each after the scaling, each under a system message of its own: no worker holds even
# the first block of their prompts, so the kv-aware policy draws either decode worker at even odds.
# Under the chat template's default system prompt, decode-0 alone would hold the first one or two
# blocks (16 or 32 of 44 tokens) and the draw would choose decode-1 at odds of e^-3.6 or e^-7.3:
# the test failed about once in 25 runs.
FRESH = {f"Name one fact about the number {n}.": f"Quiz question {n}: answer in one sentence." for n in range(11, 35)}


def messages(q: str) -> list[dict]:
    system = [{"role": "system", "content": FRESH[q]}] if q in FRESH else []
    return system + [{"role": "user", "content": q}]


@pytest.fixture(scope="module")
def expected(reference_engine, tokenizer) -> dict[str, str]:
    """The engine's greedy answer to each question, alone in this process (tests/engine checks it
    against transformers): what every router must return."""
    from common.sampling_params import SamplingParams

    prompts = [tokenizer.apply_chat_template(messages(q), add_generation_prompt=True) for q in QUESTIONS + list(FRESH)]
    done = reference_engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    return {q: d.text for q, d in zip(QUESTIONS + list(FRESH), done)}


def body(q: str, stream: bool = False) -> dict:
    return {"messages": messages(q), "max_tokens": MAX_TOKENS, "temperature": 0, "stream": stream}


def chat(url: str, q: str) -> tuple[str, str]:
    """(the answer, the router that gave it), on a connection of its own."""
    r = httpx.post(url + "/v1/chat/completions", json=body(q), headers={"connection": "close"}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"], r.headers[HEADER]


class RouterClient:
    """Requests to one router process: each goes over a keep-alive connection on which that router
    has just answered GET /health (the kernel picks a router per connection, and a router closes a
    connection idle for a few seconds, so the connection is checked, and opened again until the
    kernel hands it to `router`, before every request)."""

    def __init__(self, url: str, router: str) -> None:
        self.url, self.router = url, router
        self._client: httpx.Client | None = None

    def _connected(self) -> httpx.Client:
        def attempt():
            if self._client is None:
                self._client = httpx.Client(base_url=self.url, timeout=120, limits=httpx.Limits(max_connections=1))
            if self._client.get("/health").headers[HEADER] == self.router:
                return self._client
            self._client.close()
            self._client = None
            return None

        return wait_until(attempt, 30, f"{self.router} to answer", every_s=0.0)

    def request(self, method: str, path: str, **kwargs) -> httpx.Response:
        r = self._connected().request(method, path, **kwargs)
        assert r.headers[HEADER] == self.router, (path, r.headers[HEADER])
        return r

    def status(self) -> dict:
        return self.request("GET", "/v1/status").json()

    def chat(self, q: str) -> tuple[str, str]:
        """(the answer, the request id)."""
        r = self.request("POST", "/v1/chat/completions", json=body(q))
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]["content"], r.json()["id"]

    def close(self) -> None:
        if self._client is not None:
            self._client.close()


def status(url: str) -> dict:
    r = httpx.get(url + "/v1/status", headers={"connection": "close"}, timeout=30)
    assert r.status_code == 200
    return dict(r.json(), answered_by=r.headers[HEADER])


def routers_seen(url: str, want: int, timeout_s: float) -> set[str]:
    seen: set[str] = set()

    def enough():
        seen.add(httpx.get(url + "/health", headers={"connection": "close"}, timeout=10).headers[HEADER])
        return len(seen) >= want

    wait_until(enough, timeout_s, f"{want} routers to answer", every_s=0.05)
    return seen


async def streams(url: str, n: int, on_started) -> list[dict]:
    """n chat streams at once, each on its own connection: per stream its router, text and end."""
    results = [
        {"q": QUESTIONS[i % len(QUESTIONS)], "router": None, "text": "", "done": False, "error": None} for i in range(n)
    ]

    async def one(result: dict) -> None:
        try:
            async with httpx.AsyncClient(timeout=120) as client:
                async with client.stream("POST", url + "/v1/chat/completions", json=body(result["q"], True)) as r:
                    result["router"] = r.headers[HEADER]
                    async for line in r.aiter_lines():
                        if line == "data: [DONE]":
                            result["done"] = True
                        elif line.startswith("data: "):
                            chunk = json.loads(line[6:])
                            if "error" in chunk:
                                result["error"] = chunk["error"]
                            for choice in chunk.get("choices", []):
                                result["text"] += choice["delta"].get("content") or ""
                            on_started(results)
        except httpx.HTTPError as exc:  # the router died under it
            result["error"] = repr(exc)

    await asyncio.gather(*(one(r) for r in results))
    return results


def test_two_routers_serve_exactly_and_one_dying_costs_the_other_nothing(expected, no_driver_ray):
    with baton_serve(
        ["--api-server-count", "2", "--kv-cache-memory", "96MiB", "--log-level", "warning", "--admin-endpoint"],
        ready_timeout_s=240,
    ) as server:
        url = server.base_url
        routers_seen(url, 2, 90)  # the child router is up too
        # Both routers answer, exactly as transformers (every question asked at least once).
        served: set[str] = set()
        for i in range(40):
            q = QUESTIONS[i % len(QUESTIONS)]
            text, router = chat(url, q)
            assert text == expected[q], (router, q)
            served.add(router)
            if len(served) == 2 and i >= len(QUESTIONS) - 1:
                break
        assert served == {"router-0", "router-1.0"}, served
        # Router 1's process: from /v1/status answered by it.
        victim = wait_until(lambda: (s := status(url))["answered_by"] == "router-1.0" and s, 30, "router 1's status")
        victim_pid = victim["router"]["pid"]
        assert victim_pid != server.process.pid

        killed_at: list[float] = []

        def kill_when_running(results: list[dict]) -> None:
            on_victim = [r for r in results if r["router"] == "router-1.0" and r["text"]]
            if not killed_at and len(on_victim) >= 3:
                os.kill(victim_pid, signal.SIGKILL)
                killed_at.append(time.monotonic())

        results = asyncio.run(streams(url, 32, kill_when_running))
        assert killed_at, "router 1 never had 3 streams running"
        on_survivor = [r for r in results if r["router"] == "router-0"]
        on_victim = [r for r in results if r["router"] == "router-1.0"]
        # Connections the kernel had queued for router 1 when it died break before any header.
        unanswered = [r for r in results if r["router"] is None]
        assert on_survivor and on_victim and len(on_survivor) + len(on_victim) + len(unanswered) == 32
        wrong = [r for r in on_survivor if not r["done"] or r["error"] or r["text"] != expected[r["q"]]]
        assert not wrong, wrong[:2]
        cut = [r for r in on_victim + unanswered if not r["done"]]
        assert cut, "no stream of the killed router was cut"
        assert all(r["error"] for r in cut)  # each ended for its client (the connection broke)
        assert all(r["text"] == expected[r["q"]] for r in on_victim if r["done"])  # finished before the kill

        # Every worker ends the dead router's requests once its lease runs out, freeing their blocks.
        def dead_router_gone():
            s = status(url)
            leases = {lease["router_id"] for lease in s["routers"]["leases"]}
            workers = [w for pool in s["pools"].values() for w in pool]
            return (
                "router-1.0" not in leases
                and all(w["running"] == 0 and w["waiting"] == 0 and w["kv_usage"] == 0 for w in workers)
                and s
            )

        s = wait_until(
            dead_router_gone,
            max(1.0, 10 - (time.monotonic() - killed_at[0])),
            "the dead router's requests to be ended and their blocks freed",
        )
        assert len(s["pools"]["prefill"]) == 1 and len(s["pools"]["decode"]) == 1
        # baton serve restarted router 1 (a new router with a new lease), and it serves exactly.
        routers_seen(url, 2, 60)
        router1 = RouterClient(url, "router-1.1")
        try:
            for q in QUESTIONS[:2]:
                assert router1.chat(q)[0] == expected[q], q

            # Admin requests the kernel hands to router 1 work: it forwards them to router 0.
            pools = router1.request("GET", "/admin/pools")
            assert pools.status_code == 200 and pools.json()["decode"] == 1, pools.text
            assert sorted(w["worker_id"] for w in pools.json()["workers"]) == ["decode-0", "prefill-0"]
            same = router1.request("POST", "/admin/scale", json={"decode": 1}, timeout=60)
            assert same.status_code == 200 and same.json()["after"] == {"prefill": 1, "decode": 1}, same.text
            capacity = router1.status()["admission"]["decode"]["capacity"]
            grown = httpx.post(url + "/admin/scale", json={"decode": 2}, timeout=400, headers={"connection": "close"})
            assert grown.status_code == 200 and grown.json()["added"] == ["decode-1"], grown.text

            # Router 1 follows: decode-1 in its pools, its lease on it, its gate's share of two workers.
            def router1_has_decode1():
                s = router1.status()
                decode = {w["worker_id"]: w for w in s["pools"]["decode"]}
                leased = {lease["router_id"]: lease["workers"] for lease in s["routers"]["leases"]}
                return (
                    "decode-1" in decode
                    and decode["decode-1"]["alive"]
                    and "decode-1" in leased.get("router-1.1", [])
                    and s
                )

            s = wait_until(router1_has_decode1, 15, "router 1 to serve with decode-1")
            assert s["admission"]["decode"]["capacity"] == 2 * capacity
            # A request router 1 routes to decode-1, answered exactly (fresh questions: either worker).
            landed = False
            for q in FRESH:
                text, request_id = router1.chat(q)
                assert text == expected[q], q
                recent = {r["request_id"]: r for r in router1.status()["recent"]}
                landed = recent[request_id]["decode_worker"] == "decode-1"
                if landed:
                    break
            assert landed, "router 1 never routed a request to the decode worker added at runtime"

            # The pools shrink again: router 1 drops decode-1 too.
            shrunk = httpx.post(url + "/admin/scale", json={"decode": 1}, timeout=120, headers={"connection": "close"})
            assert shrunk.status_code == 200 and shrunk.json()["removed"] == ["decode-1"], shrunk.text
            wait_until(
                lambda: [w["worker_id"] for w in router1.status()["pools"]["decode"]] == ["decode-0"],
                15,
                "router 1 to drop decode-1",
            )
        finally:
            router1.close()
        text, _ = chat(url, QUESTIONS[0])
        assert text == expected[QUESTIONS[0]]
