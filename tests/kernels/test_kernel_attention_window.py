"""Sliding-window and soft-capped paged attention: each reference against a naive float64 oracle, the
Triton kernels (interpreted) and the native CPU kernels against the references, with windows shorter
than the contexts. Freed blocks (ids -1) before a window prove the kernels skip them, not mask them.
"""

import math

import pytest
import torch
from kernel_testlib import ATTN_TOL, DEVICE, FP8, assert_close, make_block_tables, make_cache, randn
from test_kernel_attention import dense_kv

from kernels.decode_attention import native_available as decode_native_available
from kernels.decode_attention import (
    paged_decode_attention_cpu,
    paged_decode_attention_reference,
    paged_decode_attention_triton,
)
from kernels.prefill_attention import native_available as prefill_native_available
from kernels.prefill_attention import (
    paged_prefill_attention_cpu,
    paged_prefill_attention_reference,
    paged_prefill_attention_triton,
)

pytestmark = pytest.mark.slow  # windowed attention kernels, Triton ones in the interpreter: about 7 s here


def naive_windowed(q, k, v, scale, q_pos, window, softcap):
    """q [m, Hq, D] at q_pos sees keys in (pos - window, pos]; logits capped; float64."""
    hq, hk = q.shape[1], k.shape[1]
    out = torch.empty(q.shape, dtype=torch.float64)
    for h in range(hq):
        kh, vh = k[:, h // (hq // hk)].cpu(), v[:, h // (hq // hk)].cpu()
        for i in range(q.shape[0]):
            lo = 0 if window is None else max(0, q_pos[i] - window + 1)
            s = (kh[lo : q_pos[i] + 1] @ q[i, h].double().cpu()) * scale
            if softcap is not None:
                s = softcap * torch.tanh(s / softcap)
            out[i, h] = torch.softmax(s, 0) @ vh[lo : q_pos[i] + 1]
    return out


def free_outside_window(bt, lens, bs, window, q_lens=None):
    """Mark the blocks no query of each row can see as freed (-1), as the block manager leaves them."""
    bt = bt.clone()
    for i, n in enumerate(lens):
        first_q = n - (1 if q_lens is None else q_lens[i])
        bt[i, : max(0, first_q - window + 1) // bs] = -1
    return bt


WINDOW_CAP = [(None, 5.0), (7, None), (20, 2.0), (1, None)]


@pytest.mark.parametrize("window,softcap", WINDOW_CAP)
def test_decode_reference_matches_naive_windowed(window, softcap):
    bs, hq, hk, D = 4, 6, 2, 64
    lens = [1, 9, 30, 45]
    k, v = make_cache(40, bs, hk, D, torch.float32)
    bt = make_block_tables(lens, bs, 40, 12)
    if window is not None:
        dense = [(dense_kv(k, bt[i], n, 1.0), dense_kv(v, bt[i], n, 1.0)) for i, n in enumerate(lens)]
        bt = free_outside_window(bt, lens, bs, window)
    else:
        dense = [(dense_kv(k, bt[i], n, 1.0), dense_kv(v, bt[i], n, 1.0)) for i, n in enumerate(lens)]
    q = randn(len(lens), hq, D)
    out = paged_decode_attention_reference(
        q, k, v, bt, torch.tensor(lens, dtype=torch.int32, device=DEVICE), 0.3, window=window, softcap=softcap
    )
    for i, n in enumerate(lens):
        expected = naive_windowed(q[i : i + 1], *dense[i], 0.3, [n - 1], window, softcap)
        torch.testing.assert_close(out[i : i + 1].double().cpu(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window,softcap", WINDOW_CAP)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_triton_matches_reference_windowed(window, softcap, num_splits):
    bs, nb, hq, hk, D = 4, 60, 6, 2, 64
    lens = [1, 7, 70, 130]  # a window inside a page, across pages, and past a 64-token tile
    k, v = make_cache(nb, bs, hk, D, torch.float32)
    bt = make_block_tables(lens, bs, nb, 40)
    if window is not None:
        bt = free_outside_window(bt, lens, bs, window)
    cl = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    q = randn(len(lens), hq, D)
    expected = paged_decode_attention_reference(q, k, v, bt, cl, 1 / math.sqrt(D), window=window, softcap=softcap)
    out = paged_decode_attention_triton(
        q, k, v, bt, cl, 1 / math.sqrt(D), window=window, softcap=softcap, num_splits=num_splits
    )
    assert_close(out, expected, tol=ATTN_TOL)


def _prefill_case(qlens, ctxs, hq, hk, D, dtype, bs, window):
    nb = sum(-(-c // bs) for c in ctxs) + 2
    k, v = make_cache(nb, bs, hk, D, dtype, seed=3)
    bt = make_block_tables(ctxs, bs, nb, max(-(-c // bs) for c in ctxs) + 1)
    dense = [(dense_kv(k, bt[i], n, 1.0), dense_kv(v, bt[i], n, 1.0)) for i, n in enumerate(ctxs)]
    if window is not None:
        bt = free_outside_window(bt, ctxs, bs, window, qlens)
    qsl = torch.tensor([0] + list(qlens), dtype=torch.int32).cumsum(0).to(torch.int32).to(DEVICE)
    cl = torch.tensor(ctxs, dtype=torch.int32, device=DEVICE)
    q = randn(sum(qlens), hq, D, dtype=dtype, seed=4)
    return q, k, v, bt, qsl, cl, dense


@pytest.mark.parametrize("window,softcap", WINDOW_CAP)
def test_prefill_reference_matches_naive_windowed(window, softcap):
    qlens, ctxs = [23, 1, 6, 40], [23, 30, 50, 75]  # whole prompt, decode-like, chunk after a prefix
    q, k, v, bt, qsl, cl, dense = _prefill_case(qlens, ctxs, 6, 2, 64, torch.float32, 4, window)
    out = paged_prefill_attention_reference(q, k, v, bt, qsl, cl, 0.2, window=window, softcap=softcap)
    start = 0
    for i, (ql, n) in enumerate(zip(qlens, ctxs)):
        expected = naive_windowed(q[start : start + ql], *dense[i], 0.2, list(range(n - ql, n)), window, softcap)
        torch.testing.assert_close(out[start : start + ql].double().cpu(), expected, atol=1e-5, rtol=1e-5)
        start += ql


@pytest.mark.parametrize("window,softcap", WINDOW_CAP)
def test_prefill_triton_matches_reference_windowed(window, softcap):
    qlens, ctxs = [70, 1, 6], [70, 30, 50]  # more than one 64-row tile of queries
    q, k, v, bt, qsl, cl, _ = _prefill_case(qlens, ctxs, 4, 2, 64, torch.float32, 4, window)
    expected = paged_prefill_attention_reference(q, k, v, bt, qsl, cl, 0.125, window=window, softcap=softcap)
    out = paged_prefill_attention_triton(q, k, v, bt, qsl, cl, 0.125, window=window, softcap=softcap)
    assert_close(out, expected, tol=ATTN_TOL)


@pytest.mark.parametrize("window,softcap", WINDOW_CAP + [(100, None)])
@pytest.mark.parametrize("cache_dtype", [torch.float32, FP8])
def test_native_decode_matches_reference_windowed(window, softcap, cache_dtype):
    if DEVICE.type != "cpu":
        pytest.skip("native kernels are CPU-only")
    bs, nb, hq, hk, D = 16, 40, 8, 2, 64
    lens = [1, 17, 100, 300]
    k, v = make_cache(nb, bs, hk, D, cache_dtype, scale=0.05)
    bt = make_block_tables(lens, bs, nb, 20)
    if window is not None:
        bt = free_outside_window(bt, lens, bs, window)
    cl = torch.tensor(lens, dtype=torch.int32)
    q = randn(len(lens), hq, D)
    if not decode_native_available(q, k):
        pytest.skip("native decode attention did not build")
    expected = paged_decode_attention_reference(q, k, v, bt, cl, 0.125, 0.05, 0.05, window=window, softcap=softcap)
    out = paged_decode_attention_cpu(q, k, v, bt, cl, 0.125, 0.05, 0.05, window=window, softcap=softcap)
    assert_close(out, expected, tol=ATTN_TOL)


@pytest.mark.parametrize("window,softcap", WINDOW_CAP + [(100, 3.0)])
@pytest.mark.parametrize("D", [64, 128])
def test_native_prefill_matches_reference_windowed(window, softcap, D):
    if DEVICE.type != "cpu":
        pytest.skip("native kernels are CPU-only")
    qlens, ctxs = [150, 1, 20, 70], [150, 40, 90, 200]  # several 64-query blocks, chunks after prefixes
    q, k, v, bt, qsl, cl, _ = _prefill_case(qlens, ctxs, 4, 2, D, torch.float32, 16, window)
    if not prefill_native_available(q, k):
        pytest.skip("native prefill attention did not build")
    expected = paged_prefill_attention_reference(q, k, v, bt, qsl, cl, 0.1, window=window, softcap=softcap)
    out = paged_prefill_attention_cpu(q, k, v, bt, qsl, cl, 0.1, window=window, softcap=softcap)
    assert_close(out, expected, tol=ATTN_TOL)


def test_window_and_softcap_are_checked():
    k, v = make_cache(4, 4, 2, 64, torch.float32)
    bt = torch.zeros(1, 2, dtype=torch.int32, device=DEVICE)
    cl = torch.ones(1, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="window"):
        paged_decode_attention_reference(randn(1, 4, 64), k, v, bt, cl, 0.1, window=0)
    with pytest.raises(ValueError, match="softcap"):
        paged_decode_attention_reference(randn(1, 4, 64), k, v, bt, cl, 0.1, softcap=-1.0)


# ---- GeGLU (Gemma's MLP activation) ---------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gelu_tanh_and_mul_triton_matches_reference_and_transformers(dtype):
    from transformers.activations import ACT2FN

    from kernels.gelu_tanh_and_mul import gelu_tanh_and_mul_reference, gelu_tanh_and_mul_triton

    x = randn(7, 2 * 300, dtype=dtype, scale=3.0)  # 300 columns: a partial tile; |x| up to ~10 saturates tanh
    ref = gelu_tanh_and_mul_reference(x)
    hf = ACT2FN["gelu_pytorch_tanh"](x[:, :300].float()) * x[:, 300:].float()
    assert_close(ref, hf.to(dtype))
    assert_close(gelu_tanh_and_mul_triton(x), ref)
    assert gelu_tanh_and_mul_triton(randn(0, 8)).shape == (0, 4)
    with pytest.raises(ValueError, match="even"):
        gelu_tanh_and_mul_reference(randn(2, 5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_gelu_tanh_and_mul_matches_reference(dtype):
    from kernels.gelu_tanh_and_mul import gelu_tanh_and_mul_cpu, gelu_tanh_and_mul_reference, native_available

    if DEVICE.type != "cpu":
        pytest.skip("native kernels are CPU-only")
    x = torch.cat([torch.randn(5, 2 * 37) * 4, torch.full((1, 74), 1e-4), torch.full((1, 74), -30.0)]).to(dtype)
    if not native_available(x):
        pytest.skip("native gelu_tanh_and_mul did not build")
    view = torch.cat([x, x], dim=1)[:, :74]  # row stride 148, unit last stride
    assert_close(gelu_tanh_and_mul_cpu(view), gelu_tanh_and_mul_reference(view))
