"""A small version of bench/fp8_accuracy.py: SmolLM2-135M-Instruct with FP8 weights and FP8 KV
against float32 on one 1024-token window of pydoc topics (the bench's first window), perplexity
within 5%, and the first greedy tokens of a chat prompt. The full table (20 windows, 20
prompts) is the bench's job."""

from __future__ import annotations

import math

import pytest

from common.sampling_params import SamplingParams
from workers.build import load_engine
from workers.config import EngineConfig
from workers.engine.evaluation import CHUNK, chat_prompts, eval_windows

pytestmark = pytest.mark.slow


def test_fp8_weights_and_kv_perplexity_within_5_percent_of_float32():
    from transformers import AutoTokenizer

    from workers.models.files import resolve_model_dir

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(quiet=True))
    [window] = eval_windows(tokenizer, 1)
    prompt = chat_prompts(tokenizer)[0]
    params = SamplingParams(max_tokens=8, temperature=0.0)
    results = {}
    for name, overrides in (("float32", {}), ("fp8", dict(quantization="fp8", kv_cache_dtype="fp8"))):
        engine = load_engine(None, EngineConfig(kv_cache_memory=64 << 20, **overrides))
        logprobs = engine.score(window, chunk_size=CHUNK)
        results[name] = (math.exp(-float(logprobs.double().mean())), engine.generate([prompt], params)[0].token_ids)
        del engine
    (ppl32, tokens32), (ppl8, tokens8) = results["float32"], results["fp8"]
    assert 1.0 < ppl32 < 50.0  # a sane model on English text
    assert ppl8 != ppl32  # FP8 really ran
    assert ppl8 / ppl32 - 1.0 < 0.05, (ppl8, ppl32)
    assert tokens8[:4] == tokens32[:4]  # "The capital of France"
