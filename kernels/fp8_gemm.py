"""W8A8 FP8 GEMM: (a * scale_a) @ (b * scale_b).T + bias with per-tensor / per-token / per-channel scales."""

from __future__ import annotations

import torch

from kernels._checks import FLOAT_DTYPES, FP8_DTYPE, check_same_device, check_tensor, require
from kernels._triton_compat import cdiv, lazy_jit, tl
from kernels.plan import DeviceSpec, fp8_gemm_plan


def _check(a, b, scale_a, scale_b, out_dtype, bias):
    check_tensor(a, "a", 2, (FP8_DTYPE,))
    check_tensor(b, "b", 2, (FP8_DTYPE,))
    M, K = a.shape
    N = b.shape[0]
    require(b.shape[1] == K, f"a is [M={M}, K={K}] but b is {tuple(b.shape)}; b must be [N, K] (nn.Linear layout)")
    check_tensor(scale_a, "scale_a", None, (torch.float32,))
    check_tensor(scale_b, "scale_b", None, (torch.float32,))
    require(
        scale_a.numel() == 1 or tuple(scale_a.shape) == (M, 1),
        f"scale_a must be [1] or [{M}, 1], got {tuple(scale_a.shape)}",
    )
    require(
        scale_b.numel() == 1 or tuple(scale_b.shape) == (N, 1),
        f"scale_b must be [1] or [{N}, 1], got {tuple(scale_b.shape)}",
    )
    require(out_dtype in FLOAT_DTYPES, f"out_dtype must be one of float32/float16/bfloat16, got {out_dtype}")
    if bias is not None:
        check_tensor(bias, "bias", 1, FLOAT_DTYPES)
        require(bias.shape[0] == N, f"bias has {bias.shape[0]} elements, N = {N}")
    check_same_device(a=a, b=b, scale_a=scale_a, scale_b=scale_b, bias=bias)
    return M, N, K


def fp8_gemm_reference(a, b, scale_a, scale_b, out_dtype, bias=None):
    M, N, _ = _check(a, b, scale_a, scale_b, out_dtype, bias)
    acc = torch.matmul(a.float(), b.float().t())
    acc = acc * scale_a.reshape(-1, 1) * scale_b.reshape(1, -1)
    if bias is not None:
        acc = acc + bias.float()
    return acc.to(out_dtype)


@lazy_jit
def _fp8_gemm_kernel(
    a_ptr,
    b_ptr,
    sa_ptr,
    sb_ptr,
    bias_ptr,
    c_ptr,
    M,
    N,
    K,
    stride_am,
    stride_bn,
    stride_cm,
    SA_PER_ROW: tl.constexpr,
    SB_PER_COL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    # Grouped tile order: GROUP_M row tiles sweep the N tiles together, so B tiles stay in L2.
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * num_n)
    first_m = group * GROUP_M
    group_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * num_n)) % group_m
    pid_n = (pid % (GROUP_M * num_n)) // group_m

    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    mmask = offs_m < M
    nmask = offs_n < N
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + offs_n[:, None] * stride_bn + offs_k[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kmask = (k0 + offs_k) < K
        a = tl.load(a_ptrs, mask=mmask[:, None] & kmask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=nmask[:, None] & kmask[None, :], other=0.0)
        # b tiles are [N, K] (K-major), the layout Hopper's FP8 wgmma wants for its second operand.
        acc = tl.dot(a, tl.trans(b), acc)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K

    # Scales are applied once to the fp32 accumulator, not per K step.
    if SA_PER_ROW:
        acc = acc * tl.load(sa_ptr + offs_m, mask=mmask, other=0.0)[:, None]
    else:
        acc = acc * tl.load(sa_ptr)
    if SB_PER_COL:
        acc = acc * tl.load(sb_ptr + offs_n, mask=nmask, other=0.0)[None, :]
    else:
        acc = acc * tl.load(sb_ptr)
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + offs_n, mask=nmask, other=0.0).to(tl.float32)[None, :]
    tl.store(
        c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :],
        acc.to(c_ptr.dtype.element_ty),
        mask=mmask[:, None] & nmask[None, :],
    )


def fp8_gemm_triton(a, b, scale_a, scale_b, out_dtype, bias=None, *, config: dict | None = None):
    """Triton W8A8 GEMM. `config` overrides the tile heuristic (benchmarks use it)."""
    M, N, K = _check(a, b, scale_a, scale_b, out_dtype, bias)
    require(a.stride(1) == 1 and b.stride(1) == 1, "a and b must be contiguous in K (their last dim)")
    out = torch.empty((M, N), dtype=out_dtype, device=a.device)
    if M == 0 or N == 0:
        return out
    if K == 0:
        return out.zero_() if bias is None else out.copy_(bias.to(out_dtype).expand(M, N))
    sa = scale_a.contiguous()
    sb = scale_b.contiguous()
    bias_arg = bias.contiguous() if bias is not None else sa
    # Tiles, warps and stages: kernels/plan.py (the compile check compiles the same choices).
    cfg = fp8_gemm_plan(
        DeviceSpec.of(a.device),
        M=M,
        N=N,
        K=K,
        has_bias=bias is not None,
        sa_per_row=sa.numel() > 1,
        sb_per_col=sb.numel() > 1,
    ).launch_kwargs()
    cfg.update(config or {})
    grid = (cdiv(M, cfg["BLOCK_M"]) * cdiv(N, cfg["BLOCK_N"]),)
    _fp8_gemm_kernel[grid](a, b, sa, sb, bias_arg, out, M, N, K, a.stride(0), b.stride(0), out.stride(0), **cfg)
    return out
