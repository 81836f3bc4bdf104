"""Gather KV blocks of every layer into one contiguous buffer (for a transfer) and scatter them back."""

from __future__ import annotations

import torch

from kernels._checks import KV_DTYPES, check_same_device, check_tensor, require
from kernels._triton_compat import cdiv, lazy_jit, tl


def _check(kv_cache, block_ids) -> None:
    check_tensor(kv_cache, "kv_cache", 6, KV_DTYPES)
    require(kv_cache.is_contiguous(),
            "kv_cache must be contiguous [L, 2, num_blocks, block_size, num_kv_heads, head_dim]")
    check_tensor(block_ids, "block_ids", 1, (torch.int64, torch.int32))
    check_same_device(kv_cache=kv_cache, block_ids=block_ids)


def _check_packed(kv_cache, block_ids, packed) -> None:
    L, two, _, bs, hk, d = kv_cache.shape
    want = (L, two, block_ids.shape[0], bs, hk, d)
    check_tensor(packed, "packed", 6, (kv_cache.dtype,))
    require(tuple(packed.shape) == want, f"packed shape {tuple(packed.shape)} != {want}")
    require(packed.is_contiguous(), "packed must be contiguous")
    check_same_device(kv_cache=kv_cache, packed=packed)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    # Advanced indexing is not implemented for float8 everywhere; moving bytes needs no dtype.
    return t.view(torch.uint8) if t.element_size() == 1 else t


def pack_kv_blocks_reference(kv_cache, block_ids) -> torch.Tensor:
    _check(kv_cache, block_ids)
    return _bytes(kv_cache)[:, :, block_ids.long()].contiguous().view(kv_cache.dtype)


def unpack_kv_blocks_reference(kv_cache, block_ids, packed) -> None:
    _check(kv_cache, block_ids)
    _check_packed(kv_cache, block_ids, packed)
    if block_ids.numel():
        _bytes(kv_cache)[:, :, block_ids.long()] = _bytes(packed)


@lazy_jit
def _block_copy_kernel(
    src_ptr, dst_ptr, ids_ptr, n_ids, n_blocks, block_elems,
    SCATTER: tl.constexpr, BLOCK: tl.constexpr,
):
    # Grid: (L * 2 * n_ids, chunks of one block). SCATTER picks which side block_ids indexes.
    pid = tl.program_id(0).to(tl.int64)
    plane = pid // n_ids
    i = pid % n_ids
    blk = tl.load(ids_ptr + i).to(tl.int64)
    cache_off = (plane * n_blocks + blk) * block_elems
    packed_off = (plane * n_ids + i) * block_elems
    if SCATTER:
        src_off = packed_off
        dst_off = cache_off
    else:
        src_off = cache_off
        dst_off = packed_off
    offs = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < block_elems
    tl.store(dst_ptr + dst_off + offs, tl.load(src_ptr + src_off + offs, mask=m), mask=m)


def _as_words(t: torch.Tensor) -> torch.Tensor:
    """The same bytes as the widest integer word that divides a row, so each thread moves up to 8 bytes."""
    row_bytes = t.shape[-1] * t.element_size()
    for word in (torch.int64, torch.int32, torch.int16):
        size = torch.empty((), dtype=word).element_size()
        if row_bytes % size == 0 and t.data_ptr() % size == 0:
            return t.view(torch.uint8).view(word) if t.element_size() == 1 else t.view(word)
    return _bytes(t)


def _launch(cache, packed, block_ids, scatter: bool) -> None:
    L, two, n_blocks, bs, hk, d = cache.shape
    n = block_ids.shape[0]
    if n == 0 or L == 0 or bs * hk * d == 0:
        return
    cache_w, packed_w = _as_words(cache), _as_words(packed)
    if cache_w.dtype != packed_w.dtype:
        cache_w, packed_w = _bytes(cache), _bytes(packed)
    block_elems = bs * hk * cache_w.shape[-1]
    block = 1024
    src, dst = (packed_w, cache_w) if scatter else (cache_w, packed_w)
    _block_copy_kernel[(L * two * n, cdiv(block_elems, block))](
        src, dst, block_ids.contiguous(), n, n_blocks, block_elems,
        SCATTER=scatter, BLOCK=block, num_warps=4,
    )


def pack_kv_blocks_triton(kv_cache, block_ids) -> torch.Tensor:
    _check(kv_cache, block_ids)
    L, two, _, bs, hk, d = kv_cache.shape
    packed = torch.empty((L, two, block_ids.shape[0], bs, hk, d), dtype=kv_cache.dtype, device=kv_cache.device)
    _launch(kv_cache, packed, block_ids, scatter=False)
    return packed


def unpack_kv_blocks_triton(kv_cache, block_ids, packed) -> None:
    _check(kv_cache, block_ids)
    _check_packed(kv_cache, block_ids, packed)
    _launch(kv_cache, packed, block_ids, scatter=True)
