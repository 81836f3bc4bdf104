"""Structured output and tool calls on a real deployment (Ray on 127.0.0.1, 1 prefill + 2 decode
workers, the router over HTTP): JSON-schema replies at concurrency 16, streamed and not, prefilled
remotely and locally; the official openai client (parse, forced tool calls, a tool round trip); a
decode worker SIGKILLed mid-reply. Oracle: jsonschema on every reply (and each tool's parameters
schema on every call's arguments)."""

from __future__ import annotations

import asyncio
import json
import os
import signal

import httpx
import jsonschema
import openai
import pydantic
import pytest
import ray

from cluster.structured_load import SCHEMAS, check_reply, response_format, schema_requests
from cluster.config import BatonConfig
from cluster.harness import free_port, wait_until
from cluster.testing import leave_ray, serving

pytestmark = pytest.mark.slow

DEADLINE_S = 300.0
MAX_TOKENS = 120  # room for the longest of the five schemas' objects
# Prompts whose uncached part is longer than this are prefilled on the prefill worker, the others
# on the decode worker: a long, distinct system message sends half of the requests the remote way.
LOCAL_THRESHOLD = 60
LONG_SYSTEM = "You answer in JSON. " + "Keep every value short and realistic. " * 12


@pytest.fixture(scope="module")
def deployment():
    config = BatonConfig.from_options(
        port=free_port(), prefill_workers=1, decode_workers=2, kv_cache_memory="64MiB", max_num_seqs=32,
        local_prefill_threshold=LOCAL_THRESHOLD, request_timeout=DEADLINE_S, max_restarts=2)
    leave_ray()  # a private Ray of this module's own, which the deployment shuts down after it
    with serving(config, actor_name_prefix="structured") as running:
        yield running


def messages(i: int, prompt: str) -> list[dict]:
    user = [{"role": "user", "content": prompt}]
    return ([{"role": "system", "content": f"Request {i}. {LONG_SYSTEM}"}] + user) if i % 2 else user


async def one(client: httpx.AsyncClient, i: int, request, stream: bool) -> tuple[str, str | None]:
    body = {"messages": messages(i, request.prompt), "max_tokens": MAX_TOKENS, "temperature": 0.0 if i % 3 else 0.7,
            "seed": i, "response_format": response_format(request.schema_name), "stream": stream}
    if not stream:
        r = await client.post("/v1/chat/completions", json=body)
        r.raise_for_status()
        choice = r.json()["choices"][0]
        return choice["message"]["content"], choice["finish_reason"]
    text, reason = "", None
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                text += chunk["choices"][0]["delta"].get("content") or ""
                reason = chunk["choices"][0]["finish_reason"] or reason
    return text, reason


async def load(base_url: str, n: int, concurrency: int = 16, during=None) -> list[tuple[str, str | None]]:
    requests = schema_requests(n)
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=base_url, timeout=DEADLINE_S) as client:
        async def gated(i):
            async with gate:
                return await one(client, i, requests[i], stream=i % 2 == 0)
        tasks = [asyncio.create_task(gated(i)) for i in range(n)]
        if during is not None:
            await during()
        return list(await asyncio.gather(*tasks))


def assert_all_valid(results, n: int) -> None:
    requests = schema_requests(n)
    bad = [(r.schema_name, text, reason, why) for r, (text, reason) in zip(requests, results)
           if (why := check_reply(text, r.schema)) is not None or reason != "stop"]
    assert not bad, bad[:5]


def test_forty_schema_requests_at_concurrency_16_all_validate(deployment):
    backend = deployment.deployment.backend
    remote, local = backend.counters["remote_prefill"], backend.counters["local_prefill"]
    results = asyncio.run(load(deployment.base_url, 40))
    assert_all_valid(results, 40)
    # Both ways across the pools were taken: the first token from the prefill worker, and not.
    assert backend.counters["remote_prefill"] > remote and backend.counters["local_prefill"] > local
    metrics = httpx.get(deployment.base_url + "/metrics").text
    assert 'baton:structured_output_requests_total{kind="json_schema",model_name=' in metrics


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=24)
    age: int = pydantic.Field(ge=0, le=120)


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                     "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}}, "required": ["zone"],
    "additionalProperties": False}}}
TOOLS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, CLOCK)}


def test_the_openai_client_parses_models_and_gets_valid_tool_calls(deployment):
    client = openai.OpenAI(base_url=deployment.base_url + "/v1", api_key="none", timeout=DEADLINE_S)
    ask = [{"role": "user", "content": "Who is Ada? Answer as JSON."}]
    parsed = client.chat.completions.parse(model="SmolLM2-135M-Instruct", messages=ask, response_format=Person,
                                           max_tokens=MAX_TOKENS, temperature=0)
    assert isinstance(parsed.choices[0].message.parsed, Person)

    weather = [{"role": "user", "content": "What is the weather in Paris?"}]
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        full = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=weather, tools=[WEATHER, CLOCK],
                                              tool_choice=choice, max_tokens=MAX_TOKENS, temperature=0)
        assert full.choices[0].finish_reason == "tool_calls"
        calls = full.choices[0].message.tool_calls
        assert calls and all(c.function.name in TOOLS for c in calls)
        for c in calls:
            jsonschema.validate(json.loads(c.function.arguments), TOOLS[c.function.name])
        if isinstance(choice, dict):
            assert [c.function.name for c in calls] == ["get_weather"]
        # Streamed: the deltas add up to the same calls (the client's own accumulation).
        with client.chat.completions.stream(model="SmolLM2-135M-Instruct", messages=weather, tools=[WEATHER, CLOCK],
                                            tool_choice=choice, max_tokens=MAX_TOKENS, temperature=0) as stream:
            final = stream.get_final_completion()
        streamed = final.choices[0].message.tool_calls
        assert [(c.function.name, json.loads(c.function.arguments)) for c in streamed] == [
            (c.function.name, json.loads(c.function.arguments)) for c in calls]

    # A tool message round trip: the call goes back with its result and the model answers in text.
    call = calls[0]
    history = weather + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                         {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 24 C"}]
    answer = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=history, tools=[WEATHER, CLOCK],
                                            max_tokens=16, temperature=0)
    assert answer.choices[0].message.content and answer.choices[0].message.tool_calls is None


def test_a_decode_worker_killed_mid_reply_leaves_every_reply_valid(deployment):
    backend = deployment.deployment.backend
    migrations = backend.counters["migrations"]
    workers = {w.worker_id: w.handle for w in deployment.deployment.workers}
    pid = ray.get(workers["decode-0"].stats.remote(), timeout=60).pid

    async def kill_mid_reply():
        while (await workers["decode-0"].stats.remote()).num_running < 3:
            await asyncio.sleep(0.005)
        os.kill(pid, signal.SIGKILL)

    results = asyncio.run(load(deployment.base_url, 24, during=kill_mid_reply))
    assert_all_valid(results, 24)
    assert backend.counters["migrations"] > migrations
    wait_until(lambda: all(w.alive for w in backend.workers()), 180, "Ray to restart decode-0")
