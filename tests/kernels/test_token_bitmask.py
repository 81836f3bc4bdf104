"""The grammar bitmask kernels (kernels/token_bitmask.py) against xgrammar's own CPU kernel and a
hand-computed case."""

import pytest
import torch

from kernels.token_bitmask import (
    allocate_token_bitmask,
    apply_token_bitmask_cpu,
    apply_token_bitmask_reference,
    native_available,
)

xgrammar = pytest.importorskip("xgrammar", reason="xgrammar is the oracle here; the GPU image lacks it")

KERNELS = [apply_token_bitmask_reference, apply_token_bitmask_cpu]


@pytest.fixture(autouse=True)
def _built():
    if not native_available(torch.zeros(1, 1)):
        pytest.fail("the native token bitmask did not build on this machine (a C++ compiler is expected here)")


def random_bitmask(rows: int, vocab: int, generator: torch.Generator) -> torch.Tensor:
    """Words that are all clear, all set and mixed, as a grammar's masks are."""
    words = (vocab + 31) // 32
    kind = torch.randint(0, 3, (rows, words), generator=generator)
    mixed = torch.randint(-(2**31), 2**31, (rows, words), generator=generator, dtype=torch.int64).to(torch.int32)
    return torch.where(kind == 0, 0, torch.where(kind == 1, -1, mixed)).to(torch.int32)


@pytest.mark.parametrize("kernel", KERNELS)
def test_hand_computed_row(kernel):
    logits = torch.arange(40, dtype=torch.float32)[None].clone()
    bitmask = torch.tensor([[0b1010, 0b1]], dtype=torch.int32)  # tokens 1, 3 and 32 allowed
    kernel(logits, bitmask, [0])
    allowed = (logits > float("-inf")).nonzero()[:, 1].tolist()
    assert allowed == [1, 3, 32] and logits[0, 3] == 3.0 and logits[0, 32] == 32.0


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("vocab", [32, 1000, 49152, 49155])
def test_matches_xgrammar_on_the_listed_rows_only(kernel, vocab):
    generator = torch.Generator().manual_seed(vocab)
    logits = torch.randn(5, vocab, generator=generator)
    bitmask = random_bitmask(5, vocab, generator)
    rows = [0, 2, 3]
    expected = logits.clone()
    xgrammar.apply_token_bitmask_inplace(expected, bitmask, indices=rows)
    got = logits.clone()
    kernel(got, bitmask, rows)
    assert torch.equal(got, expected)
    assert torch.equal(got[[1, 4]], logits[[1, 4]])  # rows without a grammar untouched


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_row_view_with_a_stride(kernel):
    generator = torch.Generator().manual_seed(1)
    wide = torch.randn(3, 2 * 64, generator=generator)
    logits = wide[:, :64]  # rows 128 floats apart
    bitmask = random_bitmask(3, 64, generator)
    expected = logits.clone()
    xgrammar.apply_token_bitmask_inplace(expected, bitmask, indices=[1, 2])
    kernel(logits, bitmask, [1, 2])
    assert torch.equal(logits, expected)


@pytest.mark.parametrize("kernel", KERNELS)
def test_bad_inputs_name_the_problem(kernel):
    logits = torch.zeros(2, 64)
    with pytest.raises(ValueError, match="bitmask must be"):
        kernel(logits, torch.zeros(2, 3, dtype=torch.int32), [0])
    with pytest.raises(ValueError, match="bitmask"):
        kernel(logits, torch.zeros(2, 2, dtype=torch.int64), [0])
    with pytest.raises(ValueError, match="rows"):
        kernel(logits, torch.zeros(2, 2, dtype=torch.int32), [2])
    with pytest.raises(ValueError, match="logits"):
        kernel(logits.double(), torch.zeros(2, 2, dtype=torch.int32), [0])


@pytest.mark.parametrize("rows, vocab", [(1, 32), (3, 1000), (2, 49155)])
def test_allocated_bitmask_is_xgrammars(rows, vocab):
    ours, theirs = allocate_token_bitmask(rows, vocab), xgrammar.allocate_token_bitmask(rows, vocab)
    assert ours.dtype == theirs.dtype and ours.device == theirs.device and torch.equal(ours, theirs)
