"""Rotary position embedding (NeoX / HF-Llama rotate_half style), in place on q and k, and its cos/sin cache."""

from __future__ import annotations

import math

import torch

from kernels import cpu_native
from kernels._checks import FLOAT_DTYPES, check_last_dim_contiguous, check_same_device, check_tensor, require
from kernels._triton_compat import cdiv, lazy_jit, tl
from kernels.plan import DeviceSpec, rotary_plan


def _inv_freq(head_dim: int, base: float, rope_scaling: dict | None) -> torch.Tensor:
    # Same float32 arithmetic as transformers' _compute_default_rope_parameters, so caches agree bit for bit.
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).to(dtype=torch.float) / head_dim))
    if not rope_scaling:
        return inv_freq
    rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(rope_scaling["factor"])
    if rope_type == "llama3":
        factor = rope_scaling["factor"]
        low_freq_factor = rope_scaling["low_freq_factor"]
        high_freq_factor = rope_scaling["high_freq_factor"]
        old_context_len = rope_scaling["original_max_position_embeddings"]
        low_freq_wavelen = old_context_len / low_freq_factor
        high_freq_wavelen = old_context_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths are slowed by `factor`, short ones kept, the band between blended smoothly.
        inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * inv_freq_llama / factor + smooth * inv_freq_llama
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, inv_freq_llama)
    raise ValueError(f"unsupported rope_scaling type {rope_type!r}; supported: default, linear, llama3, longrope")


def _longrope_inv_freq(head_dim: int, base: float, factors: list[float]) -> torch.Tensor:
    # transformers' _compute_longrope_parameters, float32 throughout.
    ext = torch.tensor(factors, dtype=torch.float32)
    if ext.shape != (head_dim // 2,):
        raise ValueError(f"longrope factors need head_dim / 2 = {head_dim // 2} values, got {ext.shape[0]}")
    return 1.0 / (ext * base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


def _longrope_cache(head_dim: int, max_position: int, base: float, scaling: dict) -> torch.Tensor:
    """Phi-3's LongRoPE: positions inside the pretrained context rotate by the short factors,
    positions past it by the long ones (per position, so a cached key never changes), and cos/sin
    are scaled by the attention factor. transformers instead switches every position of a
    sequence to the long factors once the sequence passes the pretrained context; the two agree
    on every sequence that stays inside it."""
    original = int(scaling["original_max_position_embeddings"])
    factor = scaling.get("factor") or scaling["max_position_embeddings"] / original
    attention = scaling.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    t = torch.arange(max_position, dtype=torch.int64).float()
    short = torch.outer(t, _longrope_inv_freq(head_dim, base, scaling["short_factor"]))
    long = torch.outer(t, _longrope_inv_freq(head_dim, base, scaling["long_factor"]))
    freqs = torch.where((t < original)[:, None], short, long)
    return torch.cat([freqs.cos() * attention, freqs.sin() * attention], dim=-1).contiguous()


def build_rope_cache(head_dim: int, max_position: int, base: float, rope_scaling: dict | None) -> torch.Tensor:
    """float32 [max_position, head_dim] = cat(cos, sin) over the head_dim // 2 frequencies."""
    if not (isinstance(head_dim, int) and head_dim > 0 and head_dim % 2 == 0):
        raise ValueError(f"head_dim must be a positive even int, got {head_dim!r}")
    if not (isinstance(max_position, int) and max_position > 0):
        raise ValueError(f"max_position must be a positive int, got {max_position!r}")
    if rope_scaling and rope_scaling.get("rope_type", rope_scaling.get("type")) == "longrope":
        return _longrope_cache(head_dim, max_position, float(base), rope_scaling)
    inv_freq = _inv_freq(head_dim, float(base), rope_scaling)
    t = torch.arange(max_position, dtype=torch.int64).float()
    freqs = torch.outer(t, inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).contiguous()


def _check(positions, q, k, cos_sin_cache) -> None:
    check_tensor(positions, "positions", 1, (torch.int64, torch.int32))
    check_tensor(q, "q", 3, FLOAT_DTYPES)
    check_tensor(k, "k", 3, (q.dtype,))
    check_tensor(cos_sin_cache, "cos_sin_cache", 2, (torch.float32,))
    T, _, D = q.shape
    if not (positions.shape[0] == T and k.shape[0] == T):
        raise ValueError(
            f"positions {tuple(positions.shape)}, q {tuple(q.shape)} and k {tuple(k.shape)} disagree on token count"
        )
    if not (k.shape[2] == D and D % 2 == 0):
        raise ValueError(f"q and k need the same even head_dim, got {D} and {k.shape[2]}")
    if cos_sin_cache.shape[1] != D:
        raise ValueError(f"cos_sin_cache width {cos_sin_cache.shape[1]} != head_dim {D}")
    check_same_device(positions=positions, q=q, k=k, cos_sin_cache=cos_sin_cache)


def rotary_embedding_reference(positions, q, k, cos_sin_cache) -> None:
    _check(positions, q, k, cos_sin_cache)
    if q.shape[0] == 0:
        return
    half = q.shape[2] // 2
    cs = cos_sin_cache.index_select(0, positions.long())
    cos = cs[:, None, :half]
    sin = cs[:, None, half:]
    for t in (q, k):
        x1 = t[..., :half].float()
        x2 = t[..., half:].float()
        o1 = x1 * cos - x2 * sin
        o2 = x2 * cos + x1 * sin
        t[..., :half] = o1.to(t.dtype)
        t[..., half:] = o2.to(t.dtype)


_NATIVE_ARGS = (
    cpu_native.PTR,
    cpu_native.PTR,
    cpu_native.I64,
    cpu_native.I64,
    cpu_native.I32,
    cpu_native.PTR,
    cpu_native.I64,
    cpu_native.I64,
    cpu_native.I32,
    cpu_native.I32,
    cpu_native.PTR,
    cpu_native.I64,
    cpu_native.I64,
    cpu_native.I32,
    cpu_native.I32,
)


def _native_fn():
    return cpu_native.function("rotary", "baton_rotary", _NATIVE_ARGS)


def native_built() -> bool:
    """Whether the native library loads on this machine (built, or found cached, once per process)."""
    return _native_fn() is not None


def native_available(q) -> bool:
    """Whether rotary_embedding_cpu handles q (CPU float32/bfloat16, built library)."""
    return (
        isinstance(q, torch.Tensor)
        and q.device.type == "cpu"
        and q.dtype in (torch.float32, torch.bfloat16)
        and _native_fn() is not None
    )


def rotary_embedding_cpu(positions, q, k, cos_sin_cache) -> None:
    """The native CPU kernel (kernels/csrc/rotary.cpp), in place; same contract as the reference."""
    _check(positions, q, k, cos_sin_cache)
    if not native_available(q):
        raise ValueError(f"no native CPU rotary embedding for {q.dtype} on {q.device}")
    check_last_dim_contiguous(q, "q")
    check_last_dim_contiguous(k, "k")
    positions = positions.to(torch.int64).contiguous()
    cos_sin_cache = cos_sin_cache.contiguous()
    T, hq, d = q.shape
    err = _native_fn()(
        positions.data_ptr(),
        q.data_ptr(),
        q.stride(0),
        q.stride(1),
        hq,
        k.data_ptr(),
        k.stride(0),
        k.stride(1),
        k.shape[1],
        d,
        cos_sin_cache.data_ptr(),
        cos_sin_cache.shape[0],
        T,
        cpu_native.DTYPE_CODES[q.dtype],
        torch.get_num_threads(),
    )
    if err != 0:
        raise ValueError(
            f"positions must lie in [0, {cos_sin_cache.shape[0]}) (the rope cache length)"
            if err == 2
            else f"native rotary failed with status {err}"
        )


@lazy_jit
def _rotary_kernel(
    pos_ptr,
    x_ptr,
    cache_ptr,
    H,
    stride_xt,
    stride_xh,
    stride_cache,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_HALF)
    dmask = dims < HALF
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    cos = tl.load(cache_ptr + pos * stride_cache + dims, mask=dmask, other=0.0)
    sin = tl.load(cache_ptr + pos * stride_cache + HALF + dims, mask=dmask, other=0.0)
    mask = (heads[:, None] < H) & dmask[None, :]
    p1 = x_ptr + tok * stride_xt + heads[:, None].to(tl.int64) * stride_xh + dims[None, :]
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p1 + HALF, mask=mask, other=0.0).to(tl.float32)
    o1 = x1 * cos[None, :] - x2 * sin[None, :]
    o2 = x2 * cos[None, :] + x1 * sin[None, :]
    tl.store(p1, o1.to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(p1 + HALF, o2.to(x_ptr.dtype.element_ty), mask=mask)


def rotary_embedding_triton(positions, q, k, cos_sin_cache) -> None:
    _check(positions, q, k, cos_sin_cache)
    check_last_dim_contiguous(q, "q")
    check_last_dim_contiguous(k, "k")
    require(cos_sin_cache.stride(1) == 1, "cos_sin_cache must be contiguous in its last dim")
    T, _, D = q.shape
    if T == 0:
        return
    for x in (q, k):
        H = x.shape[1]
        if H == 0:
            continue
        plan = rotary_plan(DeviceSpec.of(x.device), num_heads=H, head_dim=D)
        _rotary_kernel[(T, cdiv(H, plan.meta["BLOCK_H"]))](
            positions,
            x,
            cos_sin_cache,
            H,
            x.stride(0),
            x.stride(1),
            cos_sin_cache.stride(0),
            **plan.launch_kwargs(),
        )
