"""FP8 weights (load-time and pre-quantized checkpoints), FP8 KV cache and the scoring API, on tiny models.

Oracles are independent of workers.quantization: torch's own float8 cast, weights quantized and
dequantized by hand in tests/fp8/helpers.py, and transformers running those dequantized weights
in float32 (an FP8 model on the CPU is exactly its dequantized weights, so logits must agree to
float32 rounding).
"""

from __future__ import annotations

import pytest
import torch

from tests.engine.helpers import save_tiny_model
from tests.fp8.helpers import hf_logprobs, is_linear_weight, write_fp8_checkpoint
from workers.build import load_engine
from workers.config import EngineConfig
from workers.engine.kv_calibration import round_scale_up
from workers.quantization.fp8 import (
    Fp8Linear,
    fp8_to_float,
    parse_quantization_config,
    quantize_per_channel,
    weight_memory,
)

TOKENS = [(7 * i + 3) % 500 + 5 for i in range(150)]


@pytest.fixture(scope="module")
def tiny_qwen2():
    # Qwen2: q/k/v biases, untied lm_head; hidden 64 and intermediate 160 give ragged 32x48 blocks.
    return save_tiny_model("qwen2")


def test_fp8_to_float_is_exact_for_every_code():
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
    want = codes.float()
    finite = ~want.isnan()
    got = fp8_to_float(codes) * 256
    assert torch.equal(got[finite], want[finite])


def test_per_channel_quantization_uses_row_amax():
    w = torch.randn(8, 32) * torch.logspace(-3, 2, 8)[:, None]
    q, scale = quantize_per_channel(w)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (8, 1)
    torch.testing.assert_close(scale, w.abs().amax(1, keepdim=True) / 448)
    # e4m3 keeps 3 mantissa bits: relative error of a rounded normal value is at most 2^-4.
    err = (q.float() * scale - w).abs() / w.abs().amax(1, keepdim=True)
    assert float(err.max()) <= 2**-4 + 1e-6


def _hf_with(model, dequantized: dict[str, torch.Tensor]):
    state = model.state_dict()
    state.update({k: v for k, v in dequantized.items()})
    clone = type(model)(model.config).eval()
    clone.load_state_dict(state)
    return clone


def test_load_time_fp8_equals_hand_quantized_weights(tiny_qwen2):
    folder, hf = tiny_qwen2
    engine = load_engine(folder, EngineConfig(num_kv_blocks=32, quantization="fp8"))
    layers = [m for m in engine.runner.model.modules() if isinstance(m, Fp8Linear)]
    assert len(layers) == 4 * hf.config.num_hidden_layers  # qkv, o, gate_up, down per layer
    assert not any(isinstance(m, torch.nn.Linear) for m in engine.runner.model.modules())
    # Hand quantization per projection (per output row), then the same fusion order.
    hand = {}
    for name, w in hf.state_dict().items():
        if is_linear_weight(name):
            s = w.abs().amax(1, keepdim=True) / 448
            hand[name] = (w / s).to(torch.float8_e4m3fn).float() * s
    layer0 = engine.runner.model.layers[0]
    want_qkv = torch.cat([hand[f"model.layers.0.self_attn.{p}.weight"] for p in ("q_proj", "k_proj", "v_proj")])
    torch.testing.assert_close(layer0.self_attn.qkv_proj.dequantized_weight(), want_qkv, rtol=1e-6, atol=0)
    want_down = hand["model.layers.0.mlp.down_proj.weight"]
    torch.testing.assert_close(layer0.mlp.down_proj.dequantized_weight(), want_down, rtol=1e-6, atol=0)
    # End to end: the FP8 engine scores like transformers running the hand-dequantized weights,
    # and measurably unlike the float weights (so the comparison could fail).
    ours = engine.score(TOKENS)
    torch.testing.assert_close(ours, hf_logprobs(_hf_with(hf, hand), TOKENS), atol=2e-4, rtol=0)
    assert float((ours - hf_logprobs(hf, TOKENS)).abs().max()) > 1e-3


@pytest.mark.parametrize("fmt", ["fp8-block", "ct-channel", "ct-tensor"])
def test_prequantized_checkpoint_loads_its_dequantized_weights(tiny_qwen2, fmt, tmp_path):
    folder, hf = tiny_qwen2
    dst = str(tmp_path)
    dequantized = write_fp8_checkpoint(folder, dst, fmt)
    engine = load_engine(dst, EngineConfig(num_kv_blocks=32))
    model = engine.runner.model
    groups = 2 if fmt == "fp8-block" else 1  # 64 input columns in 48-wide blocks
    assert model.layers[1].self_attn.qkv_proj.weight_scale.shape == (64 + 2 * 32, groups)
    want_gate_up = torch.cat([dequantized[f"model.layers.1.mlp.{p}.weight"] for p in ("gate_proj", "up_proj")])
    torch.testing.assert_close(model.layers[1].mlp.gate_up_proj.dequantized_weight(), want_gate_up, rtol=1e-6, atol=0)
    torch.testing.assert_close(engine.score(TOKENS), hf_logprobs(_hf_with(hf, dequantized), TOKENS), atol=2e-4, rtol=0)
    mem = weight_memory(model)
    assert mem.linear_params == sum(w.numel() for n, w in hf.state_dict().items() if is_linear_weight(n))


def test_quantization_config_errors_name_what_is_supported(tiny_qwen2, tmp_path):
    with pytest.raises(ValueError, match="'gptq' is not supported; supported: fp8, compressed-tensors"):
        parse_quantization_config({"quant_method": "gptq", "bits": 4})
    with pytest.raises(ValueError, match="only float-quantized"):
        parse_quantization_config({"quant_method": "compressed-tensors", "format": "pack-quantized"})
    with pytest.raises(ValueError, match="quantization must be null or .fp8."):
        EngineConfig(quantization="int8")
    # FP8 tensors without a quantization_config must not load as raw codes.
    folder, _ = tiny_qwen2
    dst = str(tmp_path)
    write_fp8_checkpoint(folder, dst, "ct-channel")
    import json
    from pathlib import Path

    config = json.loads((Path(dst) / "config.json").read_text())
    del config["quantization_config"]
    (Path(dst) / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="quantization_config"):
        load_engine(dst, EngineConfig(num_kv_blocks=8))


def test_score_matches_transformers_across_chunks_and_frees_blocks(tiny_qwen2):
    folder, hf = tiny_qwen2
    engine = load_engine(folder, EngineConfig(num_kv_blocks=32, block_size=16))
    free = engine.block_manager.num_free_blocks
    # 37-token chunks straddle block boundaries; later chunks read earlier K/V from the cache.
    ours = engine.score(TOKENS, chunk_size=37)
    assert ours.shape == (len(TOKENS) - 1,)
    torch.testing.assert_close(ours, hf_logprobs(hf, TOKENS), atol=1e-4, rtol=0)
    assert engine.block_manager.num_free_blocks == free
    with pytest.raises(ValueError, match="at least 2 tokens"):
        engine.score([5])


def test_fp8_kv_cache_scales_capacity_and_accuracy(tiny_qwen2):
    folder, hf = tiny_qwen2
    memory = 1 << 20
    ref = load_engine(folder, EngineConfig(kv_cache_memory=memory, dtype="bfloat16"))
    a = load_engine(folder, EngineConfig(kv_cache_memory=memory, kv_cache_dtype="fp8"))
    threads = torch.get_num_threads()
    torch.set_num_threads(3 if threads != 3 else 2)  # calibration must not depend on the thread count
    try:
        b = load_engine(folder, EngineConfig(kv_cache_memory=memory, kv_cache_dtype="fp8"))
    finally:
        torch.set_num_threads(threads)
    assert a.runner.kv_cache.dtype == torch.float8_e4m3fn
    assert a.runner.kv_scales == b.runner.kv_scales  # deterministic: equal configs pair
    assert all(k != 1.0 and v != 1.0 for k, v in a.runner.kv_scales)
    # Same bytes, twice the tokens of bfloat16 (four times float32).
    assert a.runner.num_blocks == 2 * ref.runner.num_blocks
    assert a.runner.kv_cache.numel() * a.runner.kv_cache.element_size() <= memory
    # Calibrated scales cover the calibration K/V: rounding is upward and near amax / 448.
    assert round_scale_up(0.1) >= 0.1 and round_scale_up(0.1) < 0.1 * (1 + 1 / 8)
    ours = a.score(TOKENS, chunk_size=50)
    want = hf_logprobs(hf, TOKENS)
    err = float((ours - want).abs().max())
    assert 1e-5 < err < 0.05, err  # quantized (not bit-equal to float) but close
    # Given scales win over calibration.
    given = tuple((0.5, 0.25) for _ in range(hf.config.num_hidden_layers))
    c = load_engine(folder, EngineConfig(num_kv_blocks=8, kv_cache_dtype="fp8", kv_scales=given))
    assert c.runner.kv_scales == given and c.runner.k_scales == [0.5, 0.5]
    with pytest.raises(ValueError, match="kv_scales has 1"):
        load_engine(folder, EngineConfig(num_kv_blocks=8, kv_cache_dtype="fp8", kv_scales=((1.0, 1.0),)))
