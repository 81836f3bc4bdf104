"""kernels.ops.kernel_ops: the backend is resolved once into functions; a clear error for a bad setting."""

import pytest
import torch
from kernel_testlib import DEVICE, ops, randn

from kernels import decode_attention, rms_norm, silu_mul
from kernels._triton_compat import LazyJIT
from kernels.fp8_quant import scaled_fp8_quant_reference
from kernels.ops import BACKENDS, kernel_ops, resolve_backend
from kernels.rms_norm import rms_norm_reference


def test_backend_selection():
    assert resolve_backend("auto", "cpu") == resolve_backend("native", "cpu") == "native"
    assert resolve_backend("auto", DEVICE) == ("triton" if DEVICE.type == "cuda" else "native")
    assert resolve_backend("triton", DEVICE) == "triton"  # on the CPU: TRITON_INTERPRET=1 (conftest.py)
    assert resolve_backend("reference", DEVICE) == "reference"
    with pytest.raises(ValueError, match="kernel_backend must be one of"):
        resolve_backend("cuda", "cpu")
    with pytest.raises(ValueError, match="CPU only"):
        resolve_backend("native", "cuda")
    assert [kernel_ops(b, "cpu").backend for b in ("auto", "native", "reference")] == ["native", "native", "reference"]
    assert BACKENDS == ("auto", "triton", "native", "reference")


def test_resolved_functions():
    """Triton and reference are the kernel modules' functions themselves; native ops pick per call."""
    assert ops.rms_norm is rms_norm.rms_norm_triton
    assert kernel_ops("reference").paged_decode_attention is decode_attention.paged_decode_attention_reference
    native = kernel_ops("auto", "cpu")
    assert native.fp8_gemm is kernel_ops("reference").fp8_gemm  # no native kernel: the reference
    if silu_mul.native_built():
        x = randn(3, 8).cpu()
        assert torch.equal(native.silu_and_mul(x), silu_mul.silu_and_mul_cpu(x))


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        kernel_ops("triton", "cpu")


def test_empty_inputs_launch_nothing(monkeypatch):
    def no_launch(self, grid):
        raise AssertionError(f"{self.fn.__name__} launched on an empty input")

    monkeypatch.setattr(LazyJIT, "__getitem__", no_launch)
    i32 = dict(dtype=torch.int32, device=DEVICE)
    k, v = randn(2, 4, 1, 64), randn(2, 4, 1, 64, seed=1)
    assert ops.rms_norm(randn(0, 64), randn(64), 1e-6).shape == (0, 64)
    assert ops.silu_and_mul(randn(0, 64)).shape == (0, 32)
    ops.rotary_embedding(
        torch.zeros(0, dtype=torch.int64, device=DEVICE), randn(0, 2, 64), randn(0, 1, 64), randn(8, 64)
    )
    ops.store_kv(randn(0, 1, 64), randn(0, 1, 64), k, v, torch.zeros(0, dtype=torch.int64, device=DEVICE))
    assert ops.paged_decode_attention(
        randn(0, 2, 64), k, v, torch.zeros(0, 1, **i32), torch.zeros(0, **i32), 0.1
    ).shape == (0, 2, 64)
    assert ops.paged_prefill_attention(
        randn(0, 2, 64), k, v, torch.zeros(0, 1, **i32), torch.zeros(1, **i32), torch.zeros(0, **i32), 0.1
    ).shape == (0, 2, 64)
    q, s = ops.scaled_fp8_quant(randn(0, 64), per_token=True)
    assert q.shape == (0, 64)
    b, sb = scaled_fp8_quant_reference(randn(8, 64))  # not empty: quantized without Triton
    assert ops.fp8_gemm(q, b, s, sb, torch.float32).shape == (0, 8)
    cache = randn(1, 2, 2, 4, 1, 64)
    assert ops.pack_kv_blocks(cache, torch.zeros(0, dtype=torch.int64, device=DEVICE)).shape == (1, 2, 0, 4, 1, 64)


def test_reference_path_does_not_launch_triton(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("Triton path taken")

    monkeypatch.setattr(rms_norm, "rms_norm_triton", boom)
    x, w = randn(2, 16), randn(16, seed=1)
    assert torch.equal(kernel_ops("reference", DEVICE).rms_norm(x, w, 1e-6), rms_norm_reference(x, w, 1e-6))
    with pytest.raises(AssertionError, match="Triton path"):
        kernel_ops("triton", DEVICE).rms_norm(x, w, 1e-6)


def test_non_tensor_input_is_a_value_error():
    for backend in ("reference", "triton", "auto"):
        with pytest.raises(ValueError, match="torch.Tensor"):
            kernel_ops(backend, DEVICE).silu_and_mul([1.0])
