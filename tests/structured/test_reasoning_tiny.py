"""Reasoning output, structured output after the reasoning, and grammar refusals, through the
router's real backend (RayBackend over WorkerPools) and two EngineWorkers in this process
(tests/structured/local_pools.py: no Ray), on a tiny random Qwen3 whose chat template opens
`<think>\\n` (tests/engine/thinking_model.py).

Oracles: transformers' greedy tokens on the same folder, decoded and split at the first `</think>`
(the reasoning parser's rule; deepseek_r1 starts in reasoning, as the prompt opened it); jsonschema
for the constrained answer; the workers' own block counts for what a refused request left held;
hand-counted cache lookups for the grammar metrics.
"""

from __future__ import annotations

import json
import re
import time

import jsonschema
import pytest
from fastapi.testclient import TestClient

from router.app import build_app
from router.config import ServerConfig
from router.tokenizer import Tokenizer
from tests.engine.thinking_model import QUESTION, hf_greedy_ids, prompt_ids, save_thinking_model
from tests.hardening.corpus import check_answer, send, worker_refusals
from tests.structured.local_pools import FixedRoute, local_backend
from workers.config import EngineConfig

# Two tiny models and pairs of in-process workers: about a minute on two busy cores. No Ray, no default model.
pytestmark = pytest.mark.slow
CONFIG = EngineConfig(num_kv_blocks=64, max_num_batched_tokens=64)
NEW_TOKENS = 24
ANSWER = {
    "type": "object",
    "properties": {"sky_is_blue": {"type": "boolean"}},
    "required": ["sky_is_blue"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def never_ends():
    """A model that never writes </think> in its first NEW_TOKENS tokens: all of it is reasoning."""
    return save_thinking_model(None, NEW_TOKENS)


@pytest.fixture(scope="module")
def ends_early():
    """A model that writes </think> within its first three tokens (thinking_model's lm_head copy)."""
    return save_thinking_model(2, NEW_TOKENS)


def split_at_think_end(text: str) -> tuple[str, str]:
    reasoning, _, content = text.partition("</think>")
    return reasoning, content.lstrip("\n")


@pytest.fixture
def served(request):
    """A client over the local backend: (client, (p0, d0), hf model, hf tokenizer) for the model
    fixture named by the test's `model` parameter, remote or local prefill by `remote`."""
    folder, hf, tok = request.getfixturevalue(request.param[0])
    with local_backend(folder, CONFIG) as (backend, workers):
        app = build_app(
            backend,
            Tokenizer.from_model_dir(folder),
            "tiny",
            1024,
            FixedRoute(remote=request.param[1]),
            ServerConfig(reasoning_parser="deepseek_r1"),
        )
        with TestClient(app, raise_server_exceptions=False) as client:
            yield client, workers, hf, tok


def chat(client, stream: bool, **extra):
    body = {
        "messages": QUESTION,
        "max_tokens": NEW_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
        **extra,
    }
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    if not stream:
        message = r.json()["choices"][0]["message"]
        return message.get("reasoning_content"), message["content"], r.json()["choices"][0]["finish_reason"]
    chunks = [
        json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ") and line != "data: [DONE]"
    ]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    return (
        "".join(d.get("reasoning_content") or "" for d in deltas),
        "".join(d.get("content") or "" for d in deltas),
        finish[-1],
    )


def assert_nothing_held(workers) -> None:
    """Both workers are idle and every KV block is back in the free pool."""
    for w in workers:
        deadline = time.monotonic() + 5
        while (
            w.engine.request_ids()
            or w.engine.scheduler.held
            or w.engine.block_manager.num_free_blocks != w.engine.block_manager.num_blocks
        ):
            assert time.monotonic() < deadline, (w.worker_id, w.engine.request_ids(), w.engine.stats())
            time.sleep(0.02)


MODELS = [("never_ends", True), ("never_ends", False), ("ends_early", True), ("ends_early", False)]
IDS = ["never-remote", "never-local", "early-remote", "early-local"]


@pytest.mark.parametrize("served", MODELS, ids=IDS, indirect=True)
def test_reasoning_content_is_transformers_text_split_at_think_end(served):
    client, workers, hf, tok = served
    want = split_at_think_end(tok.decode(hf_greedy_ids(hf, prompt_ids(tok), NEW_TOKENS), skip_special_tokens=True))
    for stream in (False, True):
        reasoning, content, finish = chat(client, stream)
        assert (reasoning, content) == want
        assert finish == "length"
    assert_nothing_held(workers)


@pytest.mark.parametrize("served", MODELS, ids=IDS, indirect=True)
def test_structured_output_applies_after_the_reasoning(served):
    """The reasoning is the model's own (the grammar waits for </think>: the tokens before it are
    transformers' greedy ones); the answer after it validates. A model that never ends its
    reasoning is never constrained: its whole reply is transformers' text."""
    client, workers, hf, tok = served
    greedy = hf_greedy_ids(hf, prompt_ids(tok), NEW_TOKENS)
    think_end = tok.convert_tokens_to_ids("</think>")
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER}}
    for stream in (False, True):
        reasoning, content, finish = chat(client, stream, response_format=fmt)
        if think_end not in greedy:
            assert (reasoning, content, finish) == (tok.decode(greedy, skip_special_tokens=True), "", "length")
            continue
        assert reasoning == tok.decode(greedy[: greedy.index(think_end)], skip_special_tokens=True)
        jsonschema.validate(json.loads(content), ANSWER)
        assert finish == "stop"  # the grammar completed
    assert_nothing_held(workers)


def metric(text: str, name: str, worker: str) -> float:
    found = re.search(rf'^{re.escape(name)}\{{[^}}]*worker="{worker}"[^}}]*\}} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


@pytest.mark.parametrize(
    "served", [("ends_early", True), ("ends_early", False)], ids=["remote", "local"], indirect=True
)
def test_specs_the_workers_cannot_compile_are_400_and_leave_nothing_held(served):
    """The corpus's worker refusals (tests/hardening/corpus.py: they pass the router's checks and
    xgrammar refuses them), then a compile over the time limit: 400 naming the field, streamed or
    not, remote or local prefill, and neither worker holds a request or a block afterwards."""
    client, workers, _, _ = served
    for case in worker_refusals():
        check_answer(case, send(client, case))
    for w in workers:
        w.engine.grammars.compile_timeout_s = 0.01  # "[a-z]{200}" takes about 0.2 s to compile here
    r = client.post(
        "/v1/chat/completions",
        json={"messages": QUESTION, "max_tokens": 8, "structured_outputs": {"regex": "[a-z]{200}"}},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "structured_outputs", r.text
    assert "did not compile within" in r.json()["error"]["message"]
    assert_nothing_held(workers)
    assert chat(client, False)[2] == "length"  # and the workers still serve


@pytest.mark.parametrize("served", [("ends_early", True)], ids=["remote"], indirect=True)
def test_grammar_cache_metrics_reach_the_routers_metrics(served):
    """Hand-counted lookups: each worker looks a request's grammar up twice (compile_grammar on the
    call, then the engine's matcher), so a fresh spec is 1 miss + 1 hit, a repeated one 2 hits, on
    both the decode worker (reserve) and the prefill worker (prefill)."""
    client, workers, _, _ = served
    fmt = {
        "type": "json_schema",
        "json_schema": {
            "name": "m",
            "schema": {
                "type": "object",
                "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
                "required": ["n"],
                "additionalProperties": False,
            },
        },
    }
    chat(client, False, response_format=fmt)
    chat(client, True, response_format=fmt)
    deadline = time.monotonic() + 10
    while True:
        text = client.get("/metrics").text
        # The scrape reads the workers' last heartbeat (every 0.2 s here): wait for one after both requests.
        done = all(metric(text, "baton:structured_output_cache_hits_total", w) >= 3 for w in ("d0", "p0"))
        if done or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    for w in workers:
        stats = w.engine.grammars.stats
        assert (stats.cache_misses, stats.cache_hits, stats.compiles) == (1, 3, 1), (w.worker_id, stats)
        wid = w.worker_id
        assert metric(text, "baton:structured_output_cache_misses_total", wid) == 1
        assert metric(text, "baton:structured_output_cache_hits_total", wid) == 3
        assert metric(text, "baton:structured_output_compile_seconds_count", wid) == 1
        assert metric(text, "baton:structured_output_compile_seconds_sum", wid) == pytest.approx(
            stats.compile_seconds[-1]
        )
        assert re.search(rf'compile_seconds_bucket\{{[^}}]*le="\+Inf"[^}}]*worker="{wid}"[^}}]*\}} 1\.0$', text, re.M)
