"""Fused mixture-of-experts MLP: each token's top-k experts' SwiGLU MLPs, weighted and summed.

    out[t] = sum_j topk_weights[t, j] * W2[e] @ (silu(W1[e] @ x[t]) * W3[e] @ x[t]),  e = topk_ids[t, j]

Weights: w13 [E, 2I, H] holds each expert's gate rows (W1) then its up rows (W3); w2 [E, H, I] its
down projection (nn.Linear layout, the reduction dim last). Routing (which experts, what weights)
is the model's (workers/models/moe.py); this op only applies it.

Triton (CUDA): the T * k (token, slot) pairs are sorted by expert and each expert's run is padded
to a multiple of BLOCK_M (`align_pairs`: tensor ops only, no host sync, so decode CUDA graphs can
capture it); then one grouped-GEMM launch per projection, each program one BLOCK_M x BLOCK_N tile
of one expert's rows: gate_up with SiLU-and-mul in its epilogue (gate and up accumulated side by
side), then down with the routing weight in its epilogue, one float32 row per pair. The k rows of
a token are summed after (no atomics: the result does not depend on scheduling).

Reference (the CPU path): the same sort, then one batched matmul pair per expert that received
tokens: at most E iterations per layer, none per token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn import functional as F

from kernels._checks import FLOAT_DTYPES, check_last_dim_contiguous, check_same_device, check_tensor, require
from kernels._triton_compat import cdiv, lazy_jit, tl
from kernels.plan import DeviceSpec, fused_moe_plan
from kernels.silu_mul import silu_and_mul_reference

ID_DTYPES = (torch.int32, torch.int64)


@dataclass(frozen=True)
class MoeShape:
    tokens: int
    hidden: int
    experts: int
    inter: int  # one expert's intermediate size
    top_k: int


def _check(x, w13, w2, topk_weights, topk_ids) -> MoeShape:
    check_tensor(x, "x", 2, FLOAT_DTYPES)
    check_tensor(w13, "w13", 3, (x.dtype,))
    check_tensor(w2, "w2", 3, (x.dtype,))
    check_tensor(topk_weights, "topk_weights", 2, (torch.float32,))
    check_tensor(topk_ids, "topk_ids", 2, ID_DTYPES)
    T, H = x.shape
    E, two_i, _ = w13.shape
    inter = two_i // 2
    require(
        tuple(w13.shape) == (E, 2 * inter, H),
        f"w13 must be [experts, 2 * inter, hidden={H}] (gate rows then up rows), got {tuple(w13.shape)}",
    )
    require(
        tuple(w2.shape) == (E, H, inter),
        f"w2 must be [experts={E}, hidden={H}, inter={inter}] to match w13, got {tuple(w2.shape)}",
    )
    require(
        topk_ids.shape[0] == T and tuple(topk_weights.shape) == tuple(topk_ids.shape),
        f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} must both be "
        f"[tokens={T}, top_k]",
    )
    K = topk_ids.shape[1]
    require(1 <= K <= E, f"top_k must be in [1, experts={E}], got {K}")
    check_same_device(x=x, w13=w13, w2=w2, topk_weights=topk_weights, topk_ids=topk_ids)
    return MoeShape(T, H, E, inter, K)


def fused_moe_reference(x, w13, w2, topk_weights, topk_ids, *, silu_and_mul=silu_and_mul_reference):
    """The PyTorch path (production on the CPU). `silu_and_mul` lets the CPU backend pass its native kernel."""
    s = _check(x, w13, w2, topk_weights, topk_ids)
    out = torch.zeros((s.tokens, s.hidden), dtype=torch.float32, device=x.device)
    if s.tokens == 0:
        return out.to(x.dtype)
    flat = topk_ids.reshape(-1).long()
    counts = torch.bincount(flat, minlength=s.experts)  # raises on a negative id
    require(counts.numel() == s.experts, f"topk_ids holds an expert id >= experts ({s.experts})")
    order = torch.argsort(flat, stable=True)  # pair ids grouped by expert
    weights = topk_weights.reshape(-1)
    start = 0
    for expert, n in enumerate(counts.tolist()):
        if n == 0:
            continue
        pairs = order[start : start + n]
        start += n
        rows = pairs // s.top_k
        h = silu_and_mul(F.linear(x[rows], w13[expert]))
        y = F.linear(h, w2[expert])
        out.index_add_(0, rows, y.float() * weights[pairs, None])
    return out.to(x.dtype)


def align_pairs(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The (token, slot) pairs sorted by expert, each expert's run padded to a multiple of block_m.

    Returns (sorted_pairs [num_blocks * block_m] int32: pair id t * k + j, or T * k for padding;
    block_expert [num_blocks] int32: the expert of each block of block_m rows, num_experts for a
    block past the last). num_blocks is a bound known on the host, min(cdiv(P, block_m) + E, P) for
    P pairs, so nothing here waits for the device."""
    flat = topk_ids.reshape(-1).long()
    P = flat.numel()
    device = flat.device
    num_blocks = min(cdiv(P, block_m) + num_experts, P)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    start = torch.cumsum(counts, 0) - counts
    order = torch.argsort(flat, stable=True)
    expert_of = flat[order]
    dest = (padded_end - padded)[expert_of] + torch.arange(P, device=device) - start[expert_of]
    sorted_pairs = torch.full((num_blocks * block_m,), P, dtype=torch.int32, device=device)
    sorted_pairs[dest] = order.to(torch.int32)
    block_starts = torch.arange(num_blocks, device=device) * block_m
    block_expert = torch.searchsorted(padded_end, block_starts, right=True).to(torch.int32)
    return sorted_pairs, block_expert


@lazy_jit
def _moe_gemm_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    weights_ptr,
    pairs_ptr,
    block_expert_ptr,
    num_pairs,
    N,
    K,
    num_experts,
    stride_am,
    stride_be,
    stride_bn,
    stride_cm,
    TOP_K: tl.constexpr,
    GATED: tl.constexpr,
    A_PER_TOKEN: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    DOT_F32: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # One BLOCK_M x BLOCK_N tile of C = A[rows] @ B[expert].T for the block's pairs, all of one expert.
    # GATED: B's rows [0, N) are the gate, [N, 2N) the up projection; C = silu(gate) * up.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert >= num_experts:  # a block past the last expert's run (the grid is a host-side bound)
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(pairs_ptr + offs_m).to(tl.int64)
    valid = pairs < num_pairs
    if A_PER_TOKEN:
        rows = pairs // TOP_K  # pair t * k + j reads token t
    else:
        rows = pairs
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    nmask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + expert * stride_be + offs_n[:, None] * stride_bn + offs_k[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kmask = (k0 + offs_k) < K
        a = tl.load(a_ptrs, mask=valid[:, None] & kmask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=nmask[:, None] & kmask[None, :], other=0.0)
        if DOT_F32:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, tl.trans(b), acc, input_precision=PRECISION)
        if GATED:
            u = tl.load(b_ptrs + N * stride_bn, mask=nmask[:, None] & kmask[None, :], other=0.0)
            if DOT_F32:
                u = u.to(tl.float32)
            acc_up = tl.dot(a, tl.trans(u), acc_up, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if GATED:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    if MUL_WEIGHT:
        acc = acc * tl.load(weights_ptr + pairs, mask=valid, other=0.0)[:, None]
    tl.store(
        c_ptr + pairs[:, None] * stride_cm + offs_n[None, :],
        acc.to(c_ptr.dtype.element_ty),
        mask=valid[:, None] & nmask[None, :],
    )


def fused_moe_triton(x, w13, w2, topk_weights, topk_ids):
    """Triton fused MoE (two grouped-GEMM launches); same contract as the reference."""
    s = _check(x, w13, w2, topk_weights, topk_ids)
    for t, name in ((x, "x"), (w13, "w13"), (w2, "w2")):
        check_last_dim_contiguous(t, name)
    require(
        w13.stride(1) == s.hidden and w2.stride(1) == s.inter,
        "w13 and w2 must be contiguous per expert ([experts, rows, cols] with unit column stride)",
    )
    if s.tokens == 0:
        return torch.zeros_like(x)
    P = s.tokens * s.top_k
    plan = fused_moe_plan(
        DeviceSpec.of(x.device),
        num_pairs=P,
        num_experts=s.experts,
        hidden=s.hidden,
        inter=s.inter,
        dtype=x.dtype,
        top_k=s.top_k,
    )
    pairs, block_expert = align_pairs(topk_ids, s.experts, plan.block_m)
    num_blocks = block_expert.shape[0]
    weights = topk_weights.reshape(-1).contiguous()
    inter = torch.empty((P, s.inter), dtype=x.dtype, device=x.device)
    gu = plan.gate_up.launch_kwargs()
    _moe_gemm_kernel[(num_blocks, cdiv(s.inter, gu["BLOCK_N"]))](
        x,
        w13,
        inter,
        weights,
        pairs,
        block_expert,
        P,
        s.inter,
        s.hidden,
        s.experts,
        x.stride(0),
        w13.stride(0),
        w13.stride(1),
        inter.stride(0),
        **gu,
    )
    per_pair = torch.empty((P, s.hidden), dtype=torch.float32, device=x.device)
    dn = plan.down.launch_kwargs()
    _moe_gemm_kernel[(num_blocks, cdiv(s.hidden, dn["BLOCK_N"]))](
        inter,
        w2,
        per_pair,
        weights,
        pairs,
        block_expert,
        P,
        s.hidden,
        s.inter,
        s.experts,
        inter.stride(0),
        w2.stride(0),
        w2.stride(1),
        per_pair.stride(0),
        **dn,
    )
    return per_pair.view(s.tokens, s.top_k, s.hidden).sum(1).to(x.dtype)
