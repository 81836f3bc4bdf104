"""The AMX bf16x3 linear kernel (kernels/amx_linear.py) against its float64 reference of the same three
bfloat16 products, and against float64 F.linear: far closer than bfloat16, and row by row the same bits
alone or in any batch."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from kernels import amx_linear, small_m_linear

if not amx_linear.ready():
    pytest.skip("no AMX-BF16 here (or the kernel does not build)", allow_module_level=True)


def tiles(weight: torch.Tensor) -> torch.Tensor:
    return amx_linear.pack_weight(small_m_linear.pack_weight(weight))


@pytest.mark.parametrize("out_features,in_features", [(16, 1), (48, 33), (80, 100), (960, 576), (576, 1536)])
@pytest.mark.parametrize("rows", [1, 15, 16, 17, 32, 33, 64, 65, 130])
def test_matches_the_bf16x3_reference_and_float32_closely(out_features, in_features, rows):
    g = torch.Generator().manual_seed(rows * 1000 + out_features)
    weight = torch.randn(out_features, in_features, generator=g) * in_features**-0.5
    bias = torch.randn(out_features, generator=g)
    x = torch.randn(rows, in_features, generator=g)
    out = amx_linear.amx_linear_cpu(x, tiles(weight), bias)
    assert out.dtype == torch.float32 and out.shape == (rows, out_features)
    # The same products in float64: only the float32 accumulation differs.
    torch.testing.assert_close(out, amx_linear.bf16x3_linear_reference(x, weight, bias), atol=2e-6, rtol=2e-6)
    exact = F.linear(x.double(), weight.double(), bias.double())
    assert float((out.double() - exact).abs().max()) < 1e-4 * float(exact.abs().mean()) + 1e-6
    # Plain bfloat16 products are two orders of magnitude further off (what bf16x3 is there to avoid).
    plain = F.linear(x.bfloat16().double(), weight.bfloat16().double(), bias.double())
    if in_features > 1:
        assert float((plain - exact).abs().max()) > 30 * float((out.double() - exact).abs().max())


def test_the_packed_tiles_hold_each_weight_split_in_hi_and_lo_interleaved_by_k():
    g = torch.Generator().manual_seed(3)
    weight = torch.randn(48, 45, generator=g)  # k 45-63 are padding in the second block of 32
    packed = tiles(weight)
    hi, lo = amx_linear.split_bf16(torch.nn.functional.pad(weight, (0, 64 - 45)))
    as_bf16 = packed.view(torch.bfloat16).float()  # [n / 16, k / 32, part, pair, 16 n x 2]
    for part, want in ((0, hi), (1, lo)):
        # want[16 nt + n, 32 kb + 2 pair + j] sits at [nt, kb, part, pair, 2 n + j]
        layout = want.view(3, 16, 2, 16, 2).permute(0, 2, 3, 1, 4).reshape(3, 2, 16, 32)
        assert torch.equal(as_bf16[:, :, part], layout), part


def test_a_row_gives_the_same_bits_alone_in_any_batch_and_on_any_thread_count():
    g = torch.Generator().manual_seed(2)
    weight, pad = torch.randn(112, 70, generator=g), torch.randn(70, 96, generator=g)
    x = pad[:, :70]  # rows 96 floats apart
    packed = tiles(weight)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        full = amx_linear.amx_linear_cpu(x, packed)
        differing = [
            rows
            for rows in (1, 5, 16, 31, 32, 33, 64, 69)
            if not torch.equal(amx_linear.amx_linear_cpu(x[70 - rows :], packed), full[70 - rows :])
        ]
        torch.set_num_threads(2)
        assert torch.equal(amx_linear.amx_linear_cpu(x, packed), full)
    finally:
        torch.set_num_threads(threads)
    assert not differing, f"rows whose bits depend on the batch: {differing}"


def test_bad_inputs_are_refused_with_a_reason():
    packed = tiles(torch.randn(32, 40))
    assert tuple(packed.shape) == (2, 2, 2, 16, 32) and packed.dtype == torch.int16
    with pytest.raises(ValueError, match="rounded up to 32 = 64"):
        amx_linear.amx_linear_cpu(torch.randn(3, 70), packed)
    with pytest.raises(ValueError, match="contiguous in its last dim"):
        amx_linear.amx_linear_cpu(torch.randn(3, 80)[:, ::2], packed)
    with pytest.raises(ValueError, match="bias"):
        amx_linear.amx_linear_cpu(torch.randn(3, 40), packed, torch.randn(31))
    with pytest.raises(ValueError, match="dtype"):
        amx_linear.amx_linear_cpu(torch.randn(3, 40).double(), packed)
    with pytest.raises(ValueError, match="from pack_weight"):
        amx_linear.amx_linear_cpu(torch.randn(3, 40), packed[:, :, :1])
    with pytest.raises(ValueError, match=r"\[N / 16, K, 16\]"):
        amx_linear.pack_weight(torch.randn(2, 40, 8))
    assert amx_linear.amx_linear_cpu(torch.randn(0, 40), packed).shape == (0, 32)
