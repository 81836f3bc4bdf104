"""KVLayout validation and compatibility messages, TransferStatus ordering."""

from __future__ import annotations

import pytest
import torch

from kvtransfer import KVLayout, KVLayoutMismatch, TransferStatus, check_cache, layout_from_cache
from kvtransfer._common import coalesce


def layout(**changes) -> KVLayout:
    fields = dict(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float32")
    fields.update(changes)
    return KVLayout(**fields)


def test_from_cache_reads_the_engine_shape():
    cache = torch.zeros(3, 2, 10, 16, 4, 64, dtype=torch.float8_e4m3fn)
    got = layout_from_cache(cache, block_size=16, scales=[(0.5, 0.5)] * 3)
    assert got == KVLayout(3, 4, 64, 16, "float8_e4m3fn", ((0.5, 0.5),) * 3)
    assert got.block_bytes == 3 * 2 * 16 * 4 * 64 * 1
    assert layout().block_bytes == 2 * 2 * 4 * 2 * 8 * 4


@pytest.mark.parametrize(
    "bad,words",
    [
        (lambda: layout_from_cache(torch.zeros(2, 3, 4, 4, 2, 8)), "shape"),
        (lambda: layout_from_cache(torch.zeros(2, 2, 4, 4, 2, 8), block_size=8), "block_size=8"),
        (lambda: layout_from_cache(torch.zeros(2, 2, 4, 4, 2, 8, dtype=torch.int32)), "dtype"),
        (lambda: layout(num_layers=0), "num_layers"),
        (lambda: layout(dtype="float64"), "dtype"),
        (lambda: layout(kv_scales=((1.0, 2.0),)), "one \\(k, v\\) pair per layer"),
        (lambda: layout(kv_scales=((1.0, 2.0), (0.0, 1.0))), "kv_scales\\[1\\]"),
    ],
)
def test_bad_layouts_raise_value_error(bad, words):
    with pytest.raises(ValueError, match=words):
        bad()


def test_unit_scales_equal_no_scales():
    assert layout(kv_scales=((1.0, 1.0), (1, 1))) == layout()
    layout().check_compatible(layout(kv_scales=((1.0, 1.0), (1.0, 1.0))))


@pytest.mark.parametrize(
    "change,words",
    [
        (dict(dtype="bfloat16"), "dtype local='float32' peer='bfloat16'"),
        (dict(block_size=16), "block_size local=4 peer=16"),
        (dict(num_layers=3), "num_layers local=2 peer=3"),
        (dict(num_kv_heads=1), "num_kv_heads local=2 peer=1"),
        (dict(head_dim=128), "head_dim local=8 peer=128"),
        (dict(kv_scales=((1.0, 1.0), (1.0, 0.5))), "kv_scales differ at layer 1: local=(1.0, 1.0) peer=(1.0, 0.5)"),
    ],
)
def test_mismatch_messages_name_field_and_values(change, words):
    with pytest.raises(KVLayoutMismatch) as info:
        layout().check_compatible(layout(**change))
    assert words in str(info.value)
    assert isinstance(info.value, ValueError)


def test_check_cache_rejects_wrong_tensor():
    with pytest.raises(KVLayoutMismatch, match="head_dim"):
        check_cache(layout(), torch.zeros(2, 2, 4, 4, 2, 16))
    with pytest.raises(ValueError, match="contiguous"):
        check_cache(layout(), torch.zeros(2, 2, 4, 4, 8, 2).transpose(-1, -2))
    assert check_cache(layout(), torch.zeros(2, 2, 7, 4, 2, 8)) == 7


def test_status_order_and_terminality():
    S = TransferStatus
    assert S.FAILED < S.ABORTED < S.PENDING < S.TRANSFERRING < S.SUCCESS
    assert min([S.SUCCESS, S.TRANSFERRING, S.ABORTED]) == S.ABORTED
    assert [s.is_terminal for s in S] == [True, True, False, False, True]


def test_coalesce_groups_runs_on_both_sides():
    assert coalesce([5, 6, 7, 0, 1, 9], [1, 2, 3, 8, 9, 4]) == [(5, 1, 3), (0, 8, 2), (9, 4, 1)]
    # Consecutive on one side only is not a run.
    assert coalesce([1, 2], [5, 7]) == [(1, 5, 1), (2, 7, 1)]
    assert coalesce([], []) == []
