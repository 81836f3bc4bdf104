"""Checks and the cache gather shared by the decode and prefill attention wrappers (no kernels here)."""

from __future__ import annotations

import functools

import torch

from kernels import cpu_native
from kernels._checks import FLOAT_DTYPES, check_kv_cache, check_same_device, check_scale, check_tensor, is_fp8


def check_attention(q, k_cache, v_cache, block_tables, context_lens, scale, k_scale, v_scale):
    check_tensor(q, "q", 3, FLOAT_DTYPES)
    check_kv_cache(k_cache, v_cache)
    check_tensor(block_tables, "block_tables", 2, (torch.int32, torch.int64))
    check_tensor(context_lens, "context_lens", 1, (torch.int32, torch.int64))
    _, _, hk, d = k_cache.shape
    hq = q.shape[1]
    if q.shape[2] != d:
        raise ValueError(f"q head_dim {q.shape[2]} != cache head_dim {d}")
    if not (hk > 0 and hq % hk == 0):
        raise ValueError(f"num query heads {hq} must be a multiple of num kv heads {hk}")
    if not is_fp8(k_cache.dtype):
        if k_cache.dtype != q.dtype:
            raise ValueError(f"cache dtype {k_cache.dtype} must be q dtype {q.dtype} or float8_e4m3fn")
    if block_tables.shape[0] != context_lens.shape[0]:
        raise ValueError(f"block_tables has {block_tables.shape[0]} rows, context_lens {context_lens.shape[0]}")
    if not (isinstance(scale, (int, float)) and not isinstance(scale, bool)):
        raise ValueError(f"scale must be a float, got {scale!r}")
    check_same_device(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables, context_lens=context_lens)
    return float(scale), check_scale(k_scale, "k_scale"), check_scale(v_scale, "v_scale")


def check_window_softcap(window, softcap) -> tuple[int | None, float | None]:
    """Validate the optional sliding window (tokens a query sees, itself included: transformers'
    convention, keys at positions > q - window) and attention logit soft-cap (cap * tanh(s / cap))."""
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"window must be None or an int >= 1, got {window!r}")
    if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not softcap > 0):
        raise ValueError(f"softcap must be None or a float > 0, got {softcap!r}")
    return window, None if softcap is None else float(softcap)


def softcap_scores(scores: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """cap * tanh(scores / cap) in place (Gemma 2's attention logit soft-capping); None: unchanged."""
    if softcap is not None:
        scores.div_(softcap).tanh_().mul_(softcap)
    return scores


@functools.lru_cache(maxsize=16)
def _fp8_table(device: torch.device) -> torch.Tensor:
    return torch.arange(256, dtype=torch.uint8, device=device).view(torch.float8_e4m3fn).float()


@functools.lru_cache(maxsize=64)
def scaled_fp8_table(scale: float) -> torch.Tensor:
    """float32 [256]: every float8_e4m3fn code's value times `scale` (the native CPU kernels' dequantizer)."""
    return _fp8_table(torch.device("cpu")) * scale


def native_int32(t: torch.Tensor) -> torch.Tensor:
    """`t` as int32 with a unit last stride (what the native kernels index with)."""
    t = t.to(torch.int32)
    return t.contiguous() if t.dim() and t.shape[-1] > 1 and t.stride(-1) != 1 else t


def native_cache_args(k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: float, v_scale: float) -> tuple:
    """The cache part of a native attention kernel's arguments: (k ptr, v ptr, dtype code,
    num_blocks, k FP8 table ptr, v FP8 table ptr). The tables are memoised, so they outlive the call."""
    fp8 = is_fp8(k_cache.dtype)
    return (
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        cpu_native.DTYPE_CODES[k_cache.dtype],
        k_cache.shape[0],
        scaled_fp8_table(k_scale).data_ptr() if fp8 else None,
        scaled_fp8_table(v_scale).data_ptr() if fp8 else None,
    )


def gather_kv(cache: torch.Tensor, block_ids: torch.Tensor, scale: float) -> torch.Tensor:
    """float32 [*block_ids.shape[:-1], n * block_size, Hk, D] from cache[block_ids], dequantized when FP8.

    `scale` is ignored unless the cache is FP8. index_select on the flat ids is the fastest gather
    on CPU; the result keeps the cache's row layout, which the callers read through strided views.
    """
    nb, bs, hk, d = cache.shape
    flat = block_ids.reshape(-1)
    shape = tuple(block_ids.shape[:-1]) + (block_ids.shape[-1] * bs, hk, d)
    if is_fp8(cache.dtype):
        raw = cache.view(torch.uint8).index_select(0, flat)
        # A 256-entry lookup is several times faster than torch's float8 cast on CPU.
        table = _fp8_table(cache.device) * scale
        return table.index_select(0, raw.reshape(-1).int()).view(shape)
    return cache.index_select(0, flat).float().view(shape)
