"""Structured output and tool calls on a real deployment (Ray on 127.0.0.1, 1 prefill + 2 decode
workers, the router over HTTP): JSON-schema replies at concurrency 16, streamed and not, prefilled
remotely and locally; the official openai client (parse, forced tool calls, a tool round trip); a
decode worker SIGKILLed mid-reply. Oracle: jsonschema on every reply (and each tool's parameters
schema on every call's arguments)."""

from __future__ import annotations

import asyncio
import json

import httpx
import jsonschema
import openai
import pydantic
import pytest

from bench.structured_load import schema_load
from cluster.config import BatonConfig
from testkit.cluster import leave_ray, serving
from testkit.harness import free_port, wait_until

pytestmark = pytest.mark.slow

DEADLINE_S = 300.0
MAX_TOKENS = 120  # room for the longest of the five schemas' objects
# Prompts whose uncached part is longer than this are prefilled on the prefill worker, the others
# on the decode worker: the long, distinct system message of every other request
# (bench.structured_load.schema_messages) sends half of them the remote way.
LOCAL_THRESHOLD = 60


@pytest.fixture(scope="module")
def deployment():
    config = BatonConfig.from_options(
        port=free_port(),
        prefill_workers=1,
        decode_workers=2,
        kv_cache_memory="64MiB",
        max_num_seqs=32,
        local_prefill_threshold=LOCAL_THRESHOLD,
        request_timeout=DEADLINE_S,
        max_restarts=2,
    )
    leave_ray()  # a private Ray of this module's own, which the deployment shuts down after it
    with serving(config, actor_name_prefix="structured") as running:
        yield running


def load(base_url: str, n: int, during=None):
    return asyncio.run(
        schema_load(base_url, n, concurrency=16, max_tokens=MAX_TOKENS, timeout_s=DEADLINE_S, during=during)
    )


def assert_all_valid(replies) -> None:
    bad = [(r.request.schema_name, r.text, r.problem) for r in replies if r.problem is not None]
    assert not bad, bad[:5]


def test_thirty_two_schema_requests_at_concurrency_16_all_validate(deployment):
    backend = deployment.deployment.backend
    remote, local = backend.counters["remote_prefill"], backend.counters["local_prefill"]
    assert_all_valid(load(deployment.base_url, 32))
    # Both ways across the pools were taken: the first token from the prefill worker, and not.
    assert backend.counters["remote_prefill"] > remote and backend.counters["local_prefill"] > local
    metrics = httpx.get(deployment.base_url + "/metrics").text
    assert 'baton:structured_output_requests_total{kind="json_schema",model_name=' in metrics


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=24)
    age: int = pydantic.Field(ge=0, le=120)


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
TOOLS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, CLOCK)}


def test_the_openai_client_parses_models_and_gets_valid_tool_calls(deployment):
    client = openai.OpenAI(base_url=deployment.base_url + "/v1", api_key="none", timeout=DEADLINE_S)
    ask = [{"role": "user", "content": "Who is Ada? Answer as JSON."}]
    parsed = client.chat.completions.parse(
        model="SmolLM2-135M-Instruct", messages=ask, response_format=Person, max_tokens=MAX_TOKENS, temperature=0
    )
    assert isinstance(parsed.choices[0].message.parsed, Person)

    weather = [{"role": "user", "content": "What is the weather in Paris?"}]
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        full = client.chat.completions.create(
            model="SmolLM2-135M-Instruct",
            messages=weather,
            tools=[WEATHER, CLOCK],
            tool_choice=choice,
            max_tokens=MAX_TOKENS,
            temperature=0,
        )
        assert full.choices[0].finish_reason == "tool_calls"
        calls = full.choices[0].message.tool_calls
        assert calls and all(c.function.name in TOOLS for c in calls)
        for c in calls:
            jsonschema.validate(json.loads(c.function.arguments), TOOLS[c.function.name])
        if isinstance(choice, dict):
            assert [c.function.name for c in calls] == ["get_weather"]
        # Streamed: the deltas add up to the same calls (the client's own accumulation).
        with client.chat.completions.stream(
            model="SmolLM2-135M-Instruct",
            messages=weather,
            tools=[WEATHER, CLOCK],
            tool_choice=choice,
            max_tokens=MAX_TOKENS,
            temperature=0,
        ) as stream:
            final = stream.get_final_completion()
        streamed = final.choices[0].message.tool_calls
        assert [(c.function.name, json.loads(c.function.arguments)) for c in streamed] == [
            (c.function.name, json.loads(c.function.arguments)) for c in calls
        ]

    # A tool message round trip: the call goes back with its result and the model answers in text.
    call = calls[0]
    history = weather + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 24 C"},
    ]
    answer = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=history, tools=[WEATHER, CLOCK], max_tokens=16, temperature=0
    )
    assert answer.choices[0].message.content and answer.choices[0].message.tool_calls is None


def test_a_decode_worker_killed_mid_reply_leaves_every_reply_valid(deployment):
    backend = deployment.deployment.backend
    migrations = backend.counters["migrations"]
    assert_all_valid(load(deployment.base_url, 20, during=deployment.killer_mid_reply("decode-0")))
    assert backend.counters["migrations"] > migrations
    wait_until(lambda: all(w.alive for w in backend.workers()), 180, "Ray to restart decode-0")
