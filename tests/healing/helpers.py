"""Helpers of the healing and scaling tests (tests/healing, tests/cluster/test_healing_node.py):
the oracle's prompts, a streaming client that records what each request got and when, and the
check every fault test makes.

Why prompts with a margin: a migrated request's tokens so far are re-prefilled on another worker,
which computes the same values by another summation order (a prefill instead of decode steps, as
a preemption by recomputation does). Where the top two logits are within float noise, either
order may flip the choice, in an undisturbed run too; the engine tests allow that (near ties
below 1e-3). These tests ask for exact equality, so they use prompts whose every greedy step has a
clear winner (top-2 log-probability gap >= MARGIN, ten times that tolerance), chosen with the
engine alone, greedy float32: the oracle.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from dataclasses import dataclass, field

import httpx
import pytest

from common.sampling_params import SamplingParams
from common.worker_client import WorkerClient

MARGIN = 0.01
SUBJECTS = [
    "the moon",
    "a river",
    "coffee",
    "the ocean",
    "a library",
    "winter",
    "a violin",
    "the desert",
    "bread",
    "a volcano",
    "the internet",
    "a garden",
    "trains",
    "honey",
    "the brain",
    "a castle",
    "rain",
    "chess",
    "a lighthouse",
    "glass",
    "tigers",
    "the sun",
    "paper",
    "a bicycle",
    "snow",
    "copper",
    "a forest",
    "the alphabet",
    "clocks",
    "a bridge",
    "salt",
    "the wind",
    "owls",
    "a mirror",
    "tea",
    "mountains",
]
TEMPLATES = ["Here is a fact about {}:", "The most interesting thing about {} is"]


@dataclass
class Expected:
    prompt: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str


def clear_prompts(engine, tokenizer, n: int, max_tokens: int, chunk: int = 24) -> list[Expected]:
    """n prompts (token ids) whose greedy answers run the whole max_tokens with every step decided
    by at least MARGIN, with those answers (the engine alone; in chunks, to fit a small cache)."""
    candidates = [tokenizer.encode(t.format(s), add_special_tokens=False) for s in SUBJECTS for t in TEMPLATES]
    found: list[Expected] = []
    for start in range(0, len(candidates), chunk):
        done = engine.generate(
            candidates[start : start + chunk], SamplingParams(max_tokens=max_tokens, temperature=0, logprobs=2)
        )
        found += [
            Expected(c.prompt_token_ids, c.text, c.token_ids, c.finish_reason)
            for c in done
            if all(lp.top[0][1] - lp.top[1][1] >= MARGIN for lp in c.logprobs) and len(c.token_ids) == max_tokens
        ]
        if len(found) >= n:
            return found[:n]
    raise AssertionError(f"only {len(found)} of {len(candidates)} prompts have clear greedy answers")


@dataclass
class Oracle:
    """The engine alone, greedy float32, and the clear prompts found with it, per (n, max_tokens)."""

    engine: object
    prompts: dict[tuple[int, int], list[Expected]] = field(default_factory=dict)

    def clear_prompts(self, tokenizer, n: int, max_tokens: int) -> list[Expected]:
        if (n, max_tokens) not in self.prompts:
            self.prompts[n, max_tokens] = clear_prompts(self.engine, tokenizer, n, max_tokens)
        return self.prompts[n, max_tokens]


ORACLE = pytest.StashKey[Oracle]()


def session_oracle(config: pytest.Config) -> Oracle:
    """The test session's one Oracle (in its stash), shared by tests/healing and tests/cluster:
    the model loads once, and the same prompts are searched for once."""
    if ORACLE not in config.stash:
        from workers.build import load_engine
        from workers.config import EngineConfig

        config.stash[ORACLE] = Oracle(load_engine(None, EngineConfig(kv_cache_memory=64 << 20)))
    return config.stash[ORACLE]


@dataclass
class StreamResult:
    text: str = ""
    finish_reason: str | None = None
    completion_tokens: int | None = None
    error: str | None = None  # the in-band error event's message, or the HTTP error
    status: int = 0
    seconds: float = 0.0
    chunks: int = 0


@dataclass
class Load:
    """Concurrent streaming completions against one server; `progress` counts chunks per request."""

    base_url: str
    results: dict[int, StreamResult] = field(default_factory=dict)

    def chunks(self) -> list[int]:
        return [r.chunks for r in self.results.values()]

    async def one(self, client: httpx.AsyncClient, key: int, prompt: list[int], max_tokens: int) -> StreamResult:
        result = self.results.setdefault(key, StreamResult())
        started = time.monotonic()
        body = {
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        try:
            async with client.stream("POST", self.base_url + "/v1/completions", json=body) as response:
                result.status = response.status_code
                if response.status_code != 200:
                    result.error = (await response.aread()).decode(errors="replace")
                    return result
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        result.error = event["error"]["message"]
                        continue
                    if event.get("usage"):
                        result.completion_tokens = event["usage"]["completion_tokens"]
                    for choice in event.get("choices") or []:
                        result.text += choice.get("text") or ""
                        result.chunks += 1
                        result.finish_reason = choice.get("finish_reason") or result.finish_reason
        except httpx.HTTPError as exc:
            result.error = f"{type(exc).__name__}: {exc}"
        finally:
            result.seconds = time.monotonic() - started
        return result


def check_results(results: dict[int, StreamResult], expected: list[Expected], deadline_s: float) -> dict[str, int]:
    """Each request completed with exactly the undisturbed answer, or ended with a clean error
    (an error event or a 5xx with the OpenAI envelope), and none outlived its deadline."""
    counts = {"exact": 0, "clean_error": 0}
    for i, want in enumerate(expected):
        r = results[i]
        assert r.seconds <= deadline_s + 5, f"request {i} ran {r.seconds:.1f} s, past its deadline of {deadline_s} s"
        if r.error is None:
            assert r.status == 200 and r.text == want.text, (i, r.text, want.text)
            assert r.finish_reason == want.finish_reason and r.completion_tokens == len(want.token_ids), (i, r)
            counts["exact"] += 1
        else:
            assert r.status in (200, 500, 503, 504) and r.error and "Traceback" not in r.error, (i, r)
            counts["clean_error"] += 1
    return counts


async def run_load(base_url: str, expected: list[Expected], during, timeout_s: float) -> Load:
    """Stream every expected prompt at once; `during(load)` (a coroutine function) runs meanwhile."""
    load = Load(base_url)
    limits = httpx.Limits(max_connections=len(expected) + 8)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
        tasks = [asyncio.create_task(load.one(client, i, e.prompt, len(e.token_ids))) for i, e in enumerate(expected)]
        await during(load)
        await asyncio.wait_for(asyncio.gather(*tasks), timeout_s)
    return load


async def kill_when_running(worker, pids: list[int], at_least: int = 4, timeout_s: float = 180.0) -> None:
    """SIGKILL `pids` as soon as `worker` (a Ray actor handle) itself reports `at_least` sequences
    running. (Waiting for the client to see first tokens instead missed them on a loaded machine:
    a 16-token answer was over on the worker before the client had read the other streams' first
    chunks.)"""
    deadline = time.monotonic() + timeout_s
    while (await WorkerClient(worker).stats()).num_running < at_least:
        if time.monotonic() > deadline:
            raise AssertionError(f"the worker never ran {at_least} sequences at once in {timeout_s} s")
        await asyncio.sleep(0.002)
    for pid in pids:
        os.kill(pid, signal.SIGKILL)


async def wait_async(predicate, timeout_s: float, what: str, every_s: float = 0.05):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(every_s)
