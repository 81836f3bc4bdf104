"""FP8 quantization (dynamic/static, per-tensor/per-token) and the W8A8 FP8 GEMM."""

import pytest
import torch
from kernel_testlib import DEVICE, FP8, TOL, assert_close, dot_tol, ops, randn

from kernels.fp8_gemm import fp8_gemm_reference
from kernels.fp8_quant import scaled_fp8_quant_reference, scaled_fp8_quant_triton


def test_quant_rounds_like_torch_on_every_fp8_value_and_between():
    # Every finite e4m3 value, the midpoints between neighbours (ties to even), and beyond +-448.
    grid = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    grid = grid[~grid.isnan()].sort().values
    mids = (grid[1:] + grid[:-1]) / 2
    x = torch.cat([grid, mids, torch.tensor([500.0, -1e4, 449.0])])[None].to(DEVICE)
    q, _ = scaled_fp8_quant_triton(x, torch.ones(1, device=DEVICE))
    expected = x.cpu().clamp(-448, 448).to(FP8)
    assert torch.equal(q.cpu().view(torch.uint8), expected.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("per_token", [False, True])
def test_dynamic_quant_matches_reference(dtype, per_token):
    x = randn(6, 300, dtype=dtype, scale=5.0)
    x[2] = 0  # an all-zero row must not divide by zero
    q, s = ops.scaled_fp8_quant(x, per_token=per_token)
    q_ref, s_ref = scaled_fp8_quant_reference(x, per_token=per_token)
    assert s.shape == s_ref.shape == ((6, 1) if per_token else (1,)) and s.dtype == torch.float32
    torch.testing.assert_close(s, s_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    # Dequantized values are within half an e4m3 step (relative 2^-4) of the input.
    err = (q.float() * s - x.float()).abs()
    assert (err <= x.float().abs() * 2**-4 + s * 2**-9).all()


def test_static_quant_and_empty():
    x = randn(4, 64, scale=3.0)
    for scale in (torch.tensor([0.01], device=DEVICE), torch.full((4, 1), 0.02, device=DEVICE)):
        q, s = ops.scaled_fp8_quant(x, scale)
        q_ref, _ = scaled_fp8_quant_reference(x, scale)
        assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
        assert torch.equal(s, scale)
    q, s = ops.scaled_fp8_quant(randn(0, 64), per_token=True)
    assert q.shape == (0, 64) and s.shape == (0, 1)
    with pytest.raises(ValueError, match="scale"):
        ops.scaled_fp8_quant(x, torch.ones(3, 1, device=DEVICE))


@pytest.mark.parametrize("M,N,K", [(1, 16, 16), (5, 48, 100), (33, 40, 64)])
@pytest.mark.parametrize("per_token,per_channel", [(False, False), (True, True), (True, False)])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_fp8_gemm_matches_reference(M, N, K, per_token, per_channel, out_dtype):
    a, sa = scaled_fp8_quant_reference(randn(M, K), per_token=per_token)
    b, sb = scaled_fp8_quant_reference(randn(N, K, seed=1, scale=0.1), per_token=per_channel)
    bias = randn(N, dtype=out_dtype, seed=2) if per_token else None
    out = ops.fp8_gemm(a, b, sa, sb, out_dtype, bias)
    expected = fp8_gemm_reference(a, b, sa, sb, out_dtype, bias)
    assert out.dtype == out_dtype and out.shape == (M, N)
    assert_close(out, expected, tol=dot_tol(TOL))


def test_fp8_gemm_reference_oracle_empty_and_bad_input():
    a, sa = scaled_fp8_quant_reference(randn(3, 32), per_token=True)
    b, sb = scaled_fp8_quant_reference(randn(8, 32, seed=1), per_token=True)
    expected = (a.double() * sa.double()) @ (b.double() * sb.double()).t()
    torch.testing.assert_close(fp8_gemm_reference(a, b, sa, sb, torch.float32).double(), expected, atol=1e-4, rtol=1e-4)
    assert ops.fp8_gemm(a[:0], b, sa[:0], sb, torch.bfloat16).shape == (0, 8)
    with pytest.raises(ValueError, match="nn.Linear"):
        ops.fp8_gemm(a, b.t().contiguous(), sa, sb, torch.float32)
    with pytest.raises(ValueError, match="scale_b"):
        ops.fp8_gemm(a, b, sa, sb[:4], torch.float32)
    with pytest.raises(ValueError, match="dtype"):
        ops.fp8_gemm(a.float(), b, sa, sb, torch.float32)
