"""CPU linear layers on weights packed once at load time.

`F.linear` on a CPU float32 tensor goes to the BLAS torch was built with, and on a bfloat16 one
to oneDNN, which reorders the weight into its blocked layout on every call. Packing each weight
once at load time (`torch.ops.mkldnn._reorder_linear_weight`, what inductor's freezing pass does)
and calling oneDNN's linear on the packed copy computes the same products (up to summation order
and, in bfloat16, the rounding of the output) without the per-call reorder, a second pass over
every weight in each decode step (`bench/decode_profile.py` measures the gain).

float32 weights with a multiple of 16 outputs go to kernels/small_m_linear.py instead, when its
native library builds: with decode-sized batches oneDNN's packed linear neither streams the
weights at the memory's pace nor keeps the FMA units busy, and on the default model's shapes the
native kernel took 0.72-0.87x of its time for 1 to 32 rows on one thread, and no more for up to
256 rows or on two threads (`python -m bench.small_m_linear`). Its packed weight is 3-D
([N / 16, K, 16]), oneDNN's 2-D, and `packed_linear` dispatches on that.

`prepack(model)` swaps every plain `nn.Linear` (FP8 layers keep their own path) for a
`PackedLinear` and packs the lm_head; the model runner calls it when EngineConfig.packed_linear
is set. Where oneDNN is unavailable nothing changes.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from kernels import small_m_linear

log = logging.getLogger(__name__)

PACKED_DTYPES = (torch.float32, torch.bfloat16)
# Row-count hint for the packed layout; any number of rows works with it. Decode batches are
# the case that gains most.
_ROWS_HINT = 16


def available(weight: torch.Tensor) -> bool:
    return (
        weight.device.type == "cpu"
        and weight.dtype in PACKED_DTYPES
        and weight.dim() == 2
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


def pack(weight: torch.Tensor) -> torch.Tensor:
    if small_m_linear.packable(weight):
        return small_m_linear.pack_weight(weight)
    return onednn_pack(weight)


def onednn_pack(weight: torch.Tensor) -> torch.Tensor:
    """oneDNN's blocked layout of a float32 or bfloat16 weight, which packed_linear also takes."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _ROWS_HINT)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if packed.dim() == 3:
        return small_m_linear.small_m_linear_cpu(x.contiguous(), packed, bias)
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")


class PackedLinear(nn.Module):
    """y = x @ weight.T + bias through a prepacked copy of weight. `weight` stays a parameter
    (checkpoint tools and memory accounting read it); the packed copy is a buffer."""

    packed_weight: torch.Tensor  # the buffer registered in __init__

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.register_buffer("packed_weight", pack(linear.weight), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return packed_linear(x, self.packed_weight, self.bias)


def prepack(model: nn.Module) -> int:
    """Swap the model's plain nn.Linear layers for PackedLinear in place; returns how many.

    A model with an `lm_head_weight` gets `packed_lm_head` too (its compute_logits uses it)."""
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and available(child.weight):
                setattr(parent, name, PackedLinear(child))
                swapped += 1
    lm_head = getattr(model, "lm_head_weight", None)
    if isinstance(lm_head, torch.Tensor) and available(lm_head):
        model.packed_lm_head = pack(lm_head)
    log.debug("prepacked %d linear layers", swapped)
    return swapped
