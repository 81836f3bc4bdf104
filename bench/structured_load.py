"""The structured-output workload that bench/structured.py measures and the tests replay: five
JSON schemas (nested objects, arrays, enums, required fields, string patterns, number bounds)
with prompts for them, the reply check (jsonschema), an HTTP load of schema requests (half
streamed; odd ones behind a long system message, so a kv-aware router prefills them remotely) that
bench/structured_validity.py and tests/structured replay, and the `vllm bench serve` command and
result aggregation the benchmark uses.
"""

from __future__ import annotations

import asyncio
import json
import statistics
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import jsonschema

MODEL_NAME = "SmolLM2-135M-Instruct"
SCHEMAS: dict[str, dict] = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "minLength": 1, "maxLength": 24},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    "order": {
        "type": "object",
        "properties": {
            "id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
            "status": {"type": "string", "enum": ["pending", "shipped", "delivered"]},
            "total": {"type": "number", "minimum": 0, "maximum": 1000},
        },
        "required": ["id", "status", "total"],
        "additionalProperties": False,
    },
    "tags": {
        "type": "object",
        "properties": {
            "tags": {
                "type": "array",
                "items": {"type": "string", "enum": ["red", "green", "blue"]},
                "minItems": 1,
                "maxItems": 3,
            }
        },
        "required": ["tags"],
        "additionalProperties": False,
    },
    "address": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 20},
            "location": {
                "type": "object",
                "properties": {
                    "lat": {"type": "number", "minimum": -90, "maximum": 90},
                    "lon": {"type": "number", "minimum": -180, "maximum": 180},
                },
                "required": ["lat", "lon"],
                "additionalProperties": False,
            },
        },
        "required": ["city", "location"],
        "additionalProperties": False,
    },
    "flag": {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "code": {"type": "integer", "enum": [200, 404, 500]}},
        "required": ["ok", "code"],
        "additionalProperties": False,
    },
}
PROMPTS: dict[str, str] = {
    "person": "Describe a person as JSON with a name and an age.",
    "order": "Give an order as JSON: an id like ABC-1234, a status and a total price.",
    "tags": "List one to three colour tags as JSON.",
    "address": "Give a city and its latitude and longitude as JSON.",
    "flag": "Report a status as JSON: ok and an HTTP code.",
}
VARIANTS = ("", " Be brief.", " Use realistic values.", " Answer now.", " Think of an example.")


@dataclass(frozen=True)
class SchemaRequest:
    schema_name: str
    prompt: str

    @property
    def schema(self) -> dict:
        return SCHEMAS[self.schema_name]


def schema_requests(n: int) -> list[SchemaRequest]:
    """n prompts, round-robin over the schemas, with varied wording (distinct prompts)."""
    names = list(SCHEMAS)
    return [
        SchemaRequest(
            names[i % len(names)],
            PROMPTS[names[i % len(names)]]
            + VARIANTS[(i // len(names)) % len(VARIANTS)]
            + (f" (case {i})" if i >= len(names) * len(VARIANTS) else ""),
        )
        for i in range(n)
    ]


def check_reply(text: str, schema: dict, allow_trailing: bool = False) -> str | None:
    """None when `text` is JSON valid against `schema` (with allow_trailing: when it starts with
    such a value, whatever follows it), else why not."""
    try:
        value, end = json.JSONDecoder().raw_decode(text.lstrip())
    except json.JSONDecodeError as e:
        return f"not JSON: {e}"
    if not allow_trailing and text.lstrip()[end:].strip():
        return f"text after the JSON value: {text.lstrip()[end:][:40]!r}"
    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError as e:
        return f"invalid: {e.message}"
    return None


def response_format(schema_name: str) -> dict:
    return {"type": "json_schema", "json_schema": {"name": schema_name, "schema": SCHEMAS[schema_name], "strict": True}}


LONG_SYSTEM = "You answer in JSON. " + "Keep every value short and realistic. " * 12


def schema_messages(i: int, prompt: str) -> list[dict]:
    """Request i's chat: odd ones open with a long system message of their own (a long uncached
    prefix: the kv-aware router prefills it on the prefill pool), even ones are the prompt alone."""
    user = [{"role": "user", "content": prompt}]
    return ([{"role": "system", "content": f"Request {i}. {LONG_SYSTEM}"}] + user) if i % 2 else user


@dataclass(frozen=True)
class SchemaReply:
    request: SchemaRequest
    text: str
    finish_reason: str | None

    @property
    def problem(self) -> str | None:
        """None for a reply that is valid JSON of its schema and ended with `stop`, else why not."""
        why = check_reply(self.text, self.request.schema)
        if why is None and self.finish_reason != "stop":
            why = f"finish_reason {self.finish_reason}"
        return why


async def _schema_request(
    client: httpx.AsyncClient, i: int, request: SchemaRequest, max_tokens: int, timeout_s: float
) -> SchemaReply:
    """Request i: streamed when i is even, greedy except every third (sampled at 0.7, seeded)."""
    stream = i % 2 == 0
    body = {
        "messages": schema_messages(i, request.prompt),
        "max_tokens": max_tokens,
        "temperature": 0.0 if i % 3 else 0.7,
        "seed": i,
        "response_format": response_format(request.schema_name),
        "stream": stream,
    }
    if not stream:
        r = await client.post("/v1/chat/completions", json=body, timeout=timeout_s)
        r.raise_for_status()
        choice = r.json()["choices"][0]
        return SchemaReply(request, choice["message"]["content"], choice["finish_reason"])
    text, reason = "", None
    async with client.stream("POST", "/v1/chat/completions", json=body, timeout=timeout_s) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return SchemaReply(request, text, f"error: {chunk['error']}")
                text += chunk["choices"][0]["delta"].get("content") or ""
                reason = chunk["choices"][0]["finish_reason"] or reason
    return SchemaReply(request, text, reason)


async def schema_load(
    base_url: str,
    n: int,
    concurrency: int = 16,
    max_tokens: int = 120,
    timeout_s: float = 300.0,
    during: Callable[[], Awaitable[None]] | None = None,
) -> list[SchemaReply]:
    """`schema_requests(n)` over HTTP at `concurrency`; `during()` runs once the requests are sent
    (e.g. a worker killed mid-reply)."""
    requests = schema_requests(n)
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout_s) as client:

        async def gated(i: int) -> SchemaReply:
            async with gate:
                return await _schema_request(client, i, requests[i], max_tokens, timeout_s)

        tasks = [asyncio.create_task(gated(i)) for i in range(n)]
        if during is not None:
            await during()
        return list(await asyncio.gather(*tasks))


def bench_command(
    vllm: str,
    base_url: str,
    tokenizer: str,
    seed: int,
    num_prompts: int,
    concurrency: int,
    max_tokens: int,
    out: Path,
    schema: dict | None,
    output_range_ratio: float = 0.0,
) -> list[str]:
    """One `vllm bench serve` over vLLM's random prompts (`seed`), sampling as its defaults do;
    constrained by `schema` when given. Unconstrained, every reply runs to its drawn length:
    `max_tokens`, or uniform within `output_range_ratio` of it."""
    command = [
        vllm,
        "bench",
        "serve",
        "--backend",
        "openai-chat",
        "--endpoint",
        "/v1/chat/completions",
        "--base-url",
        base_url,
        "--model",
        MODEL_NAME,
        "--tokenizer",
        tokenizer,
        "--dataset-name",
        "random",
        "--random-input-len",
        "64",
        "--random-output-len",
        str(max_tokens),
        "--num-prompts",
        str(num_prompts),
        "--max-concurrency",
        str(concurrency),
        "--seed",
        str(seed),
        "--disable-tqdm",
        "--save-result",
        "--save-detailed",
        "--result-dir",
        str(out.parent),
        "--result-filename",
        out.name,
    ]
    if schema is None:
        spread = (
            ["--random-range-ratio", json.dumps({"input": 0.0, "output": output_range_ratio})]
            if output_range_ratio
            else []
        )
        return command + spread + ["--ignore-eos"]
    # `vllm bench serve` sets ignore_eos on every request of its random dataset; a structured reply
    # ends with its value (the grammar's stop token), so the constrained runs turn it off again.
    return command + ["--extra-body", json.dumps({"structured_outputs": {"json": schema}, "ignore_eos": False})]


def matching_lengths(output_lens: list[int]) -> tuple[int, float]:
    """(mean, range ratio) of the uniform length draw of `vllm bench serve --random-range-ratio`
    whose spread matches these lengths: a uniform draw on [m (1 - r), m (1 + r)] has the standard
    deviation m r / sqrt(3), so r = sqrt(3) sd / m (at most 0.95; 0 for fewer than two lengths)."""
    if not output_lens:
        return 1, 0.0
    mean = statistics.fmean(output_lens)
    if len(output_lens) < 2:
        return max(1, round(mean)), 0.0
    return max(1, round(mean)), round(min(0.95, 3**0.5 * statistics.stdev(output_lens) / mean), 3)


def aggregate(runs: list[dict]) -> dict:
    """Output tokens over summed durations of several `vllm bench serve` results."""
    tokens = sum(r.get("total_output_tokens", 0) for r in runs)
    seconds = sum(r.get("duration", 0.0) for r in runs)
    completed = sum(r.get("completed", 0) for r in runs)

    def mean_of(key: str) -> float | None:
        # vLLM's per-run means, weighted by the requests each run completed.
        weighted = [(r[key], r.get("completed", 0)) for r in runs if r.get(key) is not None]
        total = sum(n for _, n in weighted)
        return round(sum(v * n for v, n in weighted) / total, 2) if total else None

    return {
        "completed": completed,
        "failed": sum(r.get("failed", 0) for r in runs),
        "output_tokens": tokens,
        "seconds": round(seconds, 3),
        "output_tokens_per_s": round(tokens / seconds, 2) if seconds else None,
        "mean_ttft_ms": mean_of("mean_ttft_ms"),
        "mean_tpot_ms": mean_of("mean_tpot_ms"),
    }
