"""RMSNorm (plain and fused residual add) and SiLU-and-mul: Triton against reference, reference against an oracle."""

import pytest
import torch
from kernel_testlib import assert_close, ops, randn

from kernels.rms_norm import rms_norm_reference, rms_norm_triton
from kernels.silu_mul import silu_and_mul_reference, silu_and_mul_triton

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def hf_llama_rms_norm(x, weight, eps):
    # Written out from HF LlamaRMSNorm (in float32, where its final cast order does not matter).
    var = x.float().pow(2).mean(-1, keepdim=True)
    return weight.float() * (x.float() * torch.rsqrt(var + eps))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,H", [(1, 64), (5, 96), (3, 1000)])
def test_rms_norm_matches_reference(dtype, T, H):
    x = randn(T, H, dtype=dtype)
    w = randn(H, dtype=dtype, seed=1)
    assert_close(rms_norm_triton(x, w, 1e-6), rms_norm_reference(x, w, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_residual_matches_reference(dtype):
    x, r, w = randn(4, 80, dtype=dtype), randn(4, 80, dtype=dtype, seed=1), randn(80, dtype=dtype, seed=2)
    out, s = rms_norm_triton(x, w, 1e-5, residual=r)
    out_ref, s_ref = rms_norm_reference(x, w, 1e-5, residual=r)
    assert_close(s, s_ref)
    assert_close(out, out_ref)
    assert out.dtype == s.dtype == dtype


def test_rms_norm_non_contiguous_rows_and_empty():
    big = randn(6, 128)
    x = big[::2, :64]  # row stride 256, unit last stride
    w = randn(64, seed=1)
    assert_close(rms_norm_triton(x, w, 1e-6), rms_norm_reference(x, w, 1e-6))
    empty = randn(0, 64)
    assert rms_norm_triton(empty, w, 1e-6).shape == (0, 64)
    out, s = ops.rms_norm(empty, w, 1e-6, residual=empty)
    assert out.shape == s.shape == (0, 64)


def test_rms_norm_reference_matches_hf_formula():
    x, w = randn(7, 48), randn(48, seed=1)
    assert_close(rms_norm_reference(x, w, 1e-6), hf_llama_rms_norm(x, w, 1e-6))
    out, s = rms_norm_reference(x, w, 1e-6, residual=x)
    assert_close(s, 2 * x)
    assert_close(out, hf_llama_rms_norm(2 * x, w, 1e-6))


def test_rms_norm_rejects_bad_input():
    x = randn(3, 8)
    with pytest.raises(ValueError, match="weight"):
        ops.rms_norm(x, randn(7), 1e-6)
    with pytest.raises(ValueError, match="residual"):
        ops.rms_norm(x, randn(8), 1e-6, residual=randn(3, 8, dtype=torch.float16))
    with pytest.raises(ValueError, match="last dim"):
        rms_norm_triton(randn(8, 3).t(), randn(8), 1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,inter", [(1, 16), (5, 1100)])
def test_silu_and_mul_matches_reference(dtype, T, inter):
    x = randn(T, 2 * inter, dtype=dtype, scale=3.0)
    assert_close(silu_and_mul_triton(x), silu_and_mul_reference(x))


def test_silu_and_mul_reference_oracle_noncontig_and_empty():
    x = randn(4, 2 * 24)
    expected = torch.nn.functional.silu(x[:, :24]) * x[:, 24:]
    assert_close(silu_and_mul_reference(x), expected)
    view = randn(4, 100)[:, :48]
    assert_close(ops.silu_and_mul(view), silu_and_mul_reference(view))
    assert ops.silu_and_mul(randn(0, 48)).shape == (0, 24)
    with pytest.raises(ValueError, match="even"):
        ops.silu_and_mul(randn(2, 5))
