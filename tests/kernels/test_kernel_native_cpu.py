"""The native CPU decode attention (kernels/csrc) against the PyTorch reference and a dense oracle."""

import math

import pytest
import torch

from kernels import cpu_native, ops
from kernels.decode_attention import (native_available, paged_decode_attention_cpu,
                                      paged_decode_attention_reference)
from kernel_testlib import ATTN_TOL, DEVICE, FP8, assert_close, make_block_tables, make_cache, randn
from test_kernel_attention import dense_kv, naive_attention

if DEVICE.type != "cpu":
    pytest.skip("native kernels are for CPU tensors", allow_module_level=True)


@pytest.fixture(autouse=True)
def _built():
    if not native_available(torch.zeros(1, 1, 1), torch.zeros(1, 1, 1, 1)):
        pytest.fail("the native decode attention did not build on this machine (a C++ compiler is expected here)")


@pytest.mark.parametrize("hq,hk", [(2, 2), (6, 2), (9, 3), (8, 1)])
@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                               (torch.float32, FP8), (torch.bfloat16, FP8)])
@pytest.mark.parametrize("block_size", [4, 16])
def test_native_decode_matches_reference(hq, hk, dtype, cache_dtype, block_size):
    D, nb = 64, 80
    lens = [1, block_size - 1, block_size, 3 * block_size + 5, 130]  # single token, partial and full pages
    max_blocks = -(-max(lens) // block_size) + 2  # garbage ids past each sequence's pages
    k, v = make_cache(nb, block_size, hk, D, cache_dtype, scale=0.05)
    bt = make_block_tables(lens, block_size, nb, max_blocks)
    cl = torch.tensor(lens, dtype=torch.int32)
    q = randn(len(lens), hq, D, dtype=dtype)
    expected = paged_decode_attention_reference(q, k, v, bt, cl, 1 / math.sqrt(D), 0.05, 0.07)
    out = paged_decode_attention_cpu(q, k, v, bt, cl, 1 / math.sqrt(D), 0.05, 0.07)
    assert out.dtype == dtype and out.shape == q.shape
    assert_close(out, expected, tol=ATTN_TOL)


def test_native_decode_matches_dense_oracle_with_strided_q():
    """q as a slice of a fused qkv row (as the model passes it) and int64 tables; float64 oracle."""
    bs, hq, hk, D = 16, 6, 2, 64
    lens = [1, 17, 300]
    k, v = make_cache(40, bs, hk, D, torch.float32)
    bt = make_block_tables(lens, bs, 40, 20).long()
    qkv = randn(3, (hq + 2 * hk) * D)
    q = qkv[:, : hq * D].view(3, hq, D)
    assert not q.is_contiguous()
    out = paged_decode_attention_cpu(q, k, v, bt, torch.tensor(lens), 0.1)
    for i, n in enumerate(lens):
        expected = naive_attention(q[i:i + 1], dense_kv(k, bt[i], n, 1.0), dense_kv(v, bt[i], n, 1.0), 0.1, [n - 1])
        torch.testing.assert_close(out[i:i + 1].double(), expected, atol=1e-5, rtol=1e-5)


def test_native_decode_rejects_bad_input():
    k, v = make_cache(8, 4, 1, 64, torch.float32)
    bt = make_block_tables([4], 4, 8, 2)
    q = randn(1, 2, 64)
    with pytest.raises(ValueError, match="context_lens must be >= 1"):
        paged_decode_attention_cpu(q, k, v, bt, torch.tensor([0], dtype=torch.int32), 0.1)
    with pytest.raises(ValueError, match="cache dtype"):
        paged_decode_attention_cpu(q.bfloat16(), k, v, bt, torch.tensor([4], dtype=torch.int32), 0.1)
    with pytest.raises(ValueError, match="no native CPU decode attention"):
        paged_decode_attention_cpu(q.half(), k.half(), v.half(), bt, torch.tensor([4], dtype=torch.int32), 0.1)


def test_context_longer_than_table_is_clamped_not_read_past():
    """A context length beyond the block table reads only the table's pages (no crash, finite output)."""
    k, v = make_cache(8, 4, 1, 64, torch.float32)
    bt = make_block_tables([8], 4, 8, 2)
    q = randn(1, 2, 64)
    long = paged_decode_attention_cpu(q, k, v, bt, torch.tensor([10_000], dtype=torch.int32), 0.1)
    exact = paged_decode_attention_reference(q, k, v, bt, torch.tensor([8], dtype=torch.int32), 0.1)
    assert_close(long, exact, tol=ATTN_TOL)


def test_ops_dispatch_uses_native_in_auto_mode_and_reference_when_forced(monkeypatch):
    calls = []
    real = paged_decode_attention_cpu
    monkeypatch.setattr("kernels.decode_attention.paged_decode_attention_cpu",
                        lambda *a, **kw: calls.append(1) or real(*a, **kw))
    k, v = make_cache(8, 4, 1, 64, torch.float32)
    bt = make_block_tables([5], 4, 8, 2)
    q, cl = randn(1, 2, 64), torch.tensor([5], dtype=torch.int32)
    monkeypatch.setenv("BATON_KERNELS", "auto")
    auto = ops.paged_decode_attention(q, k, v, bt, cl, 0.1)
    monkeypatch.setenv("BATON_KERNELS", "reference")
    ref = ops.paged_decode_attention(q, k, v, bt, cl, 0.1)
    assert calls == [1]
    assert_close(auto, ref, tol=ATTN_TOL)


def test_disabled_native_kernels_fall_back(monkeypatch):
    monkeypatch.setenv("BATON_NATIVE_KERNELS", "0")
    assert cpu_native.load("paged_decode_attention") is None


def test_library_is_cached_per_source(tmp_path, monkeypatch):
    monkeypatch.setenv("BATON_CACHE_DIR", str(tmp_path))
    cpu_native._build.cache_clear()
    try:
        assert cpu_native.load("paged_decode_attention") is not None
        built = list((tmp_path / "kernels").glob("paged_decode_attention-*.so"))
        assert len(built) == 1
        mtime = built[0].stat().st_mtime_ns
        cpu_native._build.cache_clear()
        assert cpu_native.load("paged_decode_attention") is not None
        assert built[0].stat().st_mtime_ns == mtime  # loaded from the cache, not rebuilt
    finally:
        cpu_native._build.cache_clear()
