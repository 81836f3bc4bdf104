"""Moving KV blocks of every layer: gather them into one contiguous buffer (for a transfer over
the network) and scatter them back, or copy them straight from one cache into another (two
workers sharing memory on one node: kernels/csrc/kv_block_copy.cpp)."""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import torch

from kernels import cpu_native
from kernels._checks import KV_DTYPES, check_same_device, check_tensor, require
from kernels._triton_compat import HAS_TRITON, cdiv, lazy_jit, tl
from kernels.plan import DeviceSpec, block_copy_plan


def _check(kv_cache, block_ids) -> None:
    check_tensor(kv_cache, "kv_cache", 6, KV_DTYPES)
    require(
        kv_cache.is_contiguous(), "kv_cache must be contiguous [L, 2, num_blocks, block_size, num_kv_heads, head_dim]"
    )
    check_tensor(block_ids, "block_ids", 1, (torch.int64, torch.int32))
    check_same_device(kv_cache=kv_cache, block_ids=block_ids)


def _check_packed(kv_cache, block_ids, packed) -> None:
    L, two, _, bs, hk, d = kv_cache.shape
    want = (L, two, block_ids.shape[0], bs, hk, d)
    check_tensor(packed, "packed", 6, (kv_cache.dtype,))
    if tuple(packed.shape) != want:
        raise ValueError(f"packed shape {tuple(packed.shape)} != {want}")
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
    src_ptr,
    dst_ptr,
    ids_ptr,
    n_ids,
    n_blocks,
    block_elems,
    SCATTER: tl.constexpr,
    BLOCK: tl.constexpr,
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
    plan = block_copy_plan(DeviceSpec.of(cache.device), scatter=scatter)
    src, dst = (packed_w, cache_w) if scatter else (cache_w, packed_w)
    _block_copy_kernel[(L * two * n, cdiv(block_elems, plan.meta["BLOCK"]))](
        src,
        dst,
        block_ids.contiguous(),
        n,
        n_blocks,
        block_elems,
        **plan.launch_kwargs(),
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


def _on_triton(kv_cache) -> bool:
    return HAS_TRITON and isinstance(kv_cache, torch.Tensor) and kv_cache.is_cuda


def pack_kv_blocks(kv_cache, block_ids) -> torch.Tensor:
    """For callers without a KernelOps (the KV transports): Triton on CUDA tensors, else the reference."""
    fn = pack_kv_blocks_triton if _on_triton(kv_cache) else pack_kv_blocks_reference
    return fn(kv_cache, block_ids)


def unpack_kv_blocks(kv_cache, block_ids, packed) -> None:
    """For callers without a KernelOps (the KV transports): Triton on CUDA tensors, else the reference."""
    fn = unpack_kv_blocks_triton if _on_triton(kv_cache) else unpack_kv_blocks_reference
    fn(kv_cache, block_ids, packed)


# -- cache to cache ------------------------------------------------------------------------------


def _check_caches(dst, src) -> None:
    for name, t in (("dst", dst), ("src", src)):
        check_tensor(t, name, 6)
        if not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous [L, 2, num_blocks, ...] cache")
    if dst.dtype != src.dtype:
        raise ValueError(f"dst dtype {dst.dtype} != src dtype {src.dtype}")
    if not (dst.shape[:2] == src.shape[:2] and dst.shape[3:] == src.shape[3:]):
        raise ValueError(f"dst {tuple(dst.shape)} and src {tuple(src.shape)} differ in more than num_blocks (dim 2)")


def _check_ids(dst_ids: Sequence[int], dst_blocks: int, src_ids: Sequence[int], src_blocks: int) -> None:
    if len(dst_ids) != len(src_ids):
        raise ValueError(f"dst_ids has {len(dst_ids)} ids but src_ids has {len(src_ids)}")
    for name, ids, n in (("dst_ids", dst_ids, dst_blocks), ("src_ids", src_ids, src_blocks)):
        if len(ids) and (min(ids) < 0 or max(ids) >= n):
            raise ValueError(f"{name} must lie in [0, {n})")


def copy_kv_blocks_reference(dst, dst_ids: Sequence[int], src, src_ids: Sequence[int]) -> None:
    """dst[:, :, dst_ids] = src[:, :, src_ids] for two caches that differ only in num_blocks."""
    _check_caches(dst, src)
    _check_ids(dst_ids, dst.shape[2], src_ids, src.shape[2])
    if len(dst_ids):
        _bytes(dst)[:, :, torch.tensor(list(dst_ids), device=dst.device)] = _bytes(src)[
            :, :, torch.tensor(list(src_ids), device=src.device)
        ]


_COPY_ARGS = (
    cpu_native.PTR,
    cpu_native.I64,
    cpu_native.I64,
    cpu_native.PTR,
    cpu_native.I64,
    cpu_native.I64,
    cpu_native.I64,
    cpu_native.I64,
    cpu_native.PTR,
    cpu_native.PTR,
    cpu_native.I64,
)


def _copy_fn():
    return cpu_native.function("kv_block_copy", "baton_copy_kv_blocks", _COPY_ARGS)


def native_built() -> bool:
    """Whether the native cache-to-cache copy (kernels/csrc/kv_block_copy.cpp) is built and loads."""
    return _copy_fn() is not None


def copy_native_available(dst, src) -> bool:
    """Whether KVBlockCopier handles this pair (both contiguous CPU tensors, built library)."""
    return (
        all(isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.is_contiguous() for t in (dst, src))
        and _copy_fn() is not None
    )


class KVBlockCopier:
    """Native block copies from one fixed CPU cache into another. Shapes, strides and pointers
    are checked and looked up once, here: the copy itself is fast, so a transfer's fixed cost
    has to stay at one C call. Keeps both tensors alive while it exists."""

    def __init__(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        _check_caches(dst, src)
        if not copy_native_available(dst, src):
            raise ValueError(f"no native CPU block copy for {dst.device} tensors")
        self._dst, self._src, self._fn = dst, src, _copy_fn()
        block_bytes = src[0, 0, 0].numel() * src.element_size()
        # [L, 2, N, ...] contiguous is [L * 2 rows, N blocks, block_bytes] in memory.
        self._call_prefix = (
            dst.data_ptr(),
            dst.shape[2] * block_bytes,
            dst.shape[2],
            src.data_ptr(),
            src.shape[2] * block_bytes,
            src.shape[2],
            src.shape[0] * src.shape[1],
            block_bytes,
        )

    def __call__(self, dst_ids: array, src_ids: array) -> None:
        """Copy src block src_ids[i] to dst block dst_ids[i]; ids as array('q')."""
        require(dst_ids.typecode == "q" and src_ids.typecode == "q", "block ids must be array('q')")
        if len(dst_ids) != len(src_ids):
            raise ValueError(f"dst_ids has {len(dst_ids)} ids but src_ids has {len(src_ids)}")
        status = self._fn(*self._call_prefix, dst_ids.buffer_info()[0], src_ids.buffer_info()[0], len(dst_ids))
        if status != 0:
            raise ValueError(
                f"block ids out of range: dst_ids must lie in [0, {self._dst.shape[2]}), "
                f"src_ids in [0, {self._src.shape[2]})"
            )


def copy_kv_blocks_cpu(dst, dst_ids: Sequence[int], src, src_ids: Sequence[int]) -> None:
    """The native CPU copy (kernels/csrc/kv_block_copy.cpp); same contract as the reference."""
    KVBlockCopier(dst, src)(array("q", dst_ids), array("q", src_ids))
