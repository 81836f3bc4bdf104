"""Paged decode attention (one query token per sequence), split-K over the context (flash-decoding).

Stage 1 (this file's kernel) computes, for each (sequence, query head group, context split), the
partial output normalised by its own softmax sum, plus that split's log-sum-exp; stage 2
(`decode_attention_reduce.py`) merges the splits. Short contexts get one split, so stage 2 is
only launched when there is more than one.

On the CPU, `paged_decode_attention_cpu` runs kernels/csrc/paged_decode_attention.cpp (built on
first use by kernels.cpu_native), which reads K/V in place from the pages; the reference gathers
every sequence's K/V into a padded copy first, which costs more than the attention itself.
"""

from __future__ import annotations

import torch

from kernels import cpu_native
from kernels._attn_common import (
    check_attention,
    check_window_softcap,
    gather_kv,
    native_cache_args,
    native_int32,
    softcap_scores,
)
from kernels._checks import check_last_dim_contiguous, is_fp8, require
from kernels._triton_compat import cdiv, lazy_jit, tl
from kernels.decode_attention_reduce import merge_splits_triton
from kernels.plan import DeviceSpec, decode_attention_plan


def _check(q, k_cache, v_cache, block_tables, context_lens, scale, k_scale, v_scale):
    out = check_attention(q, k_cache, v_cache, block_tables, context_lens, scale, k_scale, v_scale)
    if q.shape[0] != context_lens.shape[0]:
        raise ValueError(f"q has {q.shape[0]} sequences, context_lens {context_lens.shape[0]}")
    return out


def paged_decode_attention_reference(
    q,
    k_cache,
    v_cache,
    block_tables,
    context_lens,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    *,
    window: int | None = None,
    softcap: float | None = None,
):
    """`window`: the query (at position context_len - 1) sees its last `window` tokens only, and the
    blocks before them are never read (they may have been freed); `softcap`: Gemma 2's logit cap."""
    scale, k_scale, v_scale = _check(q, k_cache, v_cache, block_tables, context_lens, scale, k_scale, v_scale)
    window, softcap = check_window_softcap(window, softcap)
    B, hq, d = q.shape
    if B == 0:
        return q.new_empty((0, hq, d))
    lens = context_lens.long()
    require(int(lens.min()) >= 1, "context_lens must be >= 1")
    # Padding every sequence to the longest one wastes most of the work when one long context
    # decodes beside many short ones: group sequences by length (powers of two, at most 2x padding).
    spans = lens if window is None else lens.clamp(max=window)
    buckets = torch.ceil(torch.log2(spans.float())).long()
    if B == 1 or int(buckets.min()) == int(buckets.max()):
        return _attend_padded(q, k_cache, v_cache, block_tables, lens, scale, k_scale, v_scale, window, softcap)
    out = torch.empty_like(q)
    for bucket in buckets.unique().tolist():
        rows = torch.nonzero(buckets == bucket).flatten()
        out[rows] = _attend_padded(
            q[rows], k_cache, v_cache, block_tables[rows], lens[rows], scale, k_scale, v_scale, window, softcap
        )
    return out


def _attend_padded(q, k_cache, v_cache, block_tables, lens, scale, k_scale, v_scale, window=None, softcap=None):
    B, hq, d = q.shape
    bs, hk = k_cache.shape[1], k_cache.shape[2]
    max_len = int(lens.max())
    nblk = cdiv(max_len, bs)
    if nblk > block_tables.shape[1]:
        raise ValueError(f"context of {max_len} tokens needs {nblk} blocks, block_tables has {block_tables.shape[1]}")
    if window is None:
        first = torch.zeros_like(lens)
    else:  # each row starts at the block holding its first visible token
        first = (lens - window).clamp(min=0) // bs
        nblk = int((-(-lens // bs) - first).max())
    idx = first[:, None] + torch.arange(nblk, device=q.device)[None, :]  # [B, nblk] block-table columns
    # Padding entries of block_tables may be garbage: point them at block 0 and mask the tokens.
    used = idx * bs < lens[:, None]
    bt = torch.where(used, block_tables.long().gather(1, idx.clamp(max=block_tables.shape[1] - 1)), 0)
    k = gather_kv(k_cache, bt, k_scale)  # [B, L, Hk, D]
    v = gather_kv(v_cache, bt, v_scale)
    group = hq // hk
    qf = q.float().reshape(B, hk, group, d)
    pos = first[:, None] * bs + torch.arange(nblk * bs, device=q.device)[None, :]
    invalid = pos >= lens[:, None]
    if window is not None:
        invalid |= pos < (lens - window)[:, None]
    invalid = invalid[:, None, :]  # [B, 1, L]
    out = torch.empty((B, hk, group, d), dtype=torch.float32, device=q.device)
    # One batched matmul pair per kv head: k[:, :, h] is a strided [B, L, D] view that bmm reads
    # in place, where a single 4-D matmul over (B, Hk) would first copy all of K and V.
    for h in range(hk):
        scores = softcap_scores(torch.bmm(qf[:, h], k[:, :, h].transpose(1, 2)) * scale, softcap)  # [B, G, L]
        scores.masked_fill_(invalid, float("-inf"))
        torch.bmm(torch.softmax(scores, dim=-1), v[:, :, h], out=out[:, h])
    return out.reshape(B, hq, d).to(q.dtype)


_NATIVE_ERRORS = {1: "bad head or block geometry", 2: "context_lens must be >= 1"}
_I64, _I32, _PTR = cpu_native.I64, cpu_native.I32, cpu_native.PTR
_NATIVE_ARGS = (
    _PTR,
    _I64,
    _I64,
    _I32,
    _PTR,
    _PTR,
    _I32,
    _I64,
    _PTR,
    _PTR,
    _PTR,
    _I64,
    _I64,
    _PTR,
    _PTR,
    _I64,
    _I64,
    _I64,
    _I32,
    _I32,
    _I32,
    _I32,
    cpu_native.F32,
    _I64,
    cpu_native.F32,
    _I32,
)


def _native_fn():
    return cpu_native.function("paged_decode_attention", "baton_paged_decode_attention", _NATIVE_ARGS)


def native_built() -> bool:
    """Whether the native library loads on this machine (built, or found cached, once per process)."""
    return _native_fn() is not None


def native_available(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether paged_decode_attention_cpu handles these tensors (CPU, float32/bfloat16 q, built library)."""
    return (
        isinstance(q, torch.Tensor)
        and isinstance(k_cache, torch.Tensor)
        and q.device.type == "cpu"
        and q.dtype in (torch.float32, torch.bfloat16)
        and k_cache.dtype in (q.dtype, torch.float8_e4m3fn)
        and _native_fn() is not None
    )


def paged_decode_attention_cpu(
    q,
    k_cache,
    v_cache,
    block_tables,
    context_lens,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    *,
    window: int | None = None,
    softcap: float | None = None,
):
    """The native CPU kernel; same contract as the reference. Needs native_available(q, k_cache)."""
    scale, k_scale, v_scale = _check(q, k_cache, v_cache, block_tables, context_lens, scale, k_scale, v_scale)
    window, softcap = check_window_softcap(window, softcap)
    if not native_available(q, k_cache):
        raise ValueError(
            f"no native CPU decode attention for q {q.dtype} on {q.device}, "
            f"cache {k_cache.dtype} (or the library could not be built)"
        )
    check_last_dim_contiguous(q, "q")
    block_tables = native_int32(block_tables)
    context_lens = native_int32(context_lens)
    B, hq, d = q.shape
    out = torch.empty((B, hq, d), dtype=q.dtype)
    if B == 0:
        return out
    _, bs, hk, _ = k_cache.shape
    err = _native_fn()(
        q.data_ptr(),
        q.stride(0),
        q.stride(1),
        cpu_native.DTYPE_CODES[q.dtype],
        *native_cache_args(k_cache, v_cache, k_scale, v_scale),
        block_tables.data_ptr(),
        block_tables.stride(0),
        block_tables.shape[1],
        context_lens.data_ptr(),
        out.data_ptr(),
        out.stride(0),
        out.stride(1),
        B,
        hq,
        hk,
        d,
        bs,
        scale,
        window or 0,
        softcap or 0.0,
        torch.get_num_threads(),
    )
    if err != 0:
        raise ValueError(f"native decode attention: {_NATIVE_ERRORS.get(err, f'error {err}')}")
    return out


_LOG2E = 1.4426950408889634


def _optional_constexprs(window, softcap) -> dict:
    """The window / soft-cap switches, passed only when set: the plain path compiles as before."""
    return {
        **({"HAS_WINDOW": True} if window is not None else {}),
        **({"SOFTCAP": True} if softcap is not None else {}),
    }


@lazy_jit
def _decode_split_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    bt_ptr,
    lens_ptr,
    out_ptr,
    mid_o_ptr,
    mid_lse_ptr,
    qk_scale,
    v_scale,
    split_len,
    max_ctx,
    window,
    softcap_log2e,
    stride_qb,
    stride_qh,
    stride_bt,
    stride_ob,
    stride_oh,
    G: tl.constexpr,
    HK: tl.constexpr,
    D: tl.constexpr,
    BS: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_F32: tl.constexpr,
    PRECISION: tl.constexpr,
    HAS_WINDOW: tl.constexpr = False,
    SOFTCAP: tl.constexpr = False,
    FP8_VIA_F32: tl.constexpr = False,
):
    # One program per (sequence, kv head, context split). All G query heads sharing the kv head
    # are processed together, so each K/V row is read once per split (GQA costs no extra bandwidth).
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    sp = tl.program_id(2)
    # Clamped to what the block table can address: a bad context_len must not read past it.
    ctx = tl.minimum(tl.load(lens_ptr + b), max_ctx)
    if HAS_WINDOW:
        # The splits cover the window only: tokens (and blocks) before it are never read.
        start = tl.maximum(ctx - window, 0) + sp * split_len
    else:
        start = sp * split_len
    end = tl.minimum(start + split_len, ctx)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kvh * G + g
    gmask = g < G
    dmask = d < D
    q = tl.load(
        q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=gmask[:, None] & dmask[None, :], other=0.0
    )
    if DOT_F32:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        nmask = n < end
        page = tl.load(bt_ptr + b * stride_bt + n // BS, mask=nmask, other=0).to(tl.int64)
        rows = (page * BS + n % BS) * HK + kvh
        kv_mask = nmask[:, None] & dmask[None, :]
        # FP8 K/V are exact in fp16/bf16; their scales are folded into qk_scale and v_scale.
        k = tl.load(k_ptr + rows[:, None] * D + d[None, :], mask=kv_mask, other=0.0)
        if FP8_VIA_F32:  # kernels/plan.py: FP8 to bfloat16 below sm_90
            k = k.to(tl.float32)
        k = k.to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        if SOFTCAP:  # qk_scale holds 1 / cap: s = cap * tanh(raw / cap), in base 2
            s = (1.0 - 2.0 / (tl.exp(2.0 * s) + 1.0)) * softcap_log2e
        s = tl.where(nmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + rows[:, None] * D + d[None, :], mask=kv_mask, other=0.0)
        if FP8_VIA_F32:  # kernels/plan.py: FP8 to bfloat16 below sm_90
            v = v.to(tl.float32)
        v = v.to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision=PRECISION)
        m_i = m_new

    # An empty split (context shorter than its start) leaves l_i = 0: give it weight 0, not NaN.
    safe_l = tl.where(l_i > 0, l_i, 1.0)
    o = acc / safe_l[:, None] * v_scale
    omask = gmask[:, None] & dmask[None, :]
    if NUM_SPLITS == 1:
        tl.store(
            out_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=omask,
        )
    else:
        # mid_o is [B, Hq, NUM_SPLITS, D] and mid_lse [B, Hq, NUM_SPLITS], both contiguous; lse in base 2.
        row = (b * (HK * G) + heads) * NUM_SPLITS + sp
        tl.store(mid_o_ptr + row[:, None] * D + d[None, :], o, mask=omask)
        lse = tl.where(l_i > 0, m_i + tl.log2(safe_l), float("-inf"))
        tl.store(mid_lse_ptr + row, lse, mask=gmask)


def paged_decode_attention_triton(
    q,
    k_cache,
    v_cache,
    block_tables,
    context_lens,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    *,
    window: int | None = None,
    softcap: float | None = None,
    num_splits: int | None = None,
):
    """Triton paged decode attention. `num_splits` overrides the split-K heuristic (tests use it)."""
    scale, k_scale, v_scale = _check(q, k_cache, v_cache, block_tables, context_lens, scale, k_scale, v_scale)
    window, softcap = check_window_softcap(window, softcap)
    check_last_dim_contiguous(q, "q")
    require(block_tables.stride(1) == 1, "block_tables must be contiguous in its last dim")
    require(context_lens.is_contiguous(), "context_lens must be contiguous")
    B, hq, d = q.shape
    out = torch.empty((B, hq, d), dtype=q.dtype, device=q.device)
    if B == 0:
        return out
    _, bs, hk, _ = k_cache.shape
    if not is_fp8(k_cache.dtype):
        k_scale = v_scale = 1.0  # scales only describe FP8 storage, as in the reference
    # Bound the context by the block table width, so choosing the grid needs no device sync.
    max_ctx = block_tables.shape[1] * bs
    # Tiles, split-K and dot precision: kernels/plan.py (the compile check compiles the same choices).
    plan = decode_attention_plan(
        DeviceSpec.of(q.device),
        batch=B,
        num_q_heads=hq,
        num_kv_heads=hk,
        head_dim=d,
        block_size=bs,
        max_ctx=max_ctx if window is None else min(max_ctx, window),
        dtype=q.dtype,
        kv_dtype=k_cache.dtype,
        num_splits=num_splits,
    )
    num_splits, split_len = plan.num_splits, plan.split_len
    if num_splits > 1:
        mid_o = torch.empty((B, hq, num_splits, d), dtype=torch.float32, device=q.device)
        mid_lse = torch.empty((B, hq, num_splits), dtype=torch.float32, device=q.device)
    else:
        mid_o = mid_lse = out
    _decode_split_kernel[(B, hk, num_splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        out,
        mid_o,
        mid_lse,
        scale * k_scale * (_LOG2E if softcap is None else 1.0 / softcap),
        v_scale,
        split_len,
        max_ctx,
        window or 0,
        (softcap or 0.0) * _LOG2E,
        q.stride(0),
        q.stride(1),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        **plan.split.launch_kwargs(),
        **_optional_constexprs(window, softcap),
    )
    if num_splits > 1:
        merge_splits_triton(mid_o, mid_lse, out, plan=plan.merge)
    return out
