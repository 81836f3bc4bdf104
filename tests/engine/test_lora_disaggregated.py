"""LoRA adapters across the handoff: prefill workers run the prompt under the request's adapter,
the KV reaches the decode worker through the transport (FP8 KV cache), a migration mid-stream
resumes under the same adapter on another decode worker, and a decode worker refuses KV computed
under another adapter. Oracle: the same engine in one process (tests/engine/test_lora.py checks
that one against transformers + peft)."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest

from common.protocol import ResumeState
from common.request import RequestContext
from common.sampling_params import SamplingParams
from testkit import workers as calls
from testkit.tensor_parallel import drain
from tests.engine.helpers import poll_until, save_lora_adapter, save_tiny_model
from workers.build import load_engine
from workers.config import EngineConfig
from workers.shell.worker import EngineWorker, WorkerConfig

pytestmark = pytest.mark.slow
pytest.importorskip("peft")

NEW_TOKENS, MIGRATE_AFTER = 14, 5
ADAPTERS = {"attn": (4, 8, ["q_proj", "k_proj", "v_proj"]), "mlp": (8, 16, ["gate_proj", "up_proj", "down_proj"])}
PROMPTS = [[(11 * i + 7 * j) % 500 + 3 for j in range(n)] for i, n in enumerate((21, 40))]


def test_remote_prefill_fp8_kv_and_a_migration_under_adapters_are_exact():
    folder, hf = save_tiny_model("llama", tie_word_embeddings=False)
    root = Path(tempfile.mkdtemp(prefix="baton-lora-pd-"))
    workers: list[EngineWorker] = []
    try:
        for seed, (name, (rank, alpha, targets)) in enumerate(ADAPTERS.items()):
            save_lora_adapter(hf, root / name, rank, alpha, targets, seed)
        config = EngineConfig(
            kv_cache_memory=16 << 20,
            kv_cache_dtype="fp8",
            max_num_batched_tokens=16,
            enable_lora=True,
            lora_modules="\n".join(f"{n}={root / n}" for n in ADAPTERS),
            max_loras=2,
        )
        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
        oracle_engine = load_engine(folder, config)
        jobs = [(adapter, prompt) for adapter in (*ADAPTERS, None) for prompt in PROMPTS]
        oracle = [
            drain(
                oracle_engine, [oracle_engine.add_request(prompt, params, context=RequestContext(f"o{i}", adapter=a))]
            )[0]
            for i, (a, prompt) in enumerate(jobs)
        ]
        # The adapters change the tokens, so a base-model prefill anywhere would show.
        assert len({tuple(t) for t in oracle}) == len(oracle)
        workers = [
            EngineWorker(WorkerConfig(wid, role, folder, config, transport="shm"))
            for wid, role in (("p0", "prefill"), ("d0", "decode"), ("d1", "decode"))
        ]
        prefill, first, second = workers
        assert first.engine.kv_cache_dtype == "float8_e4m3fn"
        for i, ((adapter, prompt), expected) in enumerate(zip(jobs, oracle)):
            rid = f"r{i}"
            reservation = calls.reserve(first, rid, prompt, params, adapter=adapter)
            result = calls.prefill(prefill, rid, prompt, params, first.endpoint(), reservation, adapter=adapter)
            assert result.kv_namespace == adapter
            tokens = list(result.output.token_ids)
            calls.start_decode(first, rid, tokens[0], result.kv_namespace)
            tokens = poll_until(first, rid, tokens, MIGRATE_AFTER)
            assert tokens == expected[: len(tokens)], "the handoff changed the tokens"
            calls.abort(first, rid)
            calls.submit(second, rid, prompt, params, resume=ResumeState(tuple(tokens), 0), adapter=adapter)
            assert poll_until(second, rid, tokens, None) == expected, "the migration changed the tokens"

        # KV computed under one adapter is refused by a decode worker whose request runs under another.
        reservation = calls.reserve(first, "wrong", PROMPTS[0], params, adapter="attn")
        result = calls.prefill(prefill, "wrong", PROMPTS[0], params, first.endpoint(), reservation, adapter="mlp")
        with pytest.raises(ValueError, match="KV computed under 'mlp', the request runs under 'attn'"):
            calls.start_decode(first, "wrong", result.output.token_ids[0], result.kv_namespace)
        calls.abort(first, "wrong")
        for worker in workers:
            stats = worker.stats()
            assert stats.num_running == 0 and stats.num_free_blocks == stats.num_blocks, (worker.worker_id, stats)
            assert stats.lora.max_loras == 2
    finally:
        for worker in workers:
            worker.shutdown()
        shutil.rmtree(root, ignore_errors=True)
