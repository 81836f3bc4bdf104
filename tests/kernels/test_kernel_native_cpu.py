"""The native CPU decode attention (kernels/csrc) against the PyTorch reference and a dense oracle."""

import math
from dataclasses import fields
from pathlib import Path

import pytest
import torch
from kernel_testlib import ATTN_TOL, DEVICE, FP8, TOL, assert_close, make_block_tables, make_cache, randn
from test_kernel_attention import _prefill_case, dense_kv, naive_attention
from test_kernel_norm_act import hf_llama_rms_norm

from kernels import cpu_native
from kernels.decode_attention import native_available, paged_decode_attention_cpu, paged_decode_attention_reference
from kernels.kv_store import store_kv_cpu, store_kv_reference
from kernels.ops import KernelOps, kernel_ops
from kernels.prefill_attention import native_available as prefill_native_available
from kernels.prefill_attention import paged_prefill_attention_cpu, paged_prefill_attention_reference
from kernels.rms_norm import rms_norm_cpu, rms_norm_reference
from kernels.rotary import build_rope_cache, rotary_embedding_cpu, rotary_embedding_reference

pytestmark = pytest.mark.slow  # 100 kernel cases and a build of the native library: about 20 s here

if DEVICE.type != "cpu":
    pytest.skip("native kernels are for CPU tensors", allow_module_level=True)


@pytest.fixture(autouse=True)
def _built():
    if not native_available(torch.zeros(1, 1, 1), torch.zeros(1, 1, 1, 1)):
        pytest.fail("the native decode attention did not build on this machine (a C++ compiler is expected here)")


@pytest.mark.parametrize("hq,hk", [(2, 2), (6, 2), (9, 3), (8, 1)])
@pytest.mark.parametrize(
    "dtype,cache_dtype",
    [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float32, FP8), (torch.bfloat16, FP8)],
)
@pytest.mark.parametrize("block_size", [4, 16])
def test_native_decode_matches_reference(hq, hk, dtype, cache_dtype, block_size):
    check_native_decode(hq, hk, dtype, cache_dtype, block_size, 64)


# Head dims 64 and 128 have register-blocked loops of their own (kHeadBlock: 4 and 2 query heads per
# block, so 8 heads per kv head take several blocks); others take the generic loop.
@pytest.mark.parametrize("D", [128, 40])
@pytest.mark.parametrize("hq,hk", [(8, 1), (6, 2), (3, 3)])
@pytest.mark.parametrize("cache_dtype", [torch.float32, FP8])
def test_native_decode_matches_reference_at_other_head_dims(D, hq, hk, cache_dtype):
    check_native_decode(hq, hk, torch.float32, cache_dtype, 16, D)


def check_native_decode(hq, hk, dtype, cache_dtype, block_size, D):
    nb = 80
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
        expected = naive_attention(q[i : i + 1], dense_kv(k, bt[i], n, 1.0), dense_kv(v, bt[i], n, 1.0), 0.1, [n - 1])
        torch.testing.assert_close(out[i : i + 1].double(), expected, atol=1e-5, rtol=1e-5)


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


def test_ops_dispatch_uses_native_in_auto_mode_and_reference_when_asked(monkeypatch):
    calls = []
    real = paged_decode_attention_cpu
    monkeypatch.setattr(
        "kernels.decode_attention.paged_decode_attention_cpu", lambda *a, **kw: calls.append(1) or real(*a, **kw)
    )
    k, v = make_cache(8, 4, 1, 64, torch.float32)
    bt = make_block_tables([5], 4, 8, 2)
    q, cl = randn(1, 2, 64), torch.tensor([5], dtype=torch.int32)
    auto = kernel_ops("auto", "cpu").paged_decode_attention(q, k, v, bt, cl, 0.1)
    ref = kernel_ops("reference", "cpu").paged_decode_attention(q, k, v, bt, cl, 0.1)
    assert calls == [1]
    assert_close(auto, ref, tol=ATTN_TOL)


def test_unbuilt_native_kernels_leave_every_op_on_the_reference(native_kernels_off):
    assert cpu_native.load("paged_decode_attention") is None
    native = kernel_ops("native", "cpu")
    reference = kernel_ops("reference", "cpu")
    assert native.backend == "native" and native == KernelOps(
        "native", **{f.name: getattr(reference, f.name) for f in fields(KernelOps) if f.name != "backend"}
    )


def test_library_is_cached_per_source(tmp_path):
    assert cpu_native.build("paged_decode_attention", tmp_path) is not None
    built = list(tmp_path.glob("paged_decode_attention-*.so"))
    assert len(built) == 1
    mtime = built[0].stat().st_mtime_ns
    assert cpu_native.build("paged_decode_attention", tmp_path) is not None
    assert built[0].stat().st_mtime_ns == mtime  # loaded from the cache, not rebuilt


# ---- RMSNorm, rotary embedding, KV store -------------------------------------------------------


@pytest.mark.parametrize(
    "dtype,w_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32)]
)
@pytest.mark.parametrize("T,H", [(1, 64), (7, 576), (3, 1000)])
def test_native_rms_norm_matches_reference(dtype, w_dtype, T, H):
    big = randn(T, 2 * H, dtype=dtype)
    x = big[:, :H]  # row stride 2H, as a slice of a wider activation
    r, w = randn(T, H, dtype=dtype, seed=1), randn(H, dtype=w_dtype, seed=2)
    assert_close(rms_norm_cpu(x, w, 1e-5), rms_norm_reference(x, w, 1e-5))
    out, summed = rms_norm_cpu(x, w, 1e-5, residual=r)
    out_ref, summed_ref = rms_norm_reference(x, w, 1e-5, residual=r)
    assert torch.equal(summed, summed_ref)  # the residual stream is exact: one rounding of x + r
    assert_close(out, out_ref)
    assert out.dtype == summed.dtype == dtype


def test_native_rms_norm_matches_hf_formula_in_float32():
    x, w = randn(5, 576), randn(576, seed=1)
    torch.testing.assert_close(rms_norm_cpu(x, w, 1e-5), hf_llama_rms_norm(x, w, 1e-5), atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq,hk,D", [(9, 3, 64), (4, 4, 128), (2, 1, 32)])
def test_native_rotary_matches_reference(dtype, hq, hk, D):
    T = 6
    cache = build_rope_cache(D, 512, 10000.0, None)
    positions = torch.tensor([0, 1, 17, 200, 511, 3])
    qkv = randn(T, (hq + 2 * hk) * D, dtype=dtype)  # q and k as views of the fused projection
    q, k = qkv[:, : hq * D].view(T, hq, D), qkv[:, hq * D : (hq + hk) * D].view(T, hk, D)
    q2, k2 = q.clone(), k.clone()
    v_before = qkv[:, (hq + hk) * D :].clone()
    rotary_embedding_cpu(positions, q, k, cache)
    rotary_embedding_reference(positions, q2, k2, cache)
    assert_close(q, q2, tol=TOL)
    assert_close(k, k2, tol=TOL)
    assert torch.equal(qkv[:, (hq + hk) * D :], v_before)  # v, beside k in the same rows, untouched


def test_native_rotary_rejects_positions_past_the_cache():
    cache = build_rope_cache(64, 16, 10000.0, None)
    q, k = randn(2, 2, 64), randn(2, 1, 64)
    with pytest.raises(ValueError, match=r"positions must lie in \[0, 16\)"):
        rotary_embedding_cpu(torch.tensor([3, 16]), q, k, cache)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_store_kv_matches_reference_bit_for_bit(dtype):
    nb, bs, hk, D, T = 6, 4, 3, 64, 7
    kv = randn(T, 2 * hk * D, dtype=dtype)
    key, value = kv[:, : hk * D].view(T, hk, D), kv[:, hk * D :].view(T, hk, D)
    slots = torch.tensor([0, 5, -1, 23, 9, -1, 10])
    k1 = torch.zeros(nb, bs, hk, D, dtype=dtype)
    v1, k2, v2 = k1.clone(), k1.clone(), k1.clone()
    store_kv_cpu(key, value, k1, v1, slots)
    store_kv_reference(key, value, k2, v2, slots)
    assert torch.equal(k1, k2) and torch.equal(v1, v2)
    assert torch.equal(k1[5, 3], key[3]) and k1.count_nonzero() == 5 * hk * D


def test_native_store_kv_rejects_slots_past_the_cache_and_fp8():
    k, v = torch.zeros(2, 4, 1, 64), torch.zeros(2, 4, 1, 64)
    key = randn(1, 1, 64)
    with pytest.raises(ValueError, match="slot past the cache's 8 slots"):
        store_kv_cpu(key, key, k, v, torch.tensor([8]))
    assert k.count_nonzero() == 0
    with pytest.raises(ValueError, match="no native CPU store_kv"):
        store_kv_cpu(key, key, k.to(FP8), v.to(FP8), torch.tensor([1]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,inter", [(1, 64), (9, 1536), (4, 100)])
def test_native_silu_and_mul_matches_reference(dtype, T, inter):
    from kernels.silu_mul import silu_and_mul_cpu, silu_and_mul_reference

    x = randn(T, 2 * inter + 8, dtype=dtype, scale=3.0)[:, : 2 * inter]  # row stride past the row
    out = silu_and_mul_cpu(x)
    assert out.dtype == dtype and out.shape == (T, inter)
    assert_close(out, silu_and_mul_reference(x))
    gate, up = x[:, :inter].double(), x[:, inter:].double()  # float64 oracle, written out
    torch.testing.assert_close(
        out.double(),
        gate / (1 + torch.exp(-gate)) * up,
        **({"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 1e-2}),
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_silu_and_mul_extreme_gates(dtype):
    """The vector path computes sigmoid from exp(-|g|): no overflow for large |g|, and inf/NaN
    behave as in g / (1 + exp(-g)). 32 gates, so both halves go through the 16-lane path."""
    from kernels.silu_mul import silu_and_mul_cpu

    special = [
        0.0,
        -0.0,
        1e-30,
        -1e-30,
        20.0,
        -20.0,
        88.0,
        -88.0,
        100.0,
        -100.0,
        1e4,
        -1e4,
        float("inf"),
        float("-inf"),
        float("nan"),
        0.5,
    ]
    gate = torch.tensor(special + [-x for x in special], dtype=torch.float64)
    up = torch.linspace(-2, 2, gate.numel(), dtype=torch.float64)
    x = torch.cat([gate, up]).view(1, -1).to(dtype)
    out = silu_and_mul_cpu(x).double()
    g, u = x[:, : gate.numel()].double(), x[:, gate.numel() :].double()
    torch.testing.assert_close(
        out, g / (1 + torch.exp(-g)) * u, atol=1e-6, rtol=1e-2 if dtype == torch.bfloat16 else 1e-5, equal_nan=True
    )


# ---- prefill attention ---------------------------------------------------------------------------


@pytest.mark.parametrize("hq,hk", [(9, 3), (4, 4), (8, 1)])
@pytest.mark.parametrize(
    "dtype,cache_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.bfloat16, FP8)]
)
@pytest.mark.parametrize("D", [64, 128])
def test_native_prefill_matches_reference(hq, hk, dtype, cache_dtype, D):
    # Whole prompts, a chunk after a cached prefix that ends mid-page, a single token, and one query
    # block plus a partial one (65 new tokens) after 100 cached: causal masks inside and across tiles.
    qlens, ctxs = [70, 9, 1, 65], [70, 30, 17, 165]
    q, k, v, bt, qsl, cl = _prefill_case(qlens, ctxs, hq, hk, D, cache_dtype, dtype, bs=16)
    assert prefill_native_available(q, k)
    expected = paged_prefill_attention_reference(q, k, v, bt, qsl, cl, 1 / math.sqrt(D), 0.05, 0.05)
    out = paged_prefill_attention_cpu(q, k, v, bt, qsl, cl, 1 / math.sqrt(D), 0.05, 0.05)
    assert out.dtype == dtype
    assert_close(out, expected, tol=ATTN_TOL)


def test_native_prefill_matches_dense_oracle():
    qlens, ctxs = [33, 5], [100, 5]
    q, k, v, bt, qsl, cl = _prefill_case(qlens, ctxs, 6, 2, 64, torch.float32, torch.float32, bs=16)
    out = paged_prefill_attention_cpu(q, k, v, bt, qsl, cl, 0.1)
    start = 0
    for i, (ql, n) in enumerate(zip(qlens, ctxs)):
        kd, vd = dense_kv(k, bt[i], n, 1.0), dense_kv(v, bt[i], n, 1.0)
        expected = naive_attention(q[start : start + ql], kd, vd, 0.1, list(range(n - ql, n)))
        torch.testing.assert_close(out[start : start + ql].double(), expected, atol=1e-5, rtol=1e-5)
        start += ql


def test_native_prefill_rejects_bad_input_and_dispatch_falls_back_for_other_block_sizes():
    q, k, v, bt, qsl, cl = _prefill_case([4], [4], 2, 1, 64, torch.float32, torch.float32, bs=16)
    with pytest.raises(ValueError, match="more new tokens than context"):
        paged_prefill_attention_cpu(q, k, v, bt, qsl, torch.tensor([3], dtype=torch.int32), 0.1)
    with pytest.raises(ValueError, match="query_start_loc must run from 0 to 4"):
        paged_prefill_attention_cpu(q, k, v, bt, torch.tensor([0, 3], dtype=torch.int32), cl, 0.1)
    q4, k4, v4, bt4, qsl4, cl4 = _prefill_case([4], [4], 2, 1, 64, torch.float32, torch.float32, bs=4)
    assert not prefill_native_available(q4, k4)  # block size 4 is not compiled: ops uses the reference
    assert_close(
        kernel_ops("auto", "cpu").paged_prefill_attention(q4, k4, v4, bt4, qsl4, cl4, 0.1),
        paged_prefill_attention_reference(q4, k4, v4, bt4, qsl4, cl4, 0.1),
        tol=ATTN_TOL,
    )


def test_unwritable_cache_or_broken_compiler_falls_back_to_pytorch(tmp_path, monkeypatch):
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("")  # the cache directory cannot be created under a file
    assert cpu_native.build("rms_norm", blocker / "kernels") is None
    monkeypatch.setenv("CXX", "false")  # a "compiler" that always fails
    monkeypatch.setattr(cpu_native.shutil, "which", lambda name: "/bin/false" if name == "false" else None)
    assert cpu_native.build("rms_norm", tmp_path / "cache") is None
    # A library that does not load leaves its op on the reference, chosen when the ops are built.
    monkeypatch.setattr(cpu_native, "function", lambda name, symbol, argtypes: None)
    calls = []
    monkeypatch.setattr(
        "kernels.rms_norm.rms_norm_reference", lambda *a, **kw: calls.append(1) or rms_norm_reference(*a, **kw)
    )
    x, w = randn(2, 64), randn(64, seed=1)
    assert_close(kernel_ops("auto", "cpu").rms_norm(x, w, 1e-5), rms_norm_reference(x, w, 1e-5))
    assert calls == [1]  # ops fell back to the PyTorch reference


def test_loading_the_native_kernels_keeps_subnormal_floats():
    """A library linked with crtfastmath.o (GCC's -ffast-math) would set flush-to-zero process-wide
    when it loads; subnormals must survive loading every kernel, in Python and in torch."""
    import subprocess
    import sys

    code = (
        "from kernels import cpu_native; import torch\n"
        "assert all(cpu_native.build_all().values())\n"
        "x = 5e-324\n"
        "assert x * 1.0 != 0.0, 'python flushes subnormals'\n"
        "assert (torch.tensor([1e-40]) * 1.0).item() != 0.0, 'torch flushes subnormals'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=str(Path(__file__).resolve().parents[2]))
