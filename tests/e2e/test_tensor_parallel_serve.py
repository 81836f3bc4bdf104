"""The default model served at --tensor-parallel-size 3 (SmolLM2-135M: 9 query heads, 3 KV heads, one
per rank) over HTTP: both pools are groups of three Ray actors, rank 0 scheduling and broadcasting
each step, and every remote prefill moves each rank's KV head into the decode group's same rank.

Oracles: the engine alone at TP 1 in this process (itself checked against transformers in
tests/engine, where the sharded engine is also checked against TP 1 and transformers logit by
logit), and the KV bytes a handoff must move, computed by hand from the model's shape.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import openai
import pytest
import ray

from common.sampling_params import SamplingParams

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"
TP = 3
# SmolLM2-135M: 30 layers, K and V, 3 KV heads of 64 float32 values per token.
BYTES_PER_TOKEN = 30 * 2 * 3 * 64 * 4
BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def tp_server():
    from cluster.config import BatonConfig
    from cluster.harness import free_port
    from cluster.testing import leave_ray, serving

    # local_prefill_threshold=0: every request crosses the KV handoff between the two groups.
    config = BatonConfig.from_options(port=free_port(), kv_cache_memory="64MiB", tensor_parallel_size=TP,
                                      local_prefill_threshold=0, migration_wait=120.0)
    leave_ray()
    with serving(config) as running:
        yield running


def chat(reference_engine, tokenizer, question: str, max_tokens: int) -> str:
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True)
    [done] = reference_engine.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0.0))
    return done.text


def rank_pids(worker_actor_name: str) -> dict[str, list[int]]:
    """Pids of a worker's rank 0 ("rank0") and of the live rank actors it owns ("ranks")."""
    alive = [a for a in ray._private.state.actors().values() if a["State"] == "ALIVE"]
    rank0 = [a for a in alive if a.get("Name") == worker_actor_name]
    owners = {a["Address"]["Port"] for a in rank0}  # a process's own port: its rank actors' owner's
    ranks = [a["Pid"] for a in alive if a["ActorClassName"].endswith("TPRankActor")
             and a["OwnerAddress"]["Port"] in owners]
    return {"rank0": [a["Pid"] for a in rank0], "ranks": ranks}


def test_greedy_answers_equal_tp1_and_every_rank_moves_its_heads(tp_server, reference_engine, greedy_answers_match):
    before = tp_server.stats()
    greedy_answers_match(tp_server.base_url, reference_engine)

    after = tp_server.wait_idle()
    assert all(s.num_free_blocks == s.num_blocks for s in after.values()), "a block is still held"
    sent = {w: after[w].kv_blocks_sent - before[w].kv_blocks_sent for w in after}
    received = sum(after[w].kv_blocks_received - before[w].kv_blocks_received for w in after)
    nbytes = sum(after[w].kv_bytes_sent - before[w].kv_bytes_sent for w in after)
    assert sent["prefill-0"] > 0 and sent["prefill-0"] == received
    # Each block's bytes are the three ranks' heads together: had a rank moved nothing, a third is missing.
    assert nbytes == sent["prefill-0"] * BLOCK_SIZE * BYTES_PER_TOKEN
    assert tp_server.deployment.backend.counters["local_prefill"] == 0
    # The trace says what each rank pair moved: one KV head each, so a third of every handoff.
    recent = [t for t in httpx.get(tp_server.base_url + "/v1/status").json()["recent"] if t["decision"] == "remote"]
    assert recent and all(t["kv_rank_pairs"] == [[i, i, t["kv_bytes"] // TP] for i in range(TP)] and t["kv_bytes"] > 0
                          for t in recent)
    for worker in ("baton-prefill-0", "baton-decode-0"):
        pids = rank_pids(worker)
        assert len(pids["rank0"]) == 1 and len(pids["ranks"]) == TP - 1, f"{worker}: {pids}"


def test_a_killed_rank_restarts_its_group_and_the_streams_finish_exactly(tp_server, reference_engine, tokenizer):
    questions = ["Describe the moon in one sentence.", "Why do birds migrate? Answer briefly.",
                 "Explain what a compiler does, in two sentences, for a beginner."]
    expected = {q: chat(reference_engine, tokenizer, q, 32) for q in questions}
    decode = next(w.handle for w in tp_server.deployment.workers if w.worker_id == "decode-0")
    rank0_before = rank_pids("baton-decode-0")["rank0"]
    decode_ranks = ray.get(decode.stats.remote(), timeout=60)  # warm: the handle answers
    assert decode_ranks.pid == rank0_before[0]
    client = openai.AsyncOpenAI(base_url=tp_server.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)

    async def one(q: str) -> str:
        stream = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": q}],
                                                      temperature=0, max_tokens=32, stream=True)
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    async def kill_a_decode_rank() -> int:
        while (await decode.stats.remote()).num_running < 2:
            await asyncio.sleep(0.005)
        victim = rank_pids("baton-decode-0")["ranks"][-1]
        os.kill(victim, signal.SIGKILL)
        return victim

    async def run():
        return await asyncio.gather(kill_a_decode_rank(), *(one(q) for q in questions))

    victim, *texts = asyncio.run(run())
    assert texts == [expected[q] for q in questions]
    deadline = time.monotonic() + 60
    while rank_pids("baton-decode-0")["rank0"] in ([], rank0_before) and time.monotonic() < deadline:
        time.sleep(0.5)
    after = rank_pids("baton-decode-0")
    assert after["rank0"] and after["rank0"] != rank0_before, "decode-0's rank 0 did not restart with its group"
    assert victim not in after["ranks"]
    assert tp_server.deployment.backend.counters["migrations"] >= 1
