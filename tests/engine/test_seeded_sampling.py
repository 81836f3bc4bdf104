"""Seeded sampling through the engine: a seeded request gets the same tokens alone, in a batch, and
prefilled on one worker then decoded on another (the decode worker continues the seed's draws
after the prefill worker's). A tiny random Llama keeps this fast; the oracle is the engine run alone."""

from __future__ import annotations

import pytest

from common.sampling_params import SamplingParams
from tests.engine.helpers import handoff, save_tiny_model, worker_pair
from workers.build import load_engine
from workers.config import EngineConfig

CONFIG = EngineConfig(kv_cache_memory=8 << 20)
PROMPTS = [[5, 17, 99, 23, 4, 250], [300, 2, 2, 2, 71], [11] * 40, [400, 401, 402]]


@pytest.fixture(scope="module")
def model_dir():
    folder, _ = save_tiny_model("llama")
    return folder


def seeded(seed: int) -> SamplingParams:
    return SamplingParams(max_tokens=24, temperature=1.0, top_p=0.95, seed=seed, ignore_eos=True)


def test_seeded_requests_get_the_same_tokens_alone_and_batched(model_dir):
    engine = load_engine(model_dir, CONFIG)
    alone = [engine.generate([p], seeded(100 + i))[0].token_ids for i, p in enumerate(PROMPTS)]
    mixed = PROMPTS + [[9, 8, 7], [1, 2, 3, 4]]
    params = [seeded(100 + i) for i in range(len(PROMPTS))] + [
        SamplingParams(max_tokens=30, temperature=1.0, ignore_eos=True),
        SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
    ]
    batched = [c.token_ids for c in engine.generate(mixed, params)[: len(PROMPTS)]]
    assert batched == alone
    # Unseeded requests do not repeat one another (24 tokens over a 512-token vocabulary).
    free = engine.generate([PROMPTS[0]] * 2, SamplingParams(max_tokens=24, ignore_eos=True))
    assert free[0].token_ids != free[1].token_ids


def test_a_seeded_request_continues_its_draws_across_the_prefill_decode_handoff(model_dir):
    engine = load_engine(model_dir, CONFIG)
    with worker_pair(model_dir, CONFIG) as (prefill, decode):
        for i, prompt in enumerate(PROMPTS[:2]):
            params = seeded(7 + i)
            [want] = engine.generate([prompt], params)
            tokens, _, _, _ = handoff(prefill, decode, f"r{i}", prompt, params)
            assert tokens == want.token_ids
