"""Kernels on CUDA at serving-sized shapes (skipped without CUDA): auto dispatch picks Triton, results match."""

import math

import pytest
import torch

from kernels.decode_attention import paged_decode_attention_reference
from kernels.fp8_gemm import fp8_gemm_reference
from kernels.ops import kernel_ops
from kernels.prefill_attention import paged_prefill_attention_reference

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(autouse=True)
def _compiled(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


@pytest.fixture
def ops():
    return kernel_ops("auto", "cuda")


def test_auto_dispatch_uses_triton_on_cuda(ops):
    assert ops.backend == "triton"
    assert kernel_ops("auto", "cpu").backend == "native"


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_decode_long_context_split_k(cache_dtype, ops):
    B, hq, hk, D, bs = 4, 32, 8, 128, 16
    lens = [1, 1000, 8191, 8192]
    nblk = 8192 // bs
    g = torch.Generator(device="cuda").manual_seed(0)
    k = torch.randn(B * nblk, bs, hk, D, device="cuda", generator=g).to(cache_dtype)
    v = torch.randn(B * nblk, bs, hk, D, device="cuda", generator=g).to(cache_dtype)
    bt = torch.randperm(B * nblk, device="cuda", generator=g).to(torch.int32).view(B, nblk)
    q = torch.randn(B, hq, D, device="cuda", dtype=torch.bfloat16, generator=g)
    cl = torch.tensor(lens, dtype=torch.int32, device="cuda")
    out = ops.paged_decode_attention(q, k, v, bt, cl, 1 / math.sqrt(D), 0.1, 0.1)
    ref = paged_decode_attention_reference(q, k, v, bt, cl, 1 / math.sqrt(D), 0.1, 0.1)
    torch.testing.assert_close(out.float(), ref.float(), atol=3e-2, rtol=3e-2)


def test_prefill_chunk_with_prefix(ops):
    hq, hk, D, bs = 32, 8, 128, 16
    qlens, ctxs = [512, 1, 300], [2048, 77, 300]
    nblk = 2048 // bs
    g = torch.Generator(device="cuda").manual_seed(1)
    k = torch.randn(3 * nblk, bs, hk, D, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(3 * nblk, bs, hk, D, device="cuda", dtype=torch.bfloat16, generator=g)
    bt = torch.randperm(3 * nblk, device="cuda", generator=g).to(torch.int32).view(3, nblk)
    q = torch.randn(sum(qlens), hq, D, device="cuda", dtype=torch.bfloat16, generator=g)
    qsl = torch.tensor([0, 512, 513, 813], dtype=torch.int32, device="cuda")
    cl = torch.tensor(ctxs, dtype=torch.int32, device="cuda")
    out = ops.paged_prefill_attention(q, k, v, bt, qsl, cl, 1 / math.sqrt(D))
    ref = paged_prefill_attention_reference(q, k, v, bt, qsl, cl, 1 / math.sqrt(D))
    torch.testing.assert_close(out.float(), ref.float(), atol=3e-2, rtol=3e-2)


def test_fp8_gemm_large(ops):
    g = torch.Generator(device="cuda").manual_seed(2)
    for M in (1, 16, 300, 2048):
        a, sa = ops.scaled_fp8_quant(torch.randn(M, 4096, device="cuda", generator=g), per_token=True)
        b, sb = ops.scaled_fp8_quant(torch.randn(1024, 4096, device="cuda", generator=g), per_token=True)
        out = ops.fp8_gemm(a, b, sa, sb, torch.bfloat16)
        ref = fp8_gemm_reference(a, b, sa, sb, torch.bfloat16)
        rel = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
        assert rel < 1e-2, (M, rel)
