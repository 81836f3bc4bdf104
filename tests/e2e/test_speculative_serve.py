"""A speculative server over HTTP, through the official openai client: `baton serve --speculative-config`
with suffix decoding on the decode pool (every request through the KV handoff), greedy chat answers
streamed and not. Oracle: the engine alone without speculation in this process (itself checked
against transformers in tests/engine). The workers' counters must show drafts accepted, so the test
cannot pass by never speculating, and the requests' traces must add up to them.
"""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from common.sampling_params import SamplingParams

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"
SUFFIX = '{"method": "suffix", "num_speculative_tokens": 4}'


@pytest.fixture(scope="module")
def spec_server(deployment_ray):
    from cluster.config import BatonConfig
    from testkit.cluster import serving
    from testkit.harness import free_port

    config = BatonConfig.from_options(
        port=free_port(),
        kv_cache_memory="64MiB",
        speculative_config=SUFFIX,
        local_prefill_threshold=0,
        prefill_queue_threshold=10**6,
    )
    with serving(config, actor_name_prefix="spec") as running:
        yield running


def questions() -> list[str]:
    from pydoc_data.topics import topics

    passage = topics["pass"].strip()[:400]
    return ["What is the capital of France?", f"Repeat this passage exactly, word for word:\n\n{passage}"]


def test_greedy_answers_equal_the_engine_without_speculation(
    spec_server, reference_engine, tokenizer, greedy_answers_match
):
    before = spec_server.stats()["decode-0"].spec_decode
    greedy_answers_match(spec_server.base_url, reference_engine)
    client = openai.OpenAI(base_url=spec_server.base_url + "/v1", api_key="unused")
    for question in questions():
        messages = [{"role": "user", "content": question}]
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        [want] = reference_engine.generate([prompt], SamplingParams(max_tokens=64, temperature=0.0))
        reply = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=64)
        assert reply.choices[0].message.content == want.text
        assert reply.usage.completion_tokens == len(want.token_ids)
        streamed = "".join(
            c.choices[0].delta.content or ""
            for c in client.chat.completions.create(
                model=MODEL, messages=messages, temperature=0, max_tokens=64, stream=True
            )
            if c.choices
        )
        assert streamed == want.text
    after = spec_server.stats()["decode-0"].spec_decode
    assert after.num_accepted_tokens > before.num_accepted_tokens and after.num_drafts > before.num_drafts
    # Each request's trace has its drafts (the dashboard shows them): together, what the worker counted.
    status = httpx.get(spec_server.base_url + "/v1/status").json()
    assert len(status["recent"]) == 7  # 3 of greedy_answers_match, 2 x 2 here
    assert sum(t["spec_draft_tokens"] for t in status["recent"]) == after.num_draft_tokens - before.num_draft_tokens
    assert sum(t["spec_accepted_tokens"] for t in status["recent"]) == (
        after.num_accepted_tokens - before.num_accepted_tokens
    )
    # The workers' totals (the dashboard's acceptance rate) as the router's last heartbeat saw them.
    deadline = time.monotonic() + 20
    while (
        httpx.get(spec_server.base_url + "/v1/status").json()["pools"]["decode"][0]["spec_draft_tokens"]
        != after.num_draft_tokens
    ):
        assert time.monotonic() < deadline, "the router's status never caught up with the worker's drafts"
        time.sleep(0.2)
