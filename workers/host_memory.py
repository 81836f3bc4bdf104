"""Large CPU tensors on transparent huge pages: the packed weights and the KV cache.

A CPU decode step reads every weight and the batch's KV once, from some thousand separate 4 KiB
pages per megabyte, each a TLB miss on the way (Linux maps anonymous memory in 4 KiB pages unless
asked: /sys/kernel/mm/transparent_hugepage/enabled is `madvise` on most distributions). Asking for
2 MiB pages (madvise MADV_HUGEPAGE) before the first write took one thread's pass over the default
model's float32 linear layers from 51.6 to 50.4 ms at 16 rows and its decode attention from 19.5
to 18.7 ms (`python -m bench.decode_profile` measures the whole step). Where the kernel offers no
huge pages, or the tensor is small, the tensor is allocated as usual.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import sys

import torch

log = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14  # Linux <sys/mman.h>


@functools.lru_cache(maxsize=1)
def _madvise():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    fn = libc.madvise
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """torch.empty(shape, dtype=dtype) on the CPU, on huge pages when it spans at least one and the
    kernel takes the advice. Nothing is written: the pages are mapped at the first write."""
    numel = 1
    for size in shape:
        numel *= size
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    advise = _madvise()
    if advise is None or nbytes < HUGE_PAGE:
        return torch.empty(shape, dtype=dtype)
    # One huge page more than needed, so that an aligned start always fits; the slack is never
    # written, so it takes address space but no memory.
    raw = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)
    start = -raw.data_ptr() % HUGE_PAGE
    if advise(raw.data_ptr() + start, raw.numel() - start, _MADV_HUGEPAGE) != 0:
        log.debug("madvise(MADV_HUGEPAGE) failed (errno %d): %s stays on small pages", ctypes.get_errno(), shape)
    return raw[start:start + nbytes].view(dtype).view(shape)


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return empty(shape, dtype).zero_()


def copy(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of a CPU tensor, on huge pages (see empty)."""
    out = empty(tuple(tensor.shape), tensor.dtype)
    out.copy_(tensor)
    return out
