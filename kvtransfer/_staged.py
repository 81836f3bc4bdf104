"""Integrity on a packed payload, the gloo and NCCL transports' staging buffer: the sums of its
blocks as packed or as landed, its manifest in the control store, and the faults tests inject
into it (kvtransfer.integrity)."""

from __future__ import annotations

import time

import numpy as np
import torch

from kernels.block_checksum import block_sums

from ._control import ControlClient, ControlTimeout
from .integrity import Fault, FaultKind, Manifest, clamp_block


def chunk_view(cache_bytes: torch.Tensor, region: torch.Tensor, count: int) -> torch.Tensor:
    """A packed chunk (flat bytes) as `[L, 2, count, ...]` bytes, the layout of `cache_bytes`."""
    return region.view((cache_bytes.shape[0], 2, count) + tuple(cache_bytes.shape[3:]))


def staged_sums(cache_bytes: torch.Tensor, buf: torch.Tensor, start: int, count: int, block_bytes: int) -> np.ndarray:
    """(s1, s2) of the blocks of one packed chunk, read where it sits (just packed or just
    received, so in cache): Triton on the GPU, the native sums on the CPU."""
    region = buf[start * block_bytes : (start + count) * block_bytes]
    return block_sums(chunk_view(cache_bytes, region, count), torch.arange(count, device=buf.device))


def staged_block(
    cache_bytes: torch.Tensor, buf: torch.Tensor, spans: list, block: int, block_bytes: int
) -> torch.Tensor:
    """Block `block` of a packed payload: `[L * 2, P]` bytes."""
    a, c = next((a, c) for a, c in spans if a <= block < a + c)
    chunk = chunk_view(cache_bytes, buf[a * block_bytes : (a + c) * block_bytes], c)
    return chunk.reshape(chunk.shape[0] * 2, c, -1)[:, block - a]


def take_manifest(store: ControlClient, key: str, until: float) -> Manifest | None:
    """The sender posts it after its last chunk; None if it has not come by `until` (monotonic)."""
    try:
        return store.take(key, max(0.05, until - time.monotonic()))
    except ControlTimeout:
        return None


def spoil_staged(
    cache_bytes: torch.Tensor, fault: Fault, buf: torch.Tensor, spans: list, block_bytes: int, deadline: float
) -> None:
    """Tests: spoil a payload after it was sealed (flip, drop, reorder, duplicate), or hold it
    until after the deadline (stall). Truncation and foreign manifests are the manifest's."""
    n = spans[-1][0] + spans[-1][1]
    b = clamp_block(fault, n)

    def block(i):
        return staged_block(cache_bytes, buf, spans, i, block_bytes)

    if fault.kind == FaultKind.STALL:
        time.sleep(max(0.0, deadline - time.monotonic()) + fault.stall_s)
    elif fault.kind == FaultKind.FLIP:
        piece = block(b)[0]
        bit = fault.bit % (piece.numel() * 8)
        piece[bit // 8] ^= 1 << (bit % 8)
    elif fault.kind == FaultKind.DROP:
        block(b).zero_()  # lost: what arrives in its place is not it
    elif fault.kind in (FaultKind.REORDER, FaultKind.DUPLICATE) and n >= 2:
        b = min(b, n - 2)
        first, second = block(b), block(b + 1)
        kept = first.clone()
        if fault.kind == FaultKind.REORDER:
            first.copy_(second)
        second.copy_(kept)
