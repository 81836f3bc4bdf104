"""End to end on CUDA: the engine on the Triton kernels gives the CPU reference path's greedy tokens.

A small random Llama (hidden 256, 4 layers, 4 query heads over 2 KV heads, head_dim 64) is written
as a Hugging Face folder (config.json + safetensors; no transformers needed on the GPU image). The
same prompts run through LLMEngine twice: EngineConfig(device="cuda", dtype="float32") with
kernel_backend="auto" (Triton kernels, compiled), and on CPU with kernel_backend="reference". Rule
(tests/engine/helpers.compare_greedy, the CPU reference as oracle): tokens equal until a divergence
allowed only at a near tie, logits within TF32_LOGIT_TOL before it; at most one prompt may diverge.
On CUDA a float32 model's attention dots run in TF32 (kernels/plan.py's accuracy contract), so the
logits are held to 1e-2 here, not the 1e-3 of float32 against float32 (an H200 measured 2.3e-3).

The token budget forces chunked prefill and steps mixing decodes with a prefill chunk; a second
batch shares a prefix with the first, so the prefill kernel reads cached KV blocks.
Skipped without CUDA; run by tests/gpu/run.sh.
"""

from __future__ import annotations

import json
import random

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

VOCAB = 512
ARCH = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)
NEW_TOKENS = 16
TF32_LOGIT_TOL = 1e-2


def write_random_llama(
    folder, shape: dict | None = None, dtype: torch.dtype = torch.float32, device: str = "cpu", embed_std: float = 0.05
) -> None:
    """A random LlamaForCausalLM checkpoint with Hugging Face tensor names: `shape` (ARCH and VOCAB
    by default) as config.json keys, the weights drawn on `device` and saved in `dtype`."""
    from safetensors.torch import save_file

    shape = shape or dict(ARCH, vocab_size=VOCAB)
    h, inter, layers = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    hd = h // shape["num_attention_heads"]
    q, kv = shape["num_attention_heads"] * hd, shape["num_key_value_heads"] * hd
    g = torch.Generator(device=device).manual_seed(4321)

    def rnd(*dims, std=0.02):
        return (torch.randn(*dims, device=device, generator=g) * std).to(dtype).cpu().contiguous()

    tensors = {
        "model.embed_tokens.weight": rnd(shape["vocab_size"], h, std=embed_std),
        "model.norm.weight": 1 + rnd(h, std=0.1),
        "lm_head.weight": rnd(shape["vocab_size"], h, std=0.05),
    }
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors |= {
            p + "self_attn.q_proj.weight": rnd(q, h),
            p + "self_attn.k_proj.weight": rnd(kv, h),
            p + "self_attn.v_proj.weight": rnd(kv, h),
            p + "self_attn.o_proj.weight": rnd(h, q),
            p + "mlp.gate_proj.weight": rnd(inter, h),
            p + "mlp.up_proj.weight": rnd(inter, h),
            p + "mlp.down_proj.weight": rnd(h, inter),
            p + "input_layernorm.weight": 1 + rnd(h, std=0.1),
            p + "post_attention_layernorm.weight": 1 + rnd(h, std=0.1),
        }
    save_file(tensors, str(folder / "model.safetensors"))
    config = dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        hidden_act="silu",
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        torch_dtype=str(dtype).removeprefix("torch."),
        **shape,
    )
    (folder / "config.json").write_text(json.dumps(config))


def run(folder, monkeypatch, device: str, batches):
    from common.sampling_params import SamplingParams
    from tests.engine.helpers import run_with_logits
    from workers.build import build_engine
    from workers.config import EngineConfig
    from workers.models.checkpoint import iter_safetensors
    from workers.models.config import ModelConfig

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    # auto: Triton on CUDA; the oracle runs the PyTorch references on the CPU.
    config = EngineConfig(
        device=device,
        kernel_backend="auto" if device == "cuda" else "reference",
        dtype="float32",
        block_size=16,
        num_kv_blocks=128,
        max_num_batched_tokens=64,
    )
    engine = build_engine(ModelConfig.from_model_dir(folder), config, iter_safetensors(folder))
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    done, logits = [], []
    for prompts in batches:
        d, lg = run_with_logits(engine, prompts, params)
        done += d
        logits += [[row.float().cpu() for row in rows] for rows in lg]
    return done, logits


def test_engine_on_cuda_triton_matches_cpu_reference(tmp_path, monkeypatch):
    from tests.engine.helpers import Reference, compare_greedy

    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)  # float32 means IEEE float32 here
    write_random_llama(tmp_path)
    rng = random.Random(3)
    first = [rng.randrange(3, VOCAB) for _ in range(150)]
    batches = [
        [first],  # 150 tokens in chunks of 64: chunked prefill reading its own earlier chunks
        [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (1, 17, 33)]  # decodes beside B's chunks
        + [first[:96] + [rng.randrange(3, VOCAB) for _ in range(70)]],  # B: 96 cached tokens (6 blocks)
    ]

    calls = {"decode": 0, "prefill": 0}
    from kernels import decode_attention, prefill_attention

    def counting(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(
        decode_attention,
        "paged_decode_attention_triton",
        counting("decode", decode_attention.paged_decode_attention_triton),
    )
    monkeypatch.setattr(
        prefill_attention,
        "paged_prefill_attention_triton",
        counting("prefill", prefill_attention.paged_prefill_attention_triton),
    )

    ref_done, ref_logits = run(tmp_path, monkeypatch, "cpu", batches)
    assert calls == {"decode": 0, "prefill": 0}
    gpu_done, gpu_logits = run(tmp_path, monkeypatch, "cuda", batches)
    assert calls["decode"] > 0 and calls["prefill"] > 0, calls

    assert gpu_done[-1].num_cached_tokens == ref_done[-1].num_cached_tokens == 96
    diverged = []
    for i, (g, r, gl, rl) in enumerate(zip(gpu_done, ref_done, gpu_logits, ref_logits)):
        assert len(g.token_ids) == len(r.token_ids) == NEW_TOKENS
        cmp = compare_greedy(g.token_ids, Reference(r.token_ids, rl), gl, TF32_LOGIT_TOL, TF32_LOGIT_TOL)
        print(f"prompt {i}: diverged_at={cmp.diverged_at} max_logit_error={cmp.max_logit_error:.2e}")
        if cmp.diverged_at is not None:
            diverged.append(i)
    assert len(diverged) <= 1, diverged
