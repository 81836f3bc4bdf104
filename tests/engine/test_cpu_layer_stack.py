"""Steps through the one-call native decoder layers (workers/engine/cpu_layer_stack.py): which models take
them, and that they give the model's own layer-by-layer forward pass bit for bit.

The oracle is the same engine with --enforce-eager (every step through the model's forward pass,
which tests/engine checks against transformers): with float32 prompt projections every step's
logits must be equal, not close, since the same kernels run in the same order on the same inputs.
With the default bf16x3 prompt projections (on AMX) they must be close, and the tokens the same.
"""

from __future__ import annotations

import random

import pytest
import torch

from common.sampling_params import SamplingParams
from kernels import amx_linear
from kernels.layer_stack import entry_points
from tests.engine.helpers import run_with_logits, save_tiny_model
from workers.build import build_engine
from workers.config import EngineConfig
from workers.engine.cpu_layer_stack import unsupported_reason
from workers.engine.llm_engine import LLMEngine
from workers.models.checkpoint import iter_safetensors
from workers.models.config import ModelConfig

if entry_points() is None:
    pytest.skip("the native CPU kernels do not build here", allow_module_level=True)

# Head dim 16 (the native prefill attention has no kernel for it: only decode-only steps take the
# one call), head dim 64 (every step does), and a sliding window on every layer.
MODELS = {
    "llama, head dim 16": ("llama", {}),
    "llama, head dim 64": ("llama", {"hidden_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1}),
    "mistral, window 24": ("mistral", {"sliding_window": 24}),
}


def engine(folder: str, **config) -> LLMEngine:
    # A 32-token budget splits the longer prompts into chunks that share steps with decode rows.
    return build_engine(
        ModelConfig.from_model_dir(folder),
        EngineConfig(num_kv_blocks=96, max_num_seqs=8, max_num_batched_tokens=32, **config),
        iter_safetensors(folder),
    )


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("threads", [1, 2])
def test_every_step_gives_the_layer_by_layer_logits(model, threads):
    kind, overrides = MODELS[model]
    folder, _ = save_tiny_model(kind, tie_word_embeddings=False, **overrides)
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randint(2, 70))] for _ in range(7)]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        one_call = engine(folder, float32_prompt_matmul="ieee")
        stack = one_call.runner.layer_stack
        assert stack is not None and stack.takes_prefill == ("64" in model)
        calls = []  # (tokens, decode rows) of each step the one call ran
        run = stack.run
        stack.run = lambda hidden, batch, n: (
            calls.append((hidden.shape[0], batch.decode_block_tables.shape[0])) or run(hidden, batch, n)
        )
        done, logits = run_with_logits(one_call, prompts, params)
        eager_done, eager_logits = run_with_logits(engine(folder, enforce_eager=True), prompts, params)
    finally:
        torch.set_num_threads(before)
    assert max(rows for _, rows in calls) == len(prompts)
    mixed = [c for c in calls if 0 < c[1] < c[0]]  # decode rows beside a prefill chunk
    assert bool(mixed) == stack.takes_prefill
    assert [d.token_ids for d in done] == [d.token_ids for d in eager_done]
    for got, want in zip(logits, eager_logits):
        assert len(got) == len(want) == params.max_tokens
        assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.skipif(not amx_linear.ready(), reason="no AMX-BF16 here")
def test_bf16x3_prompt_projections_stay_close_to_the_float32_pass():
    kind, overrides = MODELS["llama, head dim 64"]
    folder, _ = save_tiny_model(kind, tie_word_embeddings=False, **overrides)
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randint(2, 70))] for _ in range(7)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    tiled = engine(folder)
    assert tiled.runner.layer_stack.tiled
    done, logits = run_with_logits(tiled, prompts, params)
    eager_done, eager_logits = run_with_logits(engine(folder, enforce_eager=True), prompts, params)
    assert [d.token_ids for d in done] == [d.token_ids for d in eager_done]
    pairs = [(a, b) for got, want in zip(logits, eager_logits) for a, b in zip(got, want)]
    assert not all(torch.equal(a, b) for a, b in pairs)  # the prompts did run on the tiles
    for a, b in pairs:
        torch.testing.assert_close(a, b, atol=1e-3 * float(b.abs().mean()), rtol=0)
    assert engine(folder, float32_prompt_matmul="ieee").runner.layer_stack.tiled is False


def test_which_models_take_the_one_call():
    llama, _ = save_tiny_model("llama", tie_word_embeddings=False)
    assert engine(llama, enforce_eager=True).runner.layer_stack is None
    for config, reason in (
        ({"dtype": "bfloat16"}, "not float32"),
        ({"kv_cache_dtype": "fp8"}, "not float32"),
        ({"packed_linear": False}, "not packed"),
        ({"kernel_backend": "reference"}, "native"),
    ):
        runner = engine(llama, **config).runner
        assert runner.layer_stack is None and reason in unsupported_reason(runner.model, runner.kv_cache, None)
    for kind, reason in (("qwen3", "q/k norms"), ("qwen2", "bias"), ("gemma2", "not a plain Llama")):
        folder, _ = save_tiny_model(kind)
        runner = engine(folder).runner
        assert runner.layer_stack is None and reason in unsupported_reason(runner.model, runner.kv_cache, None), kind
