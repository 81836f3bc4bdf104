"""Baton on a Ray cluster of simulated nodes (tests/cluster/conftest.py): a head without Baton
resources, two prefill nodes and two decode nodes, all on 127.0.0.1.

Oracles: where each worker runs comes from Ray's own actor table, and which node type a node
is from its resources as Ray reports them; greedy float32 answers over HTTP must equal the
engine alone in this process; the KV backend of each pair is checked against the blocks each
decode worker says it received.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest
import ray
from cluster_fixtures import actor_nodes, cluster_config, serving_on

from cluster.placement import PlacementError
from common.sampling_params import SamplingParams
from workers.models.files import resolve_model_dir

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
MODEL = "SmolLM2-135M-Instruct"
QUESTIONS = [
    "What is the capital of France?",
    "Name a fruit.",
    "What is 2+2?",
    "Give a synonym for happy.",
    "Why do birds migrate? Answer briefly.",
    "Count from one to five.",
]


def expected_chats(reference_engine, tokenizer, questions: list[str], max_tokens: int) -> dict[str, str]:
    """The engine alone's greedy answer to each question, as one batch (a step for all of them)."""
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True) for q in questions
    ]
    done = reference_engine.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    return {q: d.text for q, d in zip(questions, done)}


def test_pools_land_on_their_node_types_kv_crosses_nodes_over_gloo_and_answers_match(
    fake_cluster, reference_engine, tokenizer
):
    config = cluster_config(fake_cluster)
    with serving_on(config, "mn") as server:
        deployment = server.deployment
        where = actor_nodes(deployment)
        prefill_nodes, decode_nodes = fake_cluster.node_ids("prefill"), fake_cluster.node_ids("decode")
        assert len(prefill_nodes) == len(decode_nodes) == 2 and not prefill_nodes & decode_nodes
        assert {where["prefill-0"], where["prefill-1"]} == prefill_nodes  # one worker per prefill node
        assert {where["decode-0"], where["decode-1"]} == decode_nodes
        assert deployment.nodes == where
        head = fake_cluster.node_ids("ray.head.default")
        assert not head & set(where.values())  # the head (router, driver) runs no worker
        # Every prefill/decode pair is on two nodes: the handshake chose gloo for each.
        assert deployment.kv_links == {
            (p, d): "gloo" for p in ("prefill-0", "prefill-1") for d in ("decode-0", "decode-1")
        }

        expected = expected_chats(reference_engine, tokenizer, QUESTIONS, 24)
        assert expected[QUESTIONS[0]] == "The capital of France is Paris."
        before = server.stats()
        client = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)

        async def one(q: str) -> tuple[str, str]:
            stream = await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": q}], temperature=0, max_tokens=24, stream=True
            )
            text = ""
            async for chunk in stream:
                if chunk.choices:
                    text += chunk.choices[0].delta.content or ""
            return q, text

        async def run_all():
            return await asyncio.gather(*(one(QUESTIONS[i % len(QUESTIONS)]) for i in range(12)))

        results = asyncio.run(run_all())
        wrong = [(q, text) for q, text in results if text != expected[q]]
        assert not wrong, wrong[:3]

        after = server.wait_idle()
        for wid, s in after.items():
            assert s.num_free_blocks == s.num_blocks, f"{wid} leaked {s.num_blocks - s.num_free_blocks} blocks"
        received = {w: after[w].kv_blocks_received - before[w].kv_blocks_received for w in ("decode-0", "decode-1")}
        links = {
            w.worker_id: ray.get(w.client.kv_links(), timeout=30) for w in deployment.workers if w.role == "prefill"
        }
        over = {}
        for wid, worker_links in links.items():
            for link in worker_links:
                assert link.kind == "gloo" and link.peer_node_id == where[link.peer], (wid, link)
                over[link.peer] = over.get(link.peer, 0) + link.blocks_sent
        # Whatever each decode worker received came over gloo, from the other nodes.
        assert sum(received.values()) > 0 and over == received
        assert deployment.backend.counters["remote_prefill"] == len(results)


def test_pool_that_cannot_be_placed_fails_within_its_deadline(fake_cluster):
    """Decode workers asking for a GPU on a cluster without GPUs, and for labels no node carries."""
    deadline = 1.0  # short: the pool can never be placed, so a longer wait shows nothing more
    for options, lacking in (
        ({"gpus_per_worker": 1.0}, "Lacking: GPU (needs 1, the most any node offers is 0)"),
        ({"decode_node_labels": "baton-pool=nowhere"}, "Lacking: no node carries the labels baton-pool=nowhere"),
    ):
        config = cluster_config(
            fake_cluster, prefill_workers=0, decode_workers=1, placement_timeout=deadline, **options
        )
        started = time.monotonic()
        with pytest.raises(PlacementError) as failure:
            with serving_on(config, "unplaced"):
                pass
        took = time.monotonic() - started
        message = str(failure.value)
        assert took < deadline + 15, f"start-up took {took:.1f} s with a {deadline} s placement deadline"
        assert f"the decode pool cannot be placed: decode-0 still not placed by Ray after {deadline:.0f} s" in message
        assert lacking in message, message
        # What the nodes offer, each by its id: the decode nodes' baton_decode among them.
        for node_id in fake_cluster.node_ids("decode"):
            assert f"{node_id[:12]} (127.0.0.1): CPU 1/1 free, baton_decode 1/1 free" in message, message
        # Nothing is left waiting in Ray.
        states = [a["State"] for a in ray._private.state.actors().values() if a["Name"].startswith("unplaced-")]
        assert states and set(states) == {"DEAD"}, states


def test_node_without_the_model_fails_start_up_naming_node_and_path(fake_cluster, tmp_path, monkeypatch):
    """--model as a Hugging Face repo id: this process finds it in its own (offline) Hugging Face
    cache; the simulated nodes' cache is empty, so every worker fails naming its node and path."""
    folder = resolve_model_dir(None, quiet=True)
    snapshot = tmp_path / "hub" / "models--HuggingFaceTB--SmolLM2-135M-Instruct" / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    for f in folder.iterdir():
        os.symlink(f, snapshot / f.name)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("0123abcd")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    config = cluster_config(
        fake_cluster, model="HuggingFaceTB/SmolLM2-135M-Instruct", prefill_workers=0, decode_workers=1
    )
    with pytest.raises(ValueError) as failure:
        with serving_on(config, "nomodel"):
            pass
    message = str(failure.value)
    [node] = [n for n in fake_cluster.node_ids("decode") if n in message]
    assert f"worker decode-0 failed to start on node {node}" in message, message
    assert "'HuggingFaceTB/SmolLM2-135M-Instruct' is neither a folder nor in the local Hugging Face cache" in message
    assert str(fake_cluster.node_hf_cache) in message


def test_joining_passes_no_resources_to_ray(fake_cluster):
    """`--address` joins the cluster as a driver: Ray refuses a driver that passes resources
    ("num_cpus and num_gpus must not be provided"), so joining at all shows none are passed."""
    script = (
        "import ray, sys; from cluster.launcher import start_ray; "
        "assert start_ray(sys.argv[1]) is False; "
        "print('NODES', len(ray.nodes()), ray.cluster_resources().get('baton_decode')); ray.shutdown()"
    )
    env = dict(os.environ, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_AUTH_MODE="disabled", PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, "-c", script, fake_cluster.address],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "NODES 5 2.0" in proc.stdout
