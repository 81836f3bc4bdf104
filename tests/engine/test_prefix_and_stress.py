"""Prefix reuse computes only the uncached tail; random load with aborts and preemption leaks no block."""

from __future__ import annotations

import random

import pytest

from common.protocol import KVEventKind
from common.sampling_params import SamplingParams
from tests.engine.helpers import save_tiny_model
from workers.build import build_engine
from workers.config import EngineConfig
from workers.engine.llm_engine import LLMEngine
from workers.models.checkpoint import iter_safetensors
from workers.models.config import ModelConfig


def tiny_engine(**config) -> LLMEngine:
    folder, _ = save_tiny_model("llama", tie_word_embeddings=True)
    return build_engine(ModelConfig.from_model_dir(folder), EngineConfig(**config), iter_safetensors(folder))


def test_shared_512_prefix_computes_only_the_tail():
    engine = tiny_engine(num_kv_blocks=256, max_num_batched_tokens=256)
    rng = random.Random(0)
    shared = [rng.randrange(3, 512) for _ in range(512)]
    first = shared + [rng.randrange(3, 512) for _ in range(37)]
    second = shared + [rng.randrange(3, 512) for _ in range(45)]
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)

    engine.generate([first], greedy)
    before = engine.stats().num_computed_tokens
    [hit] = engine.generate([second], greedy)
    computed = engine.stats().num_computed_tokens - before
    # 45 uncached prompt tokens, then 11 decode steps (the 12th token is sampled, never computed).
    assert hit.num_cached_tokens == 512
    assert computed == 45 + 11

    cold = tiny_engine(num_kv_blocks=256, max_num_batched_tokens=256, enable_prefix_caching=False)
    [fresh] = cold.generate([second], greedy)
    assert fresh.num_cached_tokens == 0
    assert hit.token_ids == fresh.token_ids


def test_kv_events_report_stored_and_removed_hashes():
    from common.block_hash import hash_prefix_blocks

    engine = tiny_engine(num_kv_blocks=8, block_size=16, max_num_batched_tokens=64)
    prompt = list(range(10, 10 + 40))  # two full blocks and a partial one
    engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    events = engine.block_manager.drain_events()
    stored = [h for e in events if e.kind is KVEventKind.STORED for h in e.block_hashes]
    assert stored == hash_prefix_blocks(prompt, 16)
    # Fill the cache with other prompts: the old blocks get evicted and reported.
    for start in (100, 200, 300):
        engine.generate(
            [list(range(start, start + 60))], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        )
    removed = {h for e in engine.block_manager.drain_events() if e.kind is KVEventKind.REMOVED for h in e.block_hashes}
    assert set(stored) <= removed


@pytest.mark.slow  # a randomized load of many steps: about 3 s here
def test_random_load_with_aborts_and_preemption_leaks_nothing():
    # 24 blocks of 16 tokens for up to 16 sequences of up to ~100 tokens: preemption is certain.
    engine = tiny_engine(num_kv_blocks=24, block_size=16, max_num_seqs=16, max_num_batched_tokens=64)
    rng = random.Random(42)
    shared = [rng.randrange(3, 512) for _ in range(32)]
    submitted = finished = aborted = 0
    live: list[str] = []
    while submitted < 1000 or engine.has_unfinished_requests():
        while submitted < 1000 and len(live) < 24:
            prefix = shared if rng.random() < 0.5 else []
            prompt = prefix + [rng.randrange(3, 512) for _ in range(rng.randint(1, 60))]
            params = SamplingParams(
                max_tokens=rng.randint(1, 40),
                temperature=rng.choice([0.0, 0.8]),
                seed=rng.randint(0, 9),
                ignore_eos=True,
            )
            live.append(engine.add_request(prompt, params))
            submitted += 1
        for out in engine.step():
            if out.finished:
                live.remove(out.request_id)
                finished += 1
        if live and rng.random() < 0.15:
            victim = live.pop(rng.randrange(len(live)))
            assert engine.abort(victim)
            aborted += 1
        engine.block_manager.check_invariants()
    assert finished + aborted == 1000
    assert aborted > 50
    assert engine.stats().num_preemptions > 0
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks  # every block is free (possibly still caching a prefix)
    assert all(b.ref_count == 0 for b in bm.blocks)
    assert engine.stats().kv_usage == 0.0


def test_prompt_too_long_and_bad_ids_raise_value_error():
    engine = tiny_engine(num_kv_blocks=4, block_size=16)
    with pytest.raises(ValueError, match="64 tokens"):
        engine.add_request(list(range(3, 67)))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request([1, 2, 99999])
    with pytest.raises(ValueError, match="must not be empty"):
        engine.add_request([])
    with pytest.raises(ValueError, match="temperature"):
        engine.add_request([1, 2], SamplingParams(temperature=-1.0))
