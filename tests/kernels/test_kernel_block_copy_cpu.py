"""The native cache-to-cache block copy (kernels/csrc/kv_block_copy.cpp) against a block-by-block
loop written here and against the torch reference: every run structure, pieces longer than the
8 KiB interleave unit, block sizes that rule out streaming stores, an unaligned destination, bad
input, and the fallback when the native library does not load."""

from __future__ import annotations

import random
from array import array

import pytest
import torch

from kernels import cpu_native
from kernels.block_copy import (
    KVBlockCopier,
    copy_kv_blocks_cpu,
    copy_kv_blocks_reference,
    copy_native_available,
)

pytestmark = pytest.mark.skipif(cpu_native.load("kv_block_copy") is None, reason="no C++ compiler")

# (L, 2, bs, Hk, D, dtype): bytes per block and row 64, 60 (no streaming stores), 12 KiB (one 8 KiB
# piece plus a 4 KiB one), 256 in FP8.
SHAPES = {
    "64B": (2, 2, 1, 8, torch.float32),
    "60B_unaligned_rows": (3, 3, 1, 5, torch.float32),
    "12KiB": (2, 16, 3, 64, torch.float32),
    "fp8_256B": (2, 4, 2, 32, torch.float8_e4m3fn),
}
SRC_BLOCKS, DST_BLOCKS = 40, 33


def make_cache(shape, num_blocks: int, seed: int, base_offset: int = 0) -> torch.Tensor:
    layers, bs, hk, d, dtype = shape
    full = (layers, 2, num_blocks, bs, hk, d)
    numel = layers * 2 * num_blocks * bs * hk * d
    itemsize = torch.empty((), dtype=dtype).element_size()
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (numel * itemsize + base_offset,), dtype=torch.uint8, generator=g)
    # base_offset > 0 moves the cache off the allocator's 64-byte alignment.
    return raw[base_offset:].view(dtype).view(full)


def block_by_block(dst, dst_ids, src, src_ids) -> torch.Tensor:
    out = dst.view(torch.uint8).clone()
    for s, d in zip(src_ids, dst_ids):
        out[:, :, d] = src.view(torch.uint8)[:, :, s]
    return out


def id_structures():
    rng = random.Random(7)
    yield "empty", [], []
    yield "one_run", list(range(5, 25)), list(range(10, 30))
    yield "all_scattered", rng.sample(range(SRC_BLOCKS), 30), rng.sample(range(DST_BLOCKS), 30)
    yield "runs_break_differently", [0, 1, 2, 3, 7, 8, 9], [10, 11, 5, 6, 7, 8, 20]
    yield "reversed", list(range(20, 2, -1)), list(range(3, 21))
    yield "repeated_src", [5, 5, 6, 5, 39], [0, 1, 2, 3, 32]
    yield "whole_dst", rng.choices(range(SRC_BLOCKS), k=DST_BLOCKS), rng.sample(range(DST_BLOCKS), DST_BLOCKS)


STRUCTURES = {name: (s, d) for name, s, d in id_structures()}


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("structure", sorted(STRUCTURES))
def test_native_copy_matches_block_loop_and_reference(shape, structure):
    src_ids, dst_ids = STRUCTURES[structure]
    src = make_cache(SHAPES[shape], SRC_BLOCKS, 1)
    src_before = src.view(torch.uint8).clone()
    dst = make_cache(SHAPES[shape], DST_BLOCKS, 2)
    want = block_by_block(dst, dst_ids, src, src_ids)
    ref = dst.clone()
    copy_kv_blocks_reference(ref, dst_ids, src, src_ids)
    assert torch.equal(ref.view(torch.uint8), want)
    copy_kv_blocks_cpu(dst, dst_ids, src, src_ids)
    assert torch.equal(dst.view(torch.uint8), want)
    assert torch.equal(src.view(torch.uint8), src_before)  # only read


@pytest.mark.parametrize("offset", [4, 16, 36])
def test_unaligned_destination_uses_plain_stores_and_lands_exactly(offset):
    shape = SHAPES["12KiB"]
    src = make_cache(shape, SRC_BLOCKS, 3)
    dst = make_cache(shape, DST_BLOCKS, 4, base_offset=offset)
    assert dst.data_ptr() % 64 != 0
    src_ids, dst_ids = STRUCTURES["all_scattered"]
    want = block_by_block(dst, dst_ids, src, src_ids)
    copy_kv_blocks_cpu(dst, dst_ids, src, src_ids)
    assert torch.equal(dst.view(torch.uint8), want)


def test_copier_reused_across_calls_and_byte_views():
    src = make_cache(SHAPES["64B"], SRC_BLOCKS, 5)
    dst = make_cache(SHAPES["64B"], DST_BLOCKS, 6)
    copier = KVBlockCopier(dst.view(torch.uint8), src.view(torch.uint8))
    want = dst.view(torch.uint8).clone()
    for src_ids, dst_ids in (([3, 4], [0, 1]), ([39], [32]), ([4, 3], [1, 0])):
        want = block_by_block(want, dst_ids, src, src_ids)
        copier(array("q", dst_ids), array("q", src_ids))
        assert torch.equal(dst.view(torch.uint8), want)


def test_bad_input_is_a_value_error_naming_the_problem():
    src = make_cache(SHAPES["64B"], SRC_BLOCKS, 1)
    dst = make_cache(SHAPES["64B"], DST_BLOCKS, 2)
    with pytest.raises(ValueError, match=r"dst_ids must lie in \[0, 33\)"):
        copy_kv_blocks_reference(dst, [DST_BLOCKS], src, [0])
    copier = KVBlockCopier(dst, src)
    before = dst.clone()
    for dst_ids, src_ids in (([DST_BLOCKS], [0]), ([0], [-1]), ([0], [SRC_BLOCKS])):
        with pytest.raises(ValueError, match="out of range"):
            copier(array("q", dst_ids), array("q", src_ids))
    assert torch.equal(dst.view(torch.uint8), before.view(torch.uint8))  # nothing written
    with pytest.raises(ValueError, match="2 ids but src_ids has 1"):
        copier(array("q", [0, 1]), array("q", [0]))
    with pytest.raises(ValueError, match=r"array\('q'\)"):
        copier(array("i", [0]), array("i", [0]))
    other = make_cache(SHAPES["60B_unaligned_rows"], DST_BLOCKS, 2)
    with pytest.raises(ValueError, match="differ in more than num_blocks"):
        KVBlockCopier(other, src)
    with pytest.raises(ValueError, match="dtype"):
        KVBlockCopier(dst.view(torch.uint8), src)
    with pytest.raises(ValueError, match="contiguous"):
        KVBlockCopier(dst[:, :, ::2], src)


def test_native_copy_off_falls_back(native_kernels_off):
    src = make_cache(SHAPES["64B"], SRC_BLOCKS, 1)
    dst = make_cache(SHAPES["64B"], DST_BLOCKS, 2)
    assert not copy_native_available(dst, src)
    with pytest.raises(ValueError, match="no native CPU block copy"):
        KVBlockCopier(dst, src)
