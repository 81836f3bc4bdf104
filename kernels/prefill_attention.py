"""Paged prefill attention: causal attention of a batch of new query tokens over each sequence's cached K/V.

Chunked prefill and prefix caching both show up as a sequence whose first context tokens are
already in the cache: query token j of sequence i sits at position context_len - q_len + j.

On the CPU, `paged_prefill_attention_cpu` runs kernels/csrc/paged_prefill_attention.cpp (built on
first use by kernels.cpu_native): it reads K/V in place from the pages, where the reference gathers
and widens each sequence's context and then calls torch's flash kernel, which runs in float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import cpu_native
from kernels._attn_common import (
    check_attention,
    check_window_softcap,
    gather_kv,
    native_cache_args,
    native_int32,
    softcap_scores,
)
from kernels._checks import check_last_dim_contiguous, check_tensor, is_fp8, require
from kernels._triton_compat import cdiv, lazy_jit, tl
from kernels.plan import DeviceSpec, prefill_attention_plan


def _check(q, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale, k_scale, v_scale):
    out = check_attention(q, k_cache, v_cache, block_tables, context_lens, scale, k_scale, v_scale)
    check_tensor(query_start_loc, "query_start_loc", 1, (torch.int32, torch.int64))
    require(
        query_start_loc.shape[0] == context_lens.shape[0] + 1,
        f"query_start_loc needs B+1 = {context_lens.shape[0] + 1} entries, got {query_start_loc.shape[0]}",
    )
    require(query_start_loc.device == q.device, "query_start_loc must be on q's device")
    return out


def paged_prefill_attention_reference(
    q,
    k_cache,
    v_cache,
    block_tables,
    query_start_loc,
    context_lens,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    *,
    window: int | None = None,
    softcap: float | None = None,
):
    """`window`: a query at position p sees keys at positions > p - window (transformers' sliding
    window); blocks wholly before the first query's window are never read. `softcap`: Gemma 2's cap."""
    scale, k_scale, v_scale = _check(
        q, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale, k_scale, v_scale
    )
    window, softcap = check_window_softcap(window, softcap)
    T, hq, d = q.shape
    out = q.new_empty((T, hq, d))
    B = context_lens.shape[0]
    if T == 0 or B == 0:
        return out
    bs = k_cache.shape[1]
    starts = query_start_loc.tolist()
    lens = context_lens.tolist()
    require(
        starts[0] == 0 and starts[-1] == T, f"query_start_loc must run from 0 to {T}, got {starts[0]}..{starts[-1]}"
    )
    for i in range(B):
        s, e, ctx = starts[i], starts[i + 1], lens[i]
        ql = e - s
        if ql == 0:
            continue
        require(0 < ql <= ctx, f"sequence {i}: {ql} new tokens but context_len {ctx}")
        nb = cdiv(ctx, bs)
        require(
            nb <= block_tables.shape[1], f"sequence {i} needs {nb} blocks, block_tables has {block_tables.shape[1]}"
        )
        # The first block any query of the chunk may see: with a window, earlier ones are skipped.
        first = 0 if window is None else max(0, ctx - ql - window + 1) // bs
        ids = block_tables[i, first:nb].long()
        lo = first * bs
        # 4-D [1, H, len, D] inputs: torch's CPU flash kernel takes them (GQA included); 3-D ones
        # fall back to the unfused math path, several times slower on long prompts.
        k = gather_kv(k_cache, ids, k_scale)[: ctx - lo].transpose(0, 1)[None]  # [1, Hk, ctx - lo, D]
        v = gather_kv(v_cache, ids, v_scale)[: ctx - lo].transpose(0, 1)[None]
        qi = q[s:e].float().transpose(0, 1)[None]  # [1, Hq, ql, D]
        if ql == ctx and window is None and softcap is None:
            o = F.scaled_dot_product_attention(qi, k, v, is_causal=True, scale=scale, enable_gqa=True)
        else:
            qpos = torch.arange(ctx - ql, ctx, device=q.device)
            kpos = torch.arange(lo, ctx, device=q.device)
            mask = kpos[None, :] <= qpos[:, None]
            if window is not None:
                mask &= kpos[None, :] > qpos[:, None] - window
            if softcap is None:
                o = F.scaled_dot_product_attention(qi, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
            else:  # the cap sits between the product and the softmax, where SDPA has no hook
                group = qi.shape[1] // k.shape[1]
                kg, vg = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
                scores = softcap_scores(qi @ kg.transpose(-1, -2) * scale, softcap).masked_fill_(~mask, float("-inf"))
                o = torch.softmax(scores, dim=-1) @ vg
        out[s:e] = o[0].transpose(0, 1).to(q.dtype)
    return out


_NATIVE_ERRORS = {
    1: "bad head geometry or dtype",
    2: "a sequence has more new tokens than context, or more context than its block table holds",
    3: "no specialisation for this block size / head dim",
}
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
# (block_size, head_dim) pairs the kernel is compiled for; others use the reference.
_NATIVE_SHAPES = {(16, 64), (16, 128)}


def _native_fn():
    return cpu_native.function("paged_prefill_attention", "baton_paged_prefill_attention", _NATIVE_ARGS)


def native_built() -> bool:
    """Whether the native library loads on this machine (built, or found cached, once per process)."""
    return _native_fn() is not None


def native_shape(block_size: int, head_dim: int) -> bool:
    """Whether the native kernel is compiled for this block size and head dim."""
    return (block_size, head_dim) in _NATIVE_SHAPES


def native_available(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether paged_prefill_attention_cpu handles these tensors (CPU, float32/bfloat16 q, a compiled
    block size / head dim, built library)."""
    return (
        isinstance(q, torch.Tensor)
        and isinstance(k_cache, torch.Tensor)
        and q.device.type == "cpu"
        and q.dtype in (torch.float32, torch.bfloat16)
        and k_cache.dtype in (q.dtype, torch.float8_e4m3fn)
        and k_cache.dim() == 4
        and native_shape(k_cache.shape[1], k_cache.shape[3])
        and _native_fn() is not None
    )


def paged_prefill_attention_cpu(
    q,
    k_cache,
    v_cache,
    block_tables,
    query_start_loc,
    context_lens,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    *,
    window: int | None = None,
    softcap: float | None = None,
):
    """The native CPU kernel; same contract as the reference. Needs native_available(q, k_cache)."""
    scale, k_scale, v_scale = _check(
        q, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale, k_scale, v_scale
    )
    window, softcap = check_window_softcap(window, softcap)
    require(
        native_available(q, k_cache),
        f"no native CPU prefill attention for q {q.dtype}, cache {k_cache.dtype} "
        f"{tuple(k_cache.shape)} (or the library could not be built)",
    )
    check_last_dim_contiguous(q, "q")
    block_tables = native_int32(block_tables)
    query_start_loc = native_int32(query_start_loc)
    context_lens = native_int32(context_lens)
    T, hq, d = q.shape
    out = torch.empty((T, hq, d), dtype=q.dtype)
    B = context_lens.shape[0]
    if T == 0 or B == 0:
        return out
    starts = query_start_loc.tolist()
    require(
        starts[0] == 0 and starts[-1] == T, f"query_start_loc must run from 0 to {T}, got {starts[0]}..{starts[-1]}"
    )
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
        query_start_loc.data_ptr(),
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
    require(err == 0, f"native prefill attention: {_NATIVE_ERRORS.get(err, f'error {err}')}")
    return out


_LOG2E = 1.4426950408889634


@lazy_jit
def _prefill_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    bt_ptr,
    qsl_ptr,
    lens_ptr,
    out_ptr,
    qk_scale,
    v_scale,
    max_ctx,
    window,
    softcap_log2e,
    stride_qt,
    stride_qh,
    stride_bt,
    stride_ot,
    stride_oh,
    G: tl.constexpr,
    HK: tl.constexpr,
    D: tl.constexpr,
    BS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_F32: tl.constexpr,
    PRECISION: tl.constexpr,
    HAS_WINDOW: tl.constexpr = False,
    SOFTCAP: tl.constexpr = False,
    FP8_VIA_F32: tl.constexpr = False,
):
    # One program per (tile of BLOCK_M new tokens, query head, sequence); the grid is sized for the
    # longest sequence, so tiles past a shorter sequence's end do nothing.
    tile = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    q_start = tl.load(qsl_ptr + b)
    q_len = tl.load(qsl_ptr + b + 1) - q_start
    m0 = tile * BLOCK_M
    if m0 < q_len:
        # Clamped to what the block table can address: a bad context_len must not read past it.
        ctx = tl.minimum(tl.load(lens_ptr + b), max_ctx)
        prefix = ctx - q_len
        kvh = h // G
        offs_m = m0 + tl.arange(0, BLOCK_M)
        mmask = offs_m < q_len
        d = tl.arange(0, BLOCK_D)
        dmask = d < D
        tok = (q_start + offs_m).to(tl.int64)
        q = tl.load(
            q_ptr + tok[:, None] * stride_qt + h * stride_qh + d[None, :],
            mask=mmask[:, None] & dmask[None, :],
            other=0.0,
        )
        if DOT_F32:
            q = q.to(tl.float32)
        qpos = prefix + offs_m

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        # Causality: nothing past this tile's last position is ever visible.
        end = tl.minimum(ctx, prefix + m0 + BLOCK_M)
        if HAS_WINDOW:  # nothing before the tile's first query's window is visible, nor read
            lo = tl.maximum(prefix + m0 - window + 1, 0)
        else:
            lo = 0
        for n0 in range(lo, end, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            nmask = n < end
            page = tl.load(bt_ptr + b * stride_bt + n // BS, mask=nmask, other=0).to(tl.int64)
            rows = (page * BS + n % BS) * HK + kvh
            kv_mask = nmask[:, None] & dmask[None, :]
            k = tl.load(k_ptr + rows[:, None] * D + d[None, :], mask=kv_mask, other=0.0)
            if FP8_VIA_F32:  # kernels/plan.py: FP8 to bfloat16 below sm_90
                k = k.to(tl.float32)
            k = k.to(q.dtype)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
            if SOFTCAP:  # qk_scale holds 1 / cap: s = cap * tanh(raw / cap), in base 2
                s = (1.0 - 2.0 / (tl.exp(2.0 * s) + 1.0)) * softcap_log2e
            # Each row sees its own key (its first tile's first key without a window), so no row
            # ends fully masked (no NaN); a fully masked tile leaves m_i = -inf with p = 0.
            visible = nmask[None, :] & (n[None, :] <= qpos[:, None])
            if HAS_WINDOW:
                visible = visible & (n[None, :] > qpos[:, None] - window)
            s = tl.where(visible, s, float("-inf"))
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
        o = acc / l_i[:, None] * v_scale
        tl.store(
            out_ptr + tok[:, None] * stride_ot + h * stride_oh + d[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=mmask[:, None] & dmask[None, :],
        )


def paged_prefill_attention_triton(
    q,
    k_cache,
    v_cache,
    block_tables,
    query_start_loc,
    context_lens,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    *,
    window: int | None = None,
    softcap: float | None = None,
):
    scale, k_scale, v_scale = _check(
        q, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale, k_scale, v_scale
    )
    window, softcap = check_window_softcap(window, softcap)
    check_last_dim_contiguous(q, "q")
    require(block_tables.stride(1) == 1, "block_tables must be contiguous in its last dim")
    require(
        context_lens.is_contiguous() and query_start_loc.is_contiguous(),
        "context_lens and query_start_loc must be contiguous",
    )
    T, hq, d = q.shape
    out = torch.empty((T, hq, d), dtype=q.dtype, device=q.device)
    B = context_lens.shape[0]
    if T == 0 or B == 0:
        return out
    _, bs, hk, _ = k_cache.shape
    if not is_fp8(k_cache.dtype):
        k_scale = v_scale = 1.0  # scales only describe FP8 storage, as in the reference
    # One host sync to size the grid; prefill is compute-bound, so it is cheap here.
    max_q = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    # Tiles and dot precision: kernels/plan.py (the compile check compiles the same choices).
    plan = prefill_attention_plan(
        DeviceSpec.of(q.device),
        max_q=max_q,
        num_q_heads=hq,
        num_kv_heads=hk,
        head_dim=d,
        block_size=bs,
        dtype=q.dtype,
        kv_dtype=k_cache.dtype,
        windowed=window is not None,
    )
    # With a window, each row's first visible key must fall in its tile's first key block (no NaN row).
    assert window is None or plan.meta["BLOCK_M"] <= plan.meta["BLOCK_N"], plan.meta
    _prefill_kernel[(cdiv(max_q, plan.meta["BLOCK_M"]), hq, B)](
        q,
        k_cache,
        v_cache,
        block_tables,
        query_start_loc,
        context_lens,
        out,
        scale * k_scale * (_LOG2E if softcap is None else 1.0 / softcap),
        v_scale,
        block_tables.shape[1] * bs,
        window or 0,
        (softcap or 0.0) * _LOG2E,
        q.stride(0),
        q.stride(1),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        **plan.launch_kwargs(),
        **({"HAS_WINDOW": True} if window is not None else {}),
        **({"SOFTCAP": True} if softcap is not None else {}),
    )
    return out
