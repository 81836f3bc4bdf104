"""The native float32 small-M linear kernel (kernels/small_m_linear.py) against a float64 F.linear."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from kernels import small_m_linear as sml

if not sml.native_built():
    pytest.skip("the native CPU kernels do not build here", allow_module_level=True)


@pytest.mark.parametrize("out_features,in_features", [(16, 1), (48, 5), (960, 576), (576, 1536), (80, 33)])
@pytest.mark.parametrize("rows", [0, 1, 7, 8, 9, 16, 17, 24, 25, 33])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_float64_linear(out_features, in_features, rows, bias):
    g = torch.Generator().manual_seed(rows * 1000 + out_features)
    weight = torch.randn(out_features, in_features, generator=g) * in_features**-0.5
    b = torch.randn(out_features, generator=g) if bias else None
    x = torch.randn(rows, in_features, generator=g)
    out = sml.small_m_linear_cpu(x, sml.pack_weight(weight), b)
    expected = F.linear(x.double(), weight.double(), None if b is None else b.double())
    assert out.dtype == torch.float32 and out.shape == (rows, out_features)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def test_leading_dims_strided_rows_and_thread_count_give_the_same_bits():
    g = torch.Generator().manual_seed(1)
    weight, pad = torch.randn(96, 40, generator=g), torch.randn(2, 11, 64, generator=g)
    x = pad[..., :40]  # rows 64 floats apart, the last dim contiguous
    packed = sml.pack_weight(weight)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = sml.small_m_linear_cpu(x, packed, None)
        torch.set_num_threads(2)
        two = sml.small_m_linear_cpu(x, packed, None)
    finally:
        torch.set_num_threads(threads)
    assert one.shape == (2, 11, 96) and torch.equal(one, two)  # each output is one sum in k order
    torch.testing.assert_close(one.double(), F.linear(x.double(), weight.double()), atol=1e-5, rtol=1e-5)


def test_bad_inputs_are_refused_with_a_reason():
    weight = torch.randn(32, 8)
    packed = sml.pack_weight(weight)
    with pytest.raises(ValueError, match="multiple of 16"):
        sml.pack_weight(torch.randn(20, 8))
    with pytest.raises(ValueError, match="dtype"):
        sml.pack_weight(weight.bfloat16())
    with pytest.raises(ValueError, match=r"\[\.\.\., 8\]"):
        sml.small_m_linear_cpu(torch.randn(3, 9), packed, None)
    with pytest.raises(ValueError, match="contiguous in its last dim"):
        sml.small_m_linear_cpu(torch.randn(3, 16)[:, ::2], packed, None)
    with pytest.raises(ValueError, match="bias"):
        sml.small_m_linear_cpu(torch.randn(3, 8), packed, torch.randn(31))
    assert sml.packable(weight) and not sml.packable(torch.randn(20, 8)) and not sml.packable(weight.bfloat16())


def test_a_row_gives_the_same_bits_alone_and_in_batches_of_either_block_shape():
    # 1-8 and 25+ rows take blocks of 8 rows x 48 outputs, 9-24 rows blocks of 16 x 32: a request's
    # outputs must not depend on how many others share its step.
    g = torch.Generator().manual_seed(2)
    weight, x = torch.randn(112, 70, generator=g), torch.randn(40, 70, generator=g)
    packed = sml.pack_weight(weight)
    full = sml.small_m_linear_cpu(x, packed, None)
    differing = {}
    for rows in (1, 5, 8, 9, 16, 23, 24, 25, 31):
        part = sml.small_m_linear_cpu(x[:rows], packed, None)
        if not torch.equal(part, full[:rows]):
            differing[rows] = float((part - full[:rows]).abs().max())
    # Every row count is tried before failing: which block shapes differ, and by how much, tells a
    # compiler's reordering (a few ulps) from a wrong block (tests/gpu/run.sh runs this on its host).
    assert not differing, f"rows: largest difference from the full batch {differing}"
