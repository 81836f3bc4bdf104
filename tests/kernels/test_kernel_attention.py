"""Paged decode and prefill attention: Triton against reference, reference against a naive dense oracle."""

import math

import pytest
import torch
from kernel_testlib import ATTN_TOL, DEVICE, FP8, assert_close, make_block_tables, make_cache, ops, randn

from kernels.decode_attention import paged_decode_attention_reference, paged_decode_attention_triton
from kernels.prefill_attention import paged_prefill_attention_reference


def dense_kv(cache, block_table, n, scale):
    """The first n tokens of one sequence as float64 [n, Hk, D], the slow obvious way."""
    rows = []
    for p in range(n):
        rows.append(cache[int(block_table[p // cache.shape[1]]), p % cache.shape[1]].double())
    kv = torch.stack(rows)
    return kv * scale if cache.dtype == FP8 else kv


def naive_attention(q, k, v, scale, q_pos):
    """q [m, Hq, D] at positions q_pos attends to k/v [n, Hk, D] at positions <= its own; float64."""
    hq, hk = q.shape[1], k.shape[1]
    out = torch.empty(q.shape, dtype=torch.float64)
    for h in range(hq):
        kh, vh = k[:, h // (hq // hk)].cpu(), v[:, h // (hq // hk)].cpu()
        for i in range(q.shape[0]):
            s = (kh[: q_pos[i] + 1] @ q[i, h].double().cpu()) * scale
            out[i, h] = torch.softmax(s, 0) @ vh[: q_pos[i] + 1]
    return out


# (Hq, Hk) covers GQA ratios 1, 3 and 8.
HEADS = [(2, 2), (6, 2), (8, 1)]


@pytest.mark.parametrize("cache_dtype", [torch.float32, FP8])
def test_decode_reference_matches_naive(cache_dtype):
    bs, hq, hk, D = 4, 6, 2, 64
    lens = [1, 9, 16]
    k, v = make_cache(12, bs, hk, D, cache_dtype, scale=0.5)
    bt = make_block_tables(lens, bs, 12, 5)
    q = randn(3, hq, D)
    out = paged_decode_attention_reference(
        q, k, v, bt, torch.tensor(lens, dtype=torch.int32, device=DEVICE), 0.1, k_scale=0.5, v_scale=0.5
    )
    for i, n in enumerate(lens):
        kd, vd = dense_kv(k, bt[i], n, 0.5), dense_kv(v, bt[i], n, 0.5)
        expected = naive_attention(q[i : i + 1], kd, vd, 0.1, [n - 1])
        torch.testing.assert_close(out[i : i + 1].double().cpu(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("hq,hk", HEADS)
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_triton_matches_reference(hq, hk, D, dtype):
    bs, nb = 4, 40
    lens = [1, 7, 70]  # a single token, a partial block, and more than one 64-token tile
    k, v = make_cache(nb, bs, hk, D, dtype)
    bt = make_block_tables(lens, bs, nb, 20)
    cl = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    q = randn(3, hq, D, dtype=dtype)
    expected = paged_decode_attention_reference(q, k, v, bt, cl, 1 / math.sqrt(D))
    assert_close(ops.paged_decode_attention(q, k, v, bt, cl, 1 / math.sqrt(D)), expected, tol=ATTN_TOL)


@pytest.mark.parametrize("num_splits", [2, 5])
@pytest.mark.parametrize("cache_dtype", [torch.float16, FP8])
def test_decode_split_k_and_fp8(num_splits, cache_dtype):
    bs, nb, hq, hk, D = 16, 28, 8, 1, 64
    lens = [3, 130, 200, 64]  # sequence 0 leaves most splits empty
    k, v = make_cache(nb, bs, hk, D, cache_dtype, scale=0.02)
    bt = make_block_tables(lens, bs, nb, 13)
    cl = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    q = randn(4, hq, D, dtype=torch.float16)
    expected = paged_decode_attention_reference(q, k, v, bt, cl, 0.125, 0.02, 0.03)
    out = paged_decode_attention_triton(q, k, v, bt, cl, 0.125, 0.02, 0.03, num_splits=num_splits)
    assert_close(out, expected, tol=ATTN_TOL)


def test_decode_empty_batch_and_bad_input():
    k, v = make_cache(4, 4, 2, 64, torch.float32)
    empty = ops.paged_decode_attention(
        randn(0, 4, 64),
        k,
        v,
        torch.zeros(0, 2, dtype=torch.int32, device=DEVICE),
        torch.zeros(0, dtype=torch.int32, device=DEVICE),
        0.1,
    )
    assert empty.shape == (0, 4, 64)
    bt = torch.zeros(1, 2, dtype=torch.int32, device=DEVICE)
    cl = torch.ones(1, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="multiple"):
        ops.paged_decode_attention(randn(1, 3, 64), k, v, bt, cl, 0.1)
    with pytest.raises(ValueError, match="head_dim"):
        ops.paged_decode_attention(randn(1, 4, 32), k, v, bt, cl, 0.1)
    with pytest.raises(ValueError, match="dtype"):
        ops.paged_decode_attention(randn(1, 4, 64, dtype=torch.float16), k, v, bt, cl, 0.1)


def _prefill_case(qlens, ctxs, hq, hk, D, cache_dtype, q_dtype, bs=4, seed=0):
    nb = sum(-(-c // bs) for c in ctxs) + 2
    k, v = make_cache(nb, bs, hk, D, cache_dtype, seed=seed + 1, scale=0.05)
    bt = make_block_tables(ctxs, bs, nb, max(-(-c // bs) for c in ctxs) + 1)
    qsl = torch.tensor([0] + list(qlens), dtype=torch.int32).cumsum(0).to(torch.int32).to(DEVICE)
    cl = torch.tensor(ctxs, dtype=torch.int32, device=DEVICE)
    q = randn(sum(qlens), hq, D, dtype=q_dtype, seed=seed)
    return q, k, v, bt, qsl, cl


@pytest.mark.parametrize("cache_dtype", [torch.float32, FP8])
def test_prefill_reference_matches_naive(cache_dtype):
    qlens, ctxs = [5, 1, 3], [5, 10, 7]  # no prefix, single decode-like token, cached prefix of 4
    q, k, v, bt, qsl, cl = _prefill_case(qlens, ctxs, 6, 2, 64, cache_dtype, torch.float32)
    out = paged_prefill_attention_reference(q, k, v, bt, qsl, cl, 0.1, 0.05, 0.05)
    start = 0
    for i, (ql, n) in enumerate(zip(qlens, ctxs)):
        kd, vd = dense_kv(k, bt[i], n, 0.05), dense_kv(v, bt[i], n, 0.05)
        expected = naive_attention(q[start : start + ql], kd, vd, 0.1, list(range(n - ql, n)))
        torch.testing.assert_close(out[start : start + ql].double().cpu(), expected, atol=1e-5, rtol=1e-5)
        start += ql


@pytest.mark.parametrize("hq,hk", HEADS)
@pytest.mark.parametrize("D", [64, 128])
def test_prefill_triton_matches_reference(hq, hk, D):
    # 17 new tokens spanning two 16-row tiles after a 6-token prefix; one single-token sequence.
    qlens, ctxs = [17, 1, 4], [23, 1, 4]
    q, k, v, bt, qsl, cl = _prefill_case(qlens, ctxs, hq, hk, D, torch.float16, torch.float16)
    expected = paged_prefill_attention_reference(q, k, v, bt, qsl, cl, 1 / math.sqrt(D))
    out = ops.paged_prefill_attention(q, k, v, bt, qsl, cl, 1 / math.sqrt(D))
    assert_close(out, expected, tol=ATTN_TOL)


@pytest.mark.parametrize("cache_dtype,q_dtype", [(FP8, torch.bfloat16), (torch.float32, torch.float32)])
def test_prefill_long_prefix_fp8_and_noncontiguous_q(cache_dtype, q_dtype):
    qlens, ctxs = [40, 3], [70, 3]
    q, k, v, bt, qsl, cl = _prefill_case(qlens, ctxs, 4, 2, 64, cache_dtype, q_dtype, bs=16)
    q_view = torch.cat([q, q], dim=-1)[..., :64]  # head stride 128, unit last stride
    expected = paged_prefill_attention_reference(q, k, v, bt, qsl, cl, 0.125, 0.05, 0.05)
    out = ops.paged_prefill_attention(q_view, k, v, bt, qsl, cl, 0.125, 0.05, 0.05)
    assert_close(out, expected, tol=ATTN_TOL)


def test_prefill_empty_and_bad_input():
    q, k, v, bt, qsl, cl = _prefill_case([2], [2], 2, 2, 64, torch.float32, torch.float32)
    zero_qsl = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    assert ops.paged_prefill_attention(q[:0], k, v, bt, zero_qsl, cl, 0.1).shape == (0, 2, 64)
    assert ops.paged_prefill_attention(q[:0], k, v, bt[:0], zero_qsl[:1], cl[:0], 0.1).shape == (0, 2, 64)
    with pytest.raises(ValueError, match="query_start_loc"):
        ops.paged_prefill_attention(q, k, v, bt, qsl[:1], cl, 0.1)


def test_split_merge_matches_reference():
    from kernels.decode_attention_reduce import merge_splits_reference, merge_splits_triton

    mid_o = randn(2, 3, 5, 64)
    mid_lse = randn(2, 3, 5, seed=1, scale=4.0)
    mid_lse[0, :, 2:] = float("-inf")  # empty splits carry no weight
    out = torch.empty(2, 3, 64, device=DEVICE)
    merge_splits_triton(mid_o, mid_lse, out)
    assert_close(out, merge_splits_reference(mid_o, mid_lse))
    # With one live split the merge is that split's output.
    assert_close(
        merge_splits_reference(mid_o, mid_lse)[0],
        mid_o[0, :, :2].mul(torch.softmax(mid_lse[0, :, :2] * math.log(2), -1)[..., None]).sum(1),
    )


def test_decode_int64_metadata():
    k, v = make_cache(8, 4, 2, 64, torch.float32)
    bt = make_block_tables([5, 3], 4, 8, 3).long()
    cl = torch.tensor([5, 3], dtype=torch.int64, device=DEVICE)
    q = randn(2, 4, 64)
    assert_close(
        ops.paged_decode_attention(q, k, v, bt, cl, 0.125),
        paged_decode_attention_reference(q, k, v, bt, cl, 0.125),
        tol=ATTN_TOL,
    )
