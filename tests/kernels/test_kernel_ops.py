"""Dispatch in kernels.ops: references on CPU by default, Triton when forced, a clear error for a bad setting."""

import pytest
import torch

from kernels import ops
from kernels.fp8_quant import scaled_fp8_quant_reference
from kernels.rms_norm import rms_norm_reference
from kernel_testlib import DEVICE, randn


def test_backend_selection(monkeypatch):
    cpu = torch.zeros(1)
    monkeypatch.delenv("BATON_KERNELS", raising=False)
    assert ops.backend_for(cpu) == "native"
    monkeypatch.setenv("BATON_KERNELS", "auto")
    assert ops.backend_for(cpu) == "native"
    assert ops.backend_for(torch.zeros(1, device=DEVICE)) == ("triton" if DEVICE.type == "cuda" else "native")
    monkeypatch.setenv("BATON_KERNELS", "triton")
    assert ops.backend_for(torch.zeros(1, device=DEVICE)) == "triton"
    monkeypatch.setenv("BATON_KERNELS", "Reference")
    assert ops.backend_for(cpu) == "reference"
    monkeypatch.setenv("BATON_KERNELS", "cuda")
    with pytest.raises(ValueError, match="BATON_KERNELS"):
        ops.backend_for(cpu)


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.setenv("BATON_KERNELS", "triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        ops.silu_and_mul(torch.zeros(2, 4))


def test_empty_inputs_launch_nothing(monkeypatch):
    from kernels._triton_compat import LazyJIT

    def no_launch(self, grid):
        raise AssertionError(f"{self.fn.__name__} launched on an empty input")

    monkeypatch.setattr(LazyJIT, "__getitem__", no_launch)
    i32 = dict(dtype=torch.int32, device=DEVICE)
    k, v = randn(2, 4, 1, 64), randn(2, 4, 1, 64, seed=1)
    assert ops.rms_norm(randn(0, 64), randn(64), 1e-6).shape == (0, 64)
    assert ops.silu_and_mul(randn(0, 64)).shape == (0, 32)
    ops.rotary_embedding(torch.zeros(0, dtype=torch.int64, device=DEVICE), randn(0, 2, 64), randn(0, 1, 64),
                         randn(8, 64))
    ops.store_kv(randn(0, 1, 64), randn(0, 1, 64), k, v, torch.zeros(0, dtype=torch.int64, device=DEVICE))
    assert ops.paged_decode_attention(randn(0, 2, 64), k, v, torch.zeros(0, 1, **i32), torch.zeros(0, **i32),
                                      0.1).shape == (0, 2, 64)
    assert ops.paged_prefill_attention(randn(0, 2, 64), k, v, torch.zeros(0, 1, **i32), torch.zeros(1, **i32),
                                       torch.zeros(0, **i32), 0.1).shape == (0, 2, 64)
    q, s = ops.scaled_fp8_quant(randn(0, 64), per_token=True)
    assert q.shape == (0, 64)
    b, sb = scaled_fp8_quant_reference(randn(8, 64))  # not empty: quantized without Triton
    assert ops.fp8_gemm(q, b, s, sb, torch.float32).shape == (0, 8)
    cache = randn(1, 2, 2, 4, 1, 64)
    assert ops.pack_kv_blocks(cache, torch.zeros(0, dtype=torch.int64, device=DEVICE)).shape == (1, 2, 0, 4, 1, 64)


def test_reference_path_does_not_launch_triton(monkeypatch):
    import kernels.rms_norm as mod

    def boom(*a, **k):
        raise AssertionError("Triton path taken")

    monkeypatch.setattr(mod, "rms_norm_triton", boom)
    monkeypatch.setenv("BATON_KERNELS", "reference")
    x, w = randn(2, 16), randn(16, seed=1)
    assert torch.equal(ops.rms_norm(x, w, 1e-6), rms_norm_reference(x, w, 1e-6))
    monkeypatch.setenv("BATON_KERNELS", "triton")
    with pytest.raises(AssertionError, match="Triton path"):
        ops.rms_norm(x, w, 1e-6)


def test_non_tensor_input_is_a_value_error(monkeypatch):
    for mode in ("reference", "triton", "auto"):
        monkeypatch.setenv("BATON_KERNELS", mode)
        with pytest.raises(ValueError, match="torch.Tensor"):
            ops.silu_and_mul([1.0])
