"""GPU decisions made from a described device, on the CPU: FP8 refused below compute capability 8.9
(before any kernel runs), and the KV cache sized from --gpu-memory-utilization (workers.engine.device)."""

from __future__ import annotations

import logging

import pytest
import torch

from kernels.plan import TARGETS, DeviceSpec, fp8_supported
from workers.config import CPU_KV_CACHE_MEMORY, EngineConfig
from workers.engine import kv_cache, loader
from workers.engine.device import check_fp8_config, gpu_kv_cache_blocks
from workers.models.config import ModelConfig

GIB = 1 << 30
A100 = DeviceSpec("cuda", (8, 0), 108, name="NVIDIA A100-SXM4-80GB")
A10 = DeviceSpec("cuda", (8, 6), 72, name="NVIDIA A10")
L4, H100, B200 = TARGETS["sm_89"], TARGETS["sm_90"], TARGETS["sm_100"]
CPU = DeviceSpec("cpu")
H100_MEMORY = 80 * GIB


def llama3_8b() -> ModelConfig:
    return ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling=None,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
        qkv_bias=False,
        o_bias=False,
        mlp_bias=False,
        eos_token_ids=(128001,),
        bos_token_id=128000,
    )


# ---------------------------------------------------------------------------- FP8 on the device


def test_the_sm80_target_is_refused_too():
    with pytest.raises(ValueError, match=r"NVIDIA A100 with compute capability 8\.0 \(sm_80\).*--kv-cache-dtype auto"):
        check_fp8_config(TARGETS["sm_80"], kv_cache_dtype="fp8")


@pytest.mark.parametrize(
    "options, alternative",
    [
        (dict(quantization="fp8"), "serve without --quantization fp8"),
        (dict(kv_cache_dtype="fp8"), "use --kv-cache-dtype auto"),
        (
            dict(quantization="fp8", kv_cache_dtype="fp8"),
            "serve without --quantization fp8 and use --kv-cache-dtype auto",
        ),
        (dict(fp8_checkpoint=True), "a bfloat16 or float16 checkpoint"),
    ],
)
def test_fp8_on_an_sm80_gpu_is_refused_naming_the_gpu_its_capability_and_the_alternative(options, alternative):
    with pytest.raises(ValueError) as caught:
        check_fp8_config(A100, **options)
    message = str(caught.value)
    assert "NVIDIA A100-SXM4-80GB with compute capability 8.0 (sm_80)" in message
    assert "8.9 or later" in message and alternative in message, message


@pytest.mark.parametrize("device", [L4, H100, B200])
def test_fp8_runs_on_gpus_with_native_fp8(device):
    assert fp8_supported(device) and device.capability >= (8, 9)
    check_fp8_config(device, quantization="fp8", kv_cache_dtype="fp8", fp8_checkpoint=True)


@pytest.mark.parametrize("device", [A100, A10, TARGETS["sm_80"], CPU])
def test_without_fp8_every_device_is_fine(device):
    check_fp8_config(device, quantization=None, kv_cache_dtype="auto")


def test_the_cpu_keeps_fp8_on_its_reference_kernels():
    check_fp8_config(CPU, quantization="fp8", kv_cache_dtype="fp8", fp8_checkpoint=True)


def test_load_model_refuses_fp8_on_a_described_sm80_before_building_anything(monkeypatch):
    """The worker's start-up path (load_model) checks the device before it resolves a kernel."""
    monkeypatch.setattr(DeviceSpec, "of", classmethod(lambda cls, device: A100))
    monkeypatch.setattr(loader, "kernel_ops", lambda *a, **k: pytest.fail("a kernel was resolved"))
    with pytest.raises(
        ValueError, match=r"--kv-cache-dtype fp8 needs a GPU with native FP8.*8\.0.*--kv-cache-dtype auto"
    ):
        loader.load_model(llama3_8b(), EngineConfig(kv_cache_dtype="fp8"), weights=None)


# ---------------------------------------------------------------------------- KV cache sizing


def test_an_8b_bf16_model_on_an_80gib_h100_gets_what_gpu_memory_utilization_leaves():
    config = llama3_8b()
    block_bytes = kv_cache.kv_block_bytes(config, 16, torch.bfloat16)
    assert block_bytes == 2 * 32 * 16 * 8 * 128 * 2 == 2 * 2**20  # 2 MiB per 16-token block
    weights = 8_030_261_248 * 2  # Llama-3-8B's parameters in bf16
    activations = 2 * GIB
    blocks = gpu_kv_cache_blocks(H100_MEMORY, 0.9, weights, activations, block_bytes)
    assert blocks == (int(80 * GIB * 0.9) - weights - activations) // block_bytes
    # 72 GiB less 14.96 GiB of weights and 2 GiB of activations: 55.04 GiB, ~451k tokens of KV.
    assert blocks == 28_181 and blocks * 16 == 450_896
    # Less utilization, fewer blocks; more activations, fewer blocks.
    assert gpu_kv_cache_blocks(H100_MEMORY, 0.5, weights, activations, block_bytes) < blocks
    assert gpu_kv_cache_blocks(H100_MEMORY, 0.9, weights, 4 * GIB, block_bytes) == blocks - 1024


def test_nothing_left_for_the_kv_cache_is_a_clear_error():
    # A 70B bf16 model does not fit one 80 GiB GPU.
    with pytest.raises(
        ValueError,
        match=r"no GPU memory left for the KV cache.*--gpu-memory-utilization 0.9 of 80.00 GiB"
        r".*weights take 130\.39 GiB.*--kv-cache-memory",
    ):
        gpu_kv_cache_blocks(H100_MEMORY, 0.9, 70_000_000_000 * 2, GIB, 2 << 20)
    with pytest.raises(ValueError, match="gpu_memory_utilization must be in"):
        gpu_kv_cache_blocks(H100_MEMORY, 1.5, 0, 0, 2 << 20)


def test_gpu_memory_utilization_is_checked_by_the_config():
    assert EngineConfig().gpu_memory_utilization == 0.9 and EngineConfig().kv_cache_memory is None
    for bad in (0, 1.2, -0.5, True):
        with pytest.raises(ValueError, match="gpu_memory_utilization"):
            EngineConfig(gpu_memory_utilization=bad)


def test_the_cpu_keeps_its_1gib_default():
    config = llama3_8b()
    block_bytes = kv_cache.kv_block_bytes(config, 16, torch.float32)
    assert kv_cache.num_kv_blocks(config, EngineConfig()) == CPU_KV_CACHE_MEMORY // block_bytes
    assert not kv_cache.sizes_kv_cache_from_gpu_memory(EngineConfig())
    assert not kv_cache.sizes_kv_cache_from_gpu_memory(EngineConfig(device="cuda", kv_cache_memory=GIB))
    assert not kv_cache.sizes_kv_cache_from_gpu_memory(EngineConfig(device="cuda", num_kv_blocks=8))
    assert kv_cache.sizes_kv_cache_from_gpu_memory(EngineConfig(device="cuda"))


def test_a_gpu_worker_sizes_its_cache_and_logs_blocks_and_tokens(monkeypatch, caplog):
    """kv_cache_num_blocks on a described H100: the profiled peak and the device come from stand-ins."""
    config = llama3_8b()
    model = torch.nn.Linear(1024, 1024, bias=False)  # 4 MiB of "weights"
    monkeypatch.setattr(
        DeviceSpec, "of", classmethod(lambda cls, device: DeviceSpec("cuda", (9, 0), 132, name="NVIDIA H100 80GB HBM3"))
    )
    monkeypatch.setattr(kv_cache, "gpu_total_memory", lambda device: H100_MEMORY)
    monkeypatch.setattr(kv_cache, "profile_activation_peak", lambda *a: 3 * GIB)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (79 * GIB, 80 * GIB))
    engine = EngineConfig(device="cuda", dtype="bfloat16", gpu_memory_utilization=0.5)
    with caplog.at_level(logging.INFO, logger="workers.engine.kv_cache"):
        blocks = kv_cache.kv_cache_num_blocks(model, config, engine)
    assert blocks == (40 * GIB - 4 * 2**20 - 3 * GIB) // (2 * 2**20)
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("KV cache:"))
    assert f"{blocks} blocks of 16 tokens = {blocks * 16} tokens" in line and "NVIDIA H100 80GB HBM3" in line, line
