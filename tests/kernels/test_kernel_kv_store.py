"""KV store into the paged cache (with FP8 quantization) and block pack/unpack for transfers."""

import pytest
import torch
from kernel_testlib import DEVICE, FP8, ops, randn

from kernels.block_copy import pack_kv_blocks_reference, unpack_kv_blocks_reference
from kernels.kv_store import store_kv_reference


def bits(t):
    return t.view(torch.uint8) if t.element_size() == 1 else t


@pytest.mark.parametrize(
    "cache_dtype,act_dtype",
    [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (FP8, torch.float16), (FP8, torch.bfloat16)],
)
@pytest.mark.parametrize("D,hk", [(64, 1), (128, 3)])
def test_store_kv_matches_reference(cache_dtype, act_dtype, D, hk):
    nb, bs, T = 6, 4, 7
    # key/value as strided views of a fused kv projection output, as the engine passes them.
    kv = randn(T, 2 * hk * D, dtype=act_dtype, scale=4.0)
    key, value = kv[:, : hk * D].view(T, hk, D), kv[:, hk * D :].view(T, hk, D)
    slots = torch.tensor([0, 5, -1, 23, 9, -1, 10], device=DEVICE)  # slot 23 is the last of block 5
    k1 = torch.zeros(nb, bs, hk, D, dtype=cache_dtype, device=DEVICE)
    v1, k2, v2 = k1.clone(), k1.clone(), k1.clone()
    ops.store_kv(key, value, k1, v1, slots, 0.05, 0.5)
    store_kv_reference(key, value, k2, v2, slots, 0.05, 0.5)
    assert torch.equal(bits(k1), bits(k2)) and torch.equal(bits(v1), bits(v2))


def test_store_kv_reference_oracle():
    nb, bs, hk, D = 3, 4, 2, 64
    key, value = randn(3, hk, D), randn(3, hk, D, seed=1)
    k, v = torch.zeros(nb, bs, hk, D, device=DEVICE), torch.zeros(nb, bs, hk, D, device=DEVICE)
    store_kv_reference(key, value, k, v, torch.tensor([6, -1, 0], device=DEVICE))
    assert torch.equal(k[1, 2], key[0]) and torch.equal(v[0, 0], value[2])
    assert k.count_nonzero() == 2 * hk * D
    kq, vq = torch.zeros(nb, bs, hk, D, dtype=FP8, device=DEVICE), torch.zeros(nb, bs, hk, D, dtype=FP8, device=DEVICE)
    store_kv_reference(key * 100, value, kq, vq, torch.tensor([6, -1, 0], device=DEVICE), k_scale=0.25)
    expected = (key[0] * 100 / 0.25).clamp(-448, 448).to(FP8)
    assert torch.equal(bits(kq[1, 2]), bits(expected))
    assert kq[1, 2].float().abs().max() == 448  # out-of-range values saturate, never NaN
    assert not kq.float().isnan().any()


def test_store_kv_empty_and_bad_input():
    k = torch.zeros(2, 4, 1, 64, device=DEVICE)
    v = k.clone()
    ops.store_kv(randn(0, 1, 64), randn(0, 1, 64), k, v, torch.zeros(0, dtype=torch.int64, device=DEVICE))
    assert k.count_nonzero() == 0
    with pytest.raises(ValueError, match="slot_mapping"):
        ops.store_kv(randn(2, 1, 64), randn(2, 1, 64), k, v, torch.zeros(3, dtype=torch.int64, device=DEVICE))
    with pytest.raises(ValueError, match="heads"):
        ops.store_kv(randn(2, 2, 64), randn(2, 2, 64), k, v, torch.zeros(2, dtype=torch.int64, device=DEVICE))
    with pytest.raises(ValueError, match="contiguous"):
        ops.store_kv(
            randn(2, 1, 64), randn(2, 1, 64), k[:, :2], v[:, :2], torch.zeros(2, dtype=torch.int64, device=DEVICE)
        )


@pytest.mark.parametrize("dtype", [torch.float16, FP8])
def test_pack_unpack_round_trip(dtype):
    L, nb, bs, hk, D = 2, 7, 4, 2, 64
    cache = randn(L, 2, nb, bs, hk, D, scale=10.0).to(dtype)
    ids = torch.tensor([5, 0, 3], device=DEVICE)
    packed = ops.pack_kv_blocks(cache, ids)
    assert packed.shape == (L, 2, 3, bs, hk, D) and packed.is_contiguous() and packed.dtype == dtype
    assert torch.equal(bits(packed), bits(pack_kv_blocks_reference(cache, ids)))
    assert torch.equal(bits(packed[1, 0, 1]), bits(cache[1, 0, 0]))
    dst, dst_ref = torch.zeros_like(cache), torch.zeros_like(cache)
    dst_ids = torch.tensor([1, 6, 2], device=DEVICE)
    ops.unpack_kv_blocks(dst, dst_ids, packed)
    unpack_kv_blocks_reference(dst_ref, dst_ids, packed)
    assert torch.equal(bits(dst), bits(dst_ref))
    assert torch.equal(bits(dst[:, :, 6]), bits(cache[:, :, 0]))
    assert bits(dst[:, :, 0]).count_nonzero() == 0


def test_pack_empty_and_bad_input():
    cache = randn(1, 2, 3, 4, 1, 64)
    none = torch.zeros(0, dtype=torch.int64, device=DEVICE)
    assert ops.pack_kv_blocks(cache, none).shape == (1, 2, 0, 4, 1, 64)
    ops.unpack_kv_blocks(cache, none, ops.pack_kv_blocks(cache, none))
    with pytest.raises(ValueError, match="packed shape"):
        ops.unpack_kv_blocks(cache, torch.tensor([0], device=DEVICE), randn(1, 2, 2, 4, 1, 64))
    with pytest.raises(ValueError, match="6 dims"):
        ops.pack_kv_blocks(cache[0], none)
