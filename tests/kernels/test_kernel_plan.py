"""The launch plans (kernels/plan.py): pure functions of a described device, checked on the CPU.

The CPU rows must stay what the interpreter tests were written against; the CUDA rows are what
tests/kernels/test_compile_targets.py compiles; docs/development.md shows the table they make.
"""

import dataclasses
import os
import re
from pathlib import Path

import pytest
import torch

from kernels import plan as P
from kernels.plan_table import plan_table

ROOT = Path(__file__).resolve().parents[2]
FP8 = torch.float8_e4m3fn
LLAMA = dict(num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=16)
CUDA = ("sm_80", "sm_89", "sm_90", "sm_100")


def test_device_spec_of_cpu_needs_no_cuda(monkeypatch):
    spec = P.DeviceSpec.of("cpu")
    assert spec.kind == "cpu" and not spec.is_cuda and spec.arch == "cpu" and spec.sm_count == 4
    # tests/kernels/conftest.py sets TRITON_INTERPRET=1, except for the GPU script's compiled run.
    assert spec.interpreted == (os.environ.get("BATON_KERNEL_TEST_DEVICE", "cpu") != "cuda")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not P.DeviceSpec.of(torch.device("cpu")).interpreted
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.kind = "cuda"


@pytest.mark.parametrize("target", ["sm_80"])
def test_fp8_refused_below_sm89_with_the_alternative(target):
    dev = P.TARGETS[target]
    assert not P.fp8_supported(dev)
    with pytest.raises(ValueError) as e:
        P.check_fp8_supported(dev)
    msg = str(e.value)
    assert "8.0" in msg and "sm_80" in msg and "A100" in msg and "8.9" in msg
    assert "kv_cache_dtype 'auto'" in msg and "quantization" in msg
    for call in (
        lambda: P.decode_attention_plan(dev, batch=1, max_ctx=1024, dtype="bfloat16", kv_dtype=FP8, **LLAMA),
        lambda: P.prefill_attention_plan(dev, max_q=64, dtype="bfloat16", kv_dtype=FP8, **LLAMA),
        lambda: P.fp8_gemm_plan(dev, M=8, N=4096, K=4096),
        lambda: P.fp8_quant_plan(dev, N=4096, dynamic_row=True, scale_per_row=True, min_scale=1e-6),
        lambda: P.store_kv_plan(dev, num_heads=8, head_dim=128, kv_dtype=FP8),
    ):
        with pytest.raises(ValueError, match="compute capability 8.0"):
            call()
    # bfloat16 KV, the alternative, plans fine there.
    P.decode_attention_plan(dev, batch=1, max_ctx=1024, dtype="bfloat16", kv_dtype="bfloat16", **LLAMA)


@pytest.mark.parametrize("target", ["sm_89", "sm_90", "sm_100", "cpu"])
def test_fp8_accepted_from_sm89(target):
    P.check_fp8_supported(P.TARGETS[target])
    P.fp8_gemm_plan(P.TARGETS[target], M=8, N=4096, K=4096)


@pytest.mark.parametrize("target", CUDA)
def test_float32_on_cuda_runs_tf32_with_small_prefill_tiles(target):
    dev = P.TARGETS[target]
    d = P.decode_attention_plan(dev, batch=8, max_ctx=4096, dtype=torch.float32, kv_dtype=torch.float32, **LLAMA)
    assert d.split.meta["DOT_F32"] and d.split.meta["PRECISION"] == "tf32"
    for max_q in (16, 64, 2048):
        p = P.prefill_attention_plan(dev, max_q=max_q, dtype=torch.float32, kv_dtype=torch.float32, **LLAMA)
        assert p.meta["PRECISION"] == "tf32" and p.meta["BLOCK_M"] <= 64 and p.meta["BLOCK_N"] == 32
    # 16-bit models keep the big tiles on long prompts.
    p = P.prefill_attention_plan(dev, max_q=2048, dtype=torch.bfloat16, kv_dtype=torch.bfloat16, **LLAMA)
    assert (p.meta["BLOCK_M"], p.num_warps) == (128, 8) and not p.meta["DOT_F32"]


@pytest.mark.parametrize("target", (*CUDA, "cpu"))
def test_a_windowed_prefill_never_has_a_query_tile_taller_than_its_key_tile(target):
    # The kernel starts a tile's key loop at its first row's first visible key: a taller query tile
    # leaves its last rows with no key at all (an H200 run of the float32 windowed tests hit this).
    dev = P.TARGETS[target]
    for dtype, kv_dtype in ((torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.bfloat16, FP8)):
        if kv_dtype == FP8 and not P.fp8_supported(dev):
            continue
        for max_q in (1, 16, 17, 64, 65, 128, 2048):
            plain = P.prefill_attention_plan(dev, max_q=max_q, dtype=dtype, kv_dtype=kv_dtype, **LLAMA)
            windowed = P.prefill_attention_plan(
                dev, max_q=max_q, dtype=dtype, kv_dtype=kv_dtype, windowed=True, **LLAMA
            )
            assert windowed.meta["BLOCK_M"] <= windowed.meta["BLOCK_N"] == plain.meta["BLOCK_N"]
            if plain.meta["BLOCK_M"] <= plain.meta["BLOCK_N"]:
                assert windowed == plain


def test_fp8_kv_reaches_bfloat16_through_float32_only_below_sm90():
    shape = dict(dtype=torch.bfloat16, kv_dtype=FP8, **LLAMA)
    for target, via in (("sm_89", True), ("sm_90", False), ("sm_100", False)):
        dev = P.TARGETS[target]
        decode = P.decode_attention_plan(dev, batch=8, max_ctx=4096, **shape).split
        prefill = P.prefill_attention_plan(dev, max_q=512, **shape)
        assert decode.meta.get("FP8_VIA_F32", False) is prefill.meta.get("FP8_VIA_F32", False) is via, target
    sm89 = P.TARGETS["sm_89"]
    assert (
        "FP8_VIA_F32"
        not in P.prefill_attention_plan(sm89, max_q=512, dtype=torch.bfloat16, kv_dtype=torch.bfloat16, **LLAMA).meta
    )


def test_cpu_plans_are_the_interpreters_original_choices():
    cpu = P.TARGETS["cpu"]
    for dtype, f32 in ((torch.float32, True), (torch.bfloat16, True), (torch.float16, False)):
        d = P.decode_attention_plan(cpu, batch=2, max_ctx=600, dtype=dtype, kv_dtype=dtype, **LLAMA)
        assert d.split.meta["BLOCK_N"] == 64 and (d.split.num_warps, d.split.num_stages) == (4, 2)
        assert d.split.meta["DOT_F32"] == f32 and d.split.meta["PRECISION"] == ("ieee" if f32 else "tf32")
        # 4 "SMs": cdiv(8, 2 * 8) = 1 split wanted.
        assert d.num_splits == 1 and d.split_len == 640
        for max_q, bm in ((16, 16), (17, 32), (64, 32), (65, 64), (4096, 64)):
            p = P.prefill_attention_plan(cpu, max_q=max_q, dtype=dtype, kv_dtype=dtype, **LLAMA)
            assert (p.meta["BLOCK_M"], p.meta["BLOCK_N"], p.num_warps, p.num_stages) == (bm, 64, 4, 2)
    d = P.decode_attention_plan(cpu, batch=1, max_ctx=4096, dtype="float32", kv_dtype="float32", num_splits=3, **LLAMA)
    assert (d.num_splits, d.split_len, d.merge.meta["BLOCK_S"]) == (3, 1408, 4)
    with pytest.raises(ValueError, match="num_splits"):
        P.decode_attention_plan(cpu, batch=1, max_ctx=64, dtype="float32", kv_dtype="float32", num_splits=0, **LLAMA)
    g = P.fp8_gemm_plan(cpu, M=5, N=40, K=300)
    assert dict(g.meta, w=g.num_warps, s=g.num_stages) == dict(
        SA_PER_ROW=False, SB_PER_COL=False, HAS_BIAS=False, BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, GROUP_M=4, w=4, s=1
    )


def test_plans_are_pure_and_cached():
    dev = P.TARGETS["sm_90"]
    a = P.prefill_attention_plan(dev, max_q=512, dtype="bfloat16", kv_dtype="bfloat16", **LLAMA)
    b = P.prefill_attention_plan(
        P.DeviceSpec("cuda", (9, 0), 132, 227 * 1024, 1024, "NVIDIA H100"),
        max_q=512,
        dtype="bfloat16",
        kv_dtype="bfloat16",
        **LLAMA,
    )
    assert a == b and hash(a) == hash(b)
    assert a.launch_kwargs() == dict(a.meta, num_warps=8, num_stages=2)


def test_docs_table_is_the_plans():
    """docs/development.md's "Kernel plans" table is what plan_table() prints for each target."""
    text = (ROOT / "docs" / "development.md").read_text()
    m = re.search(r"<!-- kernel-plans -->\n(.*?)\n<!-- /kernel-plans -->", text, re.S)
    assert m, "docs/development.md lacks the <!-- kernel-plans --> table"
    assert m.group(1).strip() == plan_table(), (
        "docs/development.md's kernel plan table is stale; paste `python -c "
        "'from kernels.plan_table import plan_table; print(plan_table())'` between its markers"
    )


def _tf32(x: torch.Tensor) -> torch.Tensor:
    """x (float32) rounded to TF32's 10-bit mantissa, to nearest with ties away (cvt.rna.tf32.f32)."""
    bits = x.float().contiguous().view(torch.int32)
    return ((bits + 0x1000) & ~0x1FFF).view(torch.float32)


@pytest.mark.parametrize("ctx", [512, 4096])
def test_tf32_attention_keeps_the_float32_contract(ctx):
    """float32 models on CUDA: attention with TF32 dots is within 1e-3 relative of float64.

    Emulated on the CPU: both dots' operands rounded to TF32 as the tensor cores do (scores: q, k;
    output: the probabilities, v), products and sums in float64."""
    g = torch.Generator().manual_seed(0)
    hq, d = 32, 128
    q = torch.randn(hq, d, generator=g) * 2
    k = torch.randn(ctx, d, generator=g) * 2
    v = torch.randn(ctx, d, generator=g)
    scale = d**-0.5
    ref = torch.softmax((q.double() @ k.double().T) * scale, -1) @ v.double()
    s = (_tf32(q).double() @ _tf32(k).double().T) * scale
    p = torch.softmax(s, -1).float()
    out = _tf32(p).double() @ _tf32(v).double()
    rel = ((out - ref).norm() / ref.norm()).item()
    assert rel < 1e-3, rel
