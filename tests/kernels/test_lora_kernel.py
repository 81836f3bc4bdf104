"""Batched LoRA (kernels/lora.py): the PyTorch grouped path, the native CPU kernel and the Triton
kernels (interpreted on CPU tensors, see conftest.py; compiled when BATON_KERNEL_TEST_DEVICE=cuda)
against the row-by-row reference, on batches that mix adapters of several ranks (zero-padded to
the max rank) and the base model, with y a column slice of a wider tensor."""

from __future__ import annotations

import re

import pytest
import torch
from kernel_testlib import DEVICE, dot_tol, gen

from kernels import lora
from kernels.device_spec import TARGETS
from kernels.lora import lora_add_reference

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (atol, rtol) against the float32 reference on outputs of magnitude ~1. The grouped PyTorch path
# rounds the rank-sized intermediate and the product to the activation dtype before adding, the
# kernels keep them in float32 (Triton rounds the intermediate to 16 bits on CUDA): a few ulps.
TOL = {torch.float32: (2e-5, 2e-5), torch.float16: (4e-3, 4e-3), torch.bfloat16: (3e-2, 3e-2)}
TRITON_TOL = dot_tol(TOL)  # TF32 dots for float32 on CUDA
PAD = (3, 5)  # y is wide[:, 3 : 3 + out] of a tensor 8 columns wider

# (rows, in, out, max_rank, slots): a decode batch (one tile of rows: unsorted, split-K in the
# interpreter's plan), a prefill-sized batch (sorted by slot, two rank tiles), ranks under 16.
CASES = [(7, 100, 40, 8, 3), (41, 48, 70, 20, 4), (20, 33, 17, 3, 2)]


def make_case(rows, width, out, rank, slots, dtype, seed=0, slot_dtype=torch.int32):
    """(wide, y, x, a, b, row_slots, scaling) on DEVICE; y = wide's column slice. Each slot holds an
    adapter of its own rank (max_rank, half of it, 1, ...), zero-padded; the rows come in runs of
    one slot or of -1 (the base model), so sorted and unsorted tiles both see several slots."""
    g = gen(seed)
    x = torch.randn(rows, width, generator=g)
    wide = torch.randn(rows, PAD[0] + out + PAD[1], generator=g)
    a = torch.randn(slots, rank, width, generator=g) * width**-0.5
    b = torch.randn(slots, out, rank, generator=g) * rank**-0.5
    for s in range(slots):
        r = max(1, rank >> s)
        a[s, r:] = 0
        b[s, :, r:] = 0
    row_slots = []
    while len(row_slots) < rows:
        slot = int(torch.randint(-1, slots, (1,), generator=g))
        row_slots += [slot] * int(torch.randint(1, 6, (1,), generator=g))
    row_slots_t = torch.tensor(row_slots[:rows], dtype=slot_dtype)
    scaling = torch.rand(slots, generator=g) + 0.5
    wide, x, a, b = (t.to(dtype).to(DEVICE) for t in (wide, x, a, b))
    y = wide[:, PAD[0] : PAD[0] + out]
    return wide, y, x, a, b, row_slots_t.to(DEVICE), scaling.to(DEVICE)


def check(impl, dtype, case, tol=TOL, seed=0, slot_dtype=torch.int32):
    wide, y, x, a, b, row_slots, scaling = make_case(*case, dtype, seed, slot_dtype)
    before = wide.clone()
    expected = lora_add_reference(y, x, a, b, row_slots, scaling)
    impl(y, x, a, b, row_slots, scaling)
    atol, rtol = tol[dtype]
    torch.testing.assert_close(y.float().cpu(), expected.float().cpu(), atol=atol, rtol=rtol)
    base = (row_slots < 0).cpu()
    assert torch.equal(y.cpu()[base], before[:, PAD[0] : PAD[0] + case[2]].cpu()[base])  # base rows: untouched
    assert torch.equal(wide[:, : PAD[0]], before[:, : PAD[0]])  # nor the columns around the slice
    assert torch.equal(wide[:, PAD[0] + case[2] :], before[:, PAD[0] + case[2] :])


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_grouped_matches_reference(dtype, case):
    check(lora.lora_add_grouped_, dtype, case)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_matches_reference(dtype, case):
    check(lora.lora_add_triton_, dtype, case, TRITON_TOL)


native = pytest.mark.skipif(DEVICE.type != "cpu" or not lora.native_built(), reason="native CPU kernel not built")


@native
@pytest.mark.parametrize("case", CASES + [(70, 600, 130, 64, 5)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_matches_reference(dtype, case):
    check(lora.lora_add_cpu_, dtype, case)


@native
def test_native_thread_count_gives_the_same_bits():
    wide, y, x, a, b, row_slots, scaling = make_case(33, 300, 150, 24, 3, torch.float32)
    threads = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            out = y.clone()
            lora.lora_add_cpu_(out, x, a, b, row_slots, scaling)
            outs.append(out)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


@pytest.mark.parametrize("dtype", DTYPES)
def test_lora_add_picks_a_path_that_matches(dtype):
    """The engine's entry point: Triton on CUDA, native on the CPU for float32 / bfloat16 where
    built, else the grouped path; int64 slot ids as well as int32."""
    check(lora.lora_add_, dtype, CASES[0], TRITON_TOL, seed=1, slot_dtype=torch.int64)


def test_lora_add_dispatch(monkeypatch):
    calls = []
    for name in ("lora_add_triton_", "lora_add_cpu_", "lora_add_grouped_"):
        monkeypatch.setattr(lora, name, lambda *args, name=name: calls.append(name))
    for dtype in DTYPES:
        _, y, x, a, b, row_slots, scaling = make_case(*CASES[0], dtype)
        lora.lora_add_(y, x, a, b, row_slots, scaling)
    if DEVICE.type == "cuda":
        assert calls == ["lora_add_triton_"] * 3
    elif lora.native_built():
        assert calls == ["lora_add_cpu_", "lora_add_grouped_", "lora_add_cpu_"]
    else:
        assert calls == ["lora_add_grouped_"] * 3


@pytest.mark.parametrize(
    "impl", [lora.lora_add_grouped_, lora.lora_add_triton_, pytest.param(lora.lora_add_cpu_, marks=native)]
)
def test_nothing_to_add(impl):
    """No rows, only base-model rows, zero slots or rank 0: y unchanged (and nothing launched fails)."""
    wide, y, x, a, b, row_slots, scaling = make_case(*CASES[0], torch.float32)
    before = wide.clone()
    impl(y, x, a, b, torch.full_like(row_slots, -1), scaling)
    impl(y[:0], x[:0], a, b, row_slots[:0], scaling)
    impl(y, x, a[:, :0], b[:, :, :0], row_slots, scaling)
    impl(y, x, a[:0], b[:0], torch.full_like(row_slots, -1), scaling[:0])
    assert torch.equal(wide, before)


def test_rejects_bad_input():
    _, y, x, a, b, row_slots, scaling = make_case(*CASES[0], torch.float32)
    bad = {
        "x [rows, in] and y": dict(x=x[:-1]),
        "shapes disagree": dict(a=a[:, :, :-1]),
        "shapes disagree ": dict(b=b[:, :-1]),
        "row_slots must be an integer": dict(row_slots=row_slots[:-1]),
        "row_slots dtype": dict(row_slots=row_slots.float()),
        "scaling must be": dict(scaling=scaling[:-1]),
        "scaling dtype": dict(scaling=scaling.double()),
        "share a dtype": dict(a=a.bfloat16()),
        "x dtype": dict(x=x.int(), y=y.int(), a=a.int(), b=b.int()),
        "y's rows must be contiguous": dict(y=y.t().contiguous().t()),
        "x must be contiguous": dict(x=x.t().contiguous().t()),
        "a must be contiguous": dict(a=a.transpose(1, 2).contiguous().transpose(1, 2)),
        "a [slots, rank, in]": dict(a=a[0]),
    }
    for impl in (lora.lora_add_, lora.lora_add_grouped_, lora.lora_add_triton_, lora.lora_add_cpu_):
        for match, change in bad.items():
            args = dict(y=y, x=x, a=a, b=b, row_slots=row_slots, scaling=scaling) | change
            with pytest.raises(ValueError, match=re.escape(match.strip())):
                impl(**args)


@pytest.mark.skipif(DEVICE.type != "cpu", reason="the CUDA path does not check slot ids (it would wait for the GPU)")
def test_slot_out_of_range_raises_on_the_cpu():
    wide, y, x, a, b, row_slots, scaling = make_case(*CASES[0], torch.float32)
    before = wide.clone()
    row_slots[2] = a.shape[0]
    impls = [lora.lora_add_, lora.lora_add_grouped_] + ([lora.lora_add_cpu_] if lora.native_built() else [])
    for impl in impls:
        with pytest.raises(ValueError, match="slot"):
            impl(y, x, a, b, row_slots, scaling)
    assert torch.equal(wide, before)


@pytest.mark.parametrize("target", ["sm_80", "sm_90", "sm_100", "cpu"])
def test_plan_splits_cover_the_input(target):
    """split_k slices of k_per_split columns (a multiple of BLOCK_K) cover the input, none empty; rows
    are sorted exactly when there is more than one row tile."""
    for rows in (1, 8, 16, 17, 300, 4096):
        for width in (1, 33, 576, 4096, 14336):
            for rank in (1, 16, 64, 256):
                p = lora.lora_plan(
                    TARGETS[target], rows=rows, in_features=width, out_features=64, rank=rank, dtype=torch.bfloat16
                )
                assert p.k_per_split % p.shrink.meta["BLOCK_K"] == 0
                assert (p.split_k - 1) * p.k_per_split < width <= p.split_k * p.k_per_split
                assert p.gather == (rows > p.block_m)
                assert p.shrink.meta["BLOCK_M"] == p.expand.meta["BLOCK_M"] == p.block_m
