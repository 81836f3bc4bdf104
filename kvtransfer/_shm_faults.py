"""The shm sender's copy as an injected fault spoils it (kvtransfer.integrity's FaultPlan; tests only)."""

from __future__ import annotations

import numpy as np
import torch

from ._common import copy_blocks
from ._follower import wake
from ._segment import LANDED, Segment
from .integrity import Fault, FaultKind, clamp_block, faulty_pairs, flip_bit


def faulty_copy(
    seg: Segment,
    row: np.ndarray,
    fault: Fault,
    src: list[int],
    dst: list[int],
    own_bytes: torch.Tensor,
    checksums: bool,
    waker: int | None,
) -> bool:
    """Copy blocks `src` of `own_bytes` into `dst` of the segment as `fault` spoils them; False when
    the sender "died" mid-copy. A sealing sender counts the spoiled blocks as landed, as a real
    fault in transit would leave them, so the receiver's verifier thread reads them while the
    transfer is open."""
    wrote_src, wrote_dst = faulty_pairs(fault, src, dst)
    if wrote_src:
        copy_blocks(seg.cache_bytes, wrote_dst, own_bytes, wrote_src)
    if fault.kind == FaultKind.FLIP:
        flip_bit(seg.rows, dst[clamp_block(fault, len(dst))], fault.bit)
    if checksums:
        row[LANDED] = len(dst) // 2 if fault.kind == FaultKind.KILL else len(dst)
        wake(waker)
    return fault.kind != FaultKind.KILL
