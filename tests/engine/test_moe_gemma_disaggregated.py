"""A tiny Qwen3-MoE and a tiny Gemma 3 (sliding windows shorter than the prompts) across the
pools, FP8 KV cache: a prefill worker pushes the prompt's KV over shared memory to a decode
worker, which decodes; half-way a second decode worker takes the request over as a migration
does (the router resubmits prompt + the tokens already streamed with a ResumeState, and the first
worker's request is gone). The oracle is the same model in one engine, no handoff, same KV dtype:
every token equal, and no block left held on any worker.

These are the EngineWorkers `baton serve` runs, without Ray and HTTP (tests/e2e covers the router's
side of a migration for every model alike: it only sees token ids)."""

from __future__ import annotations

import pytest
import torch

from common.protocol import ResumeState
from common.sampling_params import SamplingParams
from testkit import workers as calls
from tests.engine.helpers import poll_until, save_tiny_model
from tests.engine.test_gemma_and_windows import GEMMA_CASES, WINDOW
from workers.build import load_engine
from workers.config import EngineConfig
from workers.shell.worker import EngineWorker, WorkerConfig

pytestmark = pytest.mark.slow

CONFIG = EngineConfig(kv_cache_memory=16 << 20, kv_cache_dtype="fp8", max_num_batched_tokens=32)
NEW_TOKENS, MIGRATE_AFTER = 20, 8
MODELS = {"qwen3_moe": dict(num_hidden_layers=2, vocab_size=512), "gemma3": GEMMA_CASES["gemma3"]}


def prompts(seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 512, (n,), generator=generator).tolist() for n in (3 * WINDOW, 5 * WINDOW + 3)]


@pytest.mark.parametrize("kind", list(MODELS))
def test_remote_prefill_fp8_kv_and_a_migration_are_exact(kind):
    folder, _ = save_tiny_model(kind, **MODELS[kind])
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    oracle = [c.token_ids for c in load_engine(folder, CONFIG).generate(prompts(7), params)]
    assert all(len(t) == NEW_TOKENS for t in oracle)
    workers = [
        EngineWorker(WorkerConfig(wid, role, folder, CONFIG, transport="shm"))
        for wid, role in (("p0", "prefill"), ("d0", "decode"), ("d1", "decode"))
    ]
    prefill, first, second = workers
    try:
        assert first.engine.kv_cache_dtype == "float8_e4m3fn"
        for i, (prompt, expected) in enumerate(zip(prompts(7), oracle)):
            rid = f"{kind}-{i}"
            reservation = calls.reserve(first, rid, prompt, params)
            result = calls.prefill(prefill, rid, prompt, params, first.endpoint(), reservation)
            tokens = list(result.output.token_ids)
            calls.start_decode(first, rid, tokens[0])
            tokens = poll_until(first, rid, tokens, MIGRATE_AFTER)
            assert tokens == expected[: len(tokens)], "the handoff changed the tokens"
            calls.abort(first, rid)  # the first decode worker is gone for this request
            calls.submit(second, rid, prompt, params, resume=ResumeState(tuple(tokens), 0))
            assert poll_until(second, rid, tokens, None) == expected, "the migration changed the tokens"
        for worker in workers:
            stats = worker.stats()
            assert stats.num_running == 0 and stats.num_free_blocks == stats.num_blocks, (worker.worker_id, stats)
    finally:
        for worker in workers:
            worker.shutdown()
