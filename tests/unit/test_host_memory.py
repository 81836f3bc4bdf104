"""workers/host_memory.py: large CPU tensors on transparent huge pages.

Oracle: the kernel's own account of the mapping (/proc/self/smaps: AnonHugePages of the area that
holds the tensor), and the values written, read back.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from workers import host_memory

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def huge_kib_around(address: int) -> int:
    """AnonHugePages (KiB) of the mapping in /proc/self/smaps that contains `address`."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


@pytest.mark.skipif(not sys.platform.startswith("linux") or not THP.exists() or "[never]" in THP.read_text(),
                    reason="no transparent huge pages here")
def test_a_large_tensor_lands_on_huge_pages_and_keeps_its_values():
    shape = (3, 1024, 1024)  # 12 MiB of float32
    t = host_memory.zeros(shape, torch.float32)
    assert t.shape == shape and t.dtype == torch.float32 and t.is_contiguous()
    assert t.data_ptr() % host_memory.HUGE_PAGE == 0
    assert huge_kib_around(t.data_ptr()) >= 2048, "none of the tensor's memory is on a huge page"
    values = torch.randn(shape)
    copied = host_memory.copy(values)
    assert torch.equal(copied, values) and copied.data_ptr() % host_memory.HUGE_PAGE == 0
    assert int(t.count_nonzero()) == 0


def test_small_tensors_are_plain_allocations():
    t = host_memory.zeros((4, 5), torch.bfloat16)
    assert t.shape == (4, 5) and t.dtype == torch.bfloat16 and int(t.count_nonzero()) == 0
    assert t.untyped_storage().nbytes() == 4 * 5 * 2  # no slack for alignment
