"""Per-block integrity sums of paged KV blocks: what a KV transfer's receiver checks before a
sequence may run on the blocks (kvtransfer.integrity seals them with the transfer's identity).

Definition. Block b of a cache `[L, 2, num_blocks, block_size, Hk, D]` is L * 2 pieces (one per
layer and K/V) of P bytes. Its words are the pieces in row order, each read as little-endian
64-bit words (a tail of P % 8 bytes zero-extended into one more word); with t the position of a
word in the block, the block's sums are

    s1 = sum_t w_t              s2 = sum_t w_t * (2t + 1)          (mod 2^64)

Why this sum and not crc32: it is two adds and a multiply per 8 bytes, which vectorise (AVX-512DQ
has a 64-bit multiply) and keep up with memory, so the native copy computes it on the way
(kernels/csrc/kv_block_checksum.cpp) and the receiver's pass over its blocks is one read at memory
speed; zlib.crc32 over the same bytes is several times slower than the copy itself
(bench/kv_transfer.py --checksum-cost records both). What it guarantees: any single flipped bit
changes s1 (by +-2^k); two changed words that cancel in s1 (d_a = -d_b) still change s2 by
2 d_a (t_a - t_b), which is zero only when d_a (t_a - t_b) is a multiple of 2^63; moved or
swapped words change s2 unless the words are equal. Blocks swapped, duplicated or left stale
are caught by the seal (kvtransfer.integrity), which mixes each block's position in the transfer
and the transfer's key into the value compared. It is not a cryptographic hash: it guards
against faults, not an adversary.

Implementations, all equal to `block_sums_reference` (numpy) bit for bit: the native CPU code
(`BlockSummer`, whose `follow` sums blocks while a copy in another process lands them, and
`SummingCopier`, which copies blocks between two caches and sums the source as it goes, or copies
the same way without the sums), and a Triton kernel for GPU caches (`block_sums_triton`, one
program per block). The native sums run at the speed a core reads memory (13-15 GB/s from
memory on the development VM, 28 GB/s on hot buffers), so no wider or faster arithmetic would
make the receiver's pass cheaper; only its overlap with the copy can.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import numpy as np
import torch

from kernels import cpu_native
from kernels._checks import check_same_device, check_tensor, require
from kernels._triton_compat import HAS_TRITON, lazy_jit, tl
from kernels.plan import DeviceSpec, block_sums_plan

_U64 = np.dtype("<u8")


def _check_cache(kv_cache, block_ids) -> None:
    check_tensor(kv_cache, "kv_cache", 6)
    require(
        kv_cache.is_contiguous(), "kv_cache must be contiguous [L, 2, num_blocks, block_size, num_kv_heads, head_dim]"
    )
    check_tensor(block_ids, "block_ids", 1, (torch.int64, torch.int32))
    check_same_device(kv_cache=kv_cache, block_ids=block_ids)


def sums_of_rows(rows: np.ndarray, ids: Sequence[int]) -> np.ndarray:
    """The reference on a numpy `[rows, num_blocks, P]` uint8 view: uint64 `[n, 2]` (s1, s2)."""
    R, _, P = rows.shape
    idx = np.asarray(ids, dtype=np.int64)
    n = len(idx)
    W = (P + 7) // 8
    sel = np.zeros((n, R, W * 8), dtype=np.uint8)
    sel[:, :, :P] = rows[:, idx].transpose(1, 0, 2)
    words = sel.view(_U64).reshape(n, R * W)
    weights = 2 * np.arange(R * W, dtype=np.uint64) + np.uint64(1)
    out = np.empty((n, 2), dtype=np.uint64)
    with np.errstate(over="ignore"):
        out[:, 0] = words.sum(axis=1, dtype=np.uint64)
        out[:, 1] = (words * weights).sum(axis=1, dtype=np.uint64)
    return out


def _rows(kv_cache: torch.Tensor) -> np.ndarray:
    b = kv_cache.detach().cpu().contiguous().view(torch.uint8)
    return b.numpy().reshape(b.shape[0] * b.shape[1], b.shape[2], -1)


def block_sums_reference(kv_cache: torch.Tensor, block_ids: torch.Tensor) -> np.ndarray:
    """uint64 `[n, 2]`: (s1, s2) of blocks `block_ids` of `kv_cache` (see the module doc)."""
    _check_cache(kv_cache, block_ids)
    return sums_of_rows(_rows(kv_cache), block_ids.cpu().tolist())


# -- native CPU --------------------------------------------------------------------------------

_P, _I = cpu_native.PTR, cpu_native.I64
_SUMS_ARGS = (_P, _I, _I, _I, _I, _P, _I, _P)
_COPY_SUMS_ARGS = (_P, _I, _I, _P, _I, _I, _I, _I, _P, _P, _I, _P, _I, _P, _I)
_FOLLOW_ARGS = (_P, _I, _I, _I, _I, _P, _I, _P, _P, _P, _P, _I, _I)


def _sums_fn():
    return cpu_native.function("kv_block_checksum", "baton_kv_block_sums", _SUMS_ARGS)


def _copy_sums_fn():
    return cpu_native.function("kv_block_checksum", "baton_copy_kv_blocks_summed", _COPY_SUMS_ARGS)


def _follow_fn():
    return cpu_native.function("kv_block_checksum", "baton_kv_block_sums_follow", _FOLLOW_ARGS)


def _check_word(a: np.ndarray, what: str, writeable: bool = False) -> None:
    require(
        isinstance(a, np.ndarray)
        and a.dtype == np.int64
        and a.shape == (1,)
        and a.ctypes.data % 8 == 0
        and (a.flags.writeable or not writeable),
        f"{what} must be an 8-byte aligned int64 array of one element",
    )


def native_available(*tensors: torch.Tensor) -> bool:
    """Whether the native sums (kernels/csrc/kv_block_checksum.cpp) serve these tensors."""
    return (
        all(isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.is_contiguous() for t in tensors)
        and _sums_fn() is not None
    )


def _geometry(t: torch.Tensor) -> tuple[int, int, int, int]:
    """(row stride, num_blocks, rows, piece bytes) of a contiguous `[L, 2, N, ...]` tensor."""
    check_tensor(t, "kv_cache", 6)
    require(t.is_contiguous(), "kv_cache must be contiguous")
    piece = t[0, 0, 0].numel() * t.element_size()
    return t.shape[2] * piece, t.shape[2], t.shape[0] * t.shape[1], piece


class BlockSummer:
    """Native sums of blocks of one fixed CPU cache (geometry looked up once: one C call per use)."""

    def __init__(self, kv_cache: torch.Tensor) -> None:
        if not native_available(kv_cache):
            raise ValueError(f"no native block sums for this {kv_cache.device} tensor")
        self._cache, self._fn = kv_cache, _sums_fn()
        stride, self._num_blocks, rows, piece = _geometry(kv_cache)
        self._prefix = (kv_cache.data_ptr(), stride, self._num_blocks, rows, piece)

    def __call__(self, ids: array) -> np.ndarray:
        require(ids.typecode == "q", "block ids must be array('q')")
        out = np.empty((len(ids), 2), dtype=np.uint64)
        if self._fn(*self._prefix, ids.buffer_info()[0], len(ids), out.ctypes.data) != 0:
            raise ValueError(f"block ids must lie in [0, {self._num_blocks})")
        return out

    def follow(
        self,
        ids: array,
        out: np.ndarray,
        done: np.ndarray,
        landed: np.ndarray,
        state: np.ndarray,
        busy_state: int,
        max_wait_s: float,
    ) -> int:
        """Sum blocks `ids[done[0]:]` into `out` as a copy in another process lands them (the
        counter of SummingCopier's `landed`); return how many blocks, from the first, are summed.
        `done` (a one-element int64 array) is kept current as it goes, each count stored after
        the sums it covers: another thread may read it and sum only the rest.

        It returns once every landed block is summed and either `state` (a one-element int64
        array, e.g. the transfer's slot state in shared memory) is no longer `busy_state`, or
        nothing new landed for `max_wait_s`. Between chunks it keeps its core (pause, then
        yield) instead of sleeping."""
        require(ids.typecode == "q", "block ids must be array('q')")
        n = len(ids)
        require(
            isinstance(out, np.ndarray)
            and out.dtype == np.uint64
            and out.shape == (n, 2)
            and out.flags.c_contiguous
            and out.flags.writeable,
            f"out must be a writeable uint64 [{n}, 2] array",
        )
        _check_word(done, "done", writeable=True)
        _check_word(landed, "landed")
        _check_word(state, "state")
        if not 0 <= int(done[0]) <= n:
            raise ValueError(f"done must lie in [0, {n}], got {int(done[0])}")
        if max_wait_s < 0 or max_wait_s != max_wait_s:
            raise ValueError(f"max_wait_s must be >= 0, got {max_wait_s!r}")
        fn = _follow_fn()
        require(fn is not None, "the native block sums are not available")
        if (
            fn(
                *self._prefix,
                ids.buffer_info()[0],
                n,
                out.ctypes.data,
                done.ctypes.data,
                landed.ctypes.data,
                state.ctypes.data,
                int(busy_state),
                int(max_wait_s * 1e9),
            )
            != 0
        ):
            raise ValueError(f"block ids must lie in [0, {self._num_blocks})")
        return int(done[0])


class SummingCopier:
    """Native copy of blocks from one fixed CPU cache into another (as kernels.block_copy's
    KVBlockCopier) that returns the sums of the bytes it copied, taken as it copies."""

    def __init__(self, dst: torch.Tensor, src: torch.Tensor, streaming: bool = True) -> None:
        """`streaming`: let the copy bypass the CPU caches (non-temporal stores) where it can."""
        if not native_available(dst, src) or _copy_sums_fn() is None:
            raise ValueError("no native summing copy for these tensors")
        d_stride, self._dst_blocks, rows, piece = _geometry(dst)
        s_stride, self._src_blocks, s_rows, s_piece = _geometry(src)
        if (rows, piece) != (s_rows, s_piece) or dst.dtype != src.dtype:
            raise ValueError(f"dst {tuple(dst.shape)} and src {tuple(src.shape)} differ in more than num_blocks")
        self._dst, self._src, self._fn, self._streaming = dst, src, _copy_sums_fn(), int(streaming)
        self._prefix = (
            dst.data_ptr(),
            d_stride,
            self._dst_blocks,
            src.data_ptr(),
            s_stride,
            self._src_blocks,
            rows,
            piece,
        )

    def __call__(
        self, dst_ids: array, src_ids: array, landed: np.ndarray | None = None, chunk_blocks: int = 0, sums: bool = True
    ) -> np.ndarray | None:
        """Copy pairs (dst_ids[i], src_ids[i]); uint64 `[n, 2]` sums of the bytes copied per pair.
        `sums` False: the same copy without the sums (returns None), for a sender with checksums
        off, so that the two differ by the sums alone.

        `landed`: a one-element int64 array (e.g. a view into shared memory). The copy then goes
        `chunk_blocks` pairs at a time and after each chunk stores into it how many pairs have
        fully landed, after making the chunk's bytes visible: another process that reads the count
        may read those blocks while the rest is still being copied."""
        require(dst_ids.typecode == "q" and src_ids.typecode == "q", "block ids must be array('q')")
        if len(dst_ids) != len(src_ids):
            raise ValueError(f"dst_ids has {len(dst_ids)} ids but src_ids has {len(src_ids)}")
        counter = 0
        if landed is not None:
            require(
                isinstance(landed, np.ndarray)
                and landed.dtype == np.int64
                and landed.shape == (1,)
                and landed.flags.writeable
                and landed.ctypes.data % 8 == 0,
                "landed must be a writeable, 8-byte aligned int64 array of one element",
            )
            require(
                isinstance(chunk_blocks, int) and chunk_blocks > 0,
                f"chunk_blocks must be a positive int with a landed counter, got {chunk_blocks!r}",
            )
            counter = landed.ctypes.data
        out = np.empty((len(dst_ids), 2), dtype=np.uint64) if sums else None
        if (
            self._fn(
                *self._prefix,
                dst_ids.buffer_info()[0],
                src_ids.buffer_info()[0],
                len(dst_ids),
                None if out is None else out.ctypes.data,
                self._streaming,
                counter or None,
                chunk_blocks if counter else 0,
            )
            != 0
        ):
            raise ValueError(
                f"block ids out of range: dst_ids must lie in [0, {self._dst_blocks}), "
                f"src_ids in [0, {self._src_blocks})"
            )
        return out


# -- Triton (GPU caches) ------------------------------------------------------------------------


@lazy_jit
def _block_sums_kernel(words_ptr, ids_ptr, out_ptr, n_blocks, rows, piece_words, BLOCK: tl.constexpr):
    # One program per block: walk its L * 2 pieces, BLOCK words at a time, in int64 (wraps mod 2^64).
    i = tl.program_id(0).to(tl.int64)
    blk = tl.load(ids_ptr + i).to(tl.int64)
    acc1 = tl.zeros([BLOCK], dtype=tl.int64)
    acc2 = tl.zeros([BLOCK], dtype=tl.int64)
    for r in range(0, rows):
        base = (r * n_blocks + blk) * piece_words
        for start in range(0, piece_words, BLOCK):
            offs = start + tl.arange(0, BLOCK).to(tl.int64)
            m = offs < piece_words
            w = tl.load(words_ptr + base + offs, mask=m, other=0)
            t = r * piece_words + offs
            acc1 += w
            acc2 += w * (2 * t + 1)
    tl.store(out_ptr + 2 * i, tl.sum(acc1, axis=0))
    tl.store(out_ptr + 2 * i + 1, tl.sum(acc2, axis=0))


def block_sums_triton(kv_cache: torch.Tensor, block_ids: torch.Tensor, block: int | None = None) -> np.ndarray:
    """The Triton kernel (CUDA, or TRITON_INTERPRET=1 on the CPU); pieces must be whole 8-byte words."""
    _check_cache(kv_cache, block_ids)
    require(HAS_TRITON, "Triton is not installed")
    L, two, n_blocks = kv_cache.shape[:3]
    piece = kv_cache[0, 0, 0].numel() * kv_cache.element_size()
    require(piece % 8 == 0, f"the Triton block sums need pieces of whole 8-byte words, got {piece} bytes")
    require(kv_cache.data_ptr() % 8 == 0, "kv_cache must be 8-byte aligned")
    n = block_ids.shape[0]
    out = torch.zeros((n, 2), dtype=torch.int64, device=kv_cache.device)
    if n and L:
        words = (
            kv_cache.view(torch.uint8).view(torch.int64) if kv_cache.element_size() == 1 else kv_cache.view(torch.int64)
        )
        plan = block_sums_plan(DeviceSpec.of(kv_cache.device))
        launch = dict(plan.launch_kwargs(), **({"BLOCK": block} if block else {}))
        _block_sums_kernel[(n,)](words, block_ids.contiguous(), out, n_blocks, L * two, piece // 8, **launch)
    return out.cpu().numpy().view(np.uint64)


def block_sums(kv_cache: torch.Tensor, block_ids: torch.Tensor) -> np.ndarray:
    """For callers without a fixed cache: Triton on CUDA tensors, native on the CPU, else the reference."""
    if HAS_TRITON and kv_cache.is_cuda:
        piece = kv_cache[0, 0, 0].numel() * kv_cache.element_size() if kv_cache.dim() == 6 else 0
        if piece % 8 == 0:
            return block_sums_triton(kv_cache, block_ids)
    if native_available(kv_cache) and block_ids.device.type == "cpu":
        _check_cache(kv_cache, block_ids)
        return BlockSummer(kv_cache)(array("q", block_ids.tolist()))
    return block_sums_reference(kv_cache, block_ids)
