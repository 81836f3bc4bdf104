"""Second stage of split-K decode attention: merge per-split partial outputs by their log-sum-exp."""

from __future__ import annotations

import torch

from kernels._checks import check_tensor, require
from kernels._triton_compat import lazy_jit, tl
from kernels.plan import DeviceSpec, merge_splits_plan


def _check(mid_o, mid_lse):
    check_tensor(mid_o, "mid_o", 4, (torch.float32,))
    check_tensor(mid_lse, "mid_lse", 3, (torch.float32,))
    require(mid_o.shape[:3] == mid_lse.shape, f"mid_o {tuple(mid_o.shape)} and mid_lse {tuple(mid_lse.shape)} disagree")


def merge_splits_reference(mid_o, mid_lse, out_dtype=torch.float32):
    """mid_o [B, H, S, D] (each split normalised by its own sum), mid_lse [B, H, S] in base 2 -> [B, H, D]."""
    _check(mid_o, mid_lse)
    w = torch.softmax(mid_lse * 0.6931471805599453, dim=-1)  # base-2 lse -> natural
    return (w.unsqueeze(-1) * mid_o).sum(dim=2).to(out_dtype)


@lazy_jit
def _merge_kernel(
    mid_o_ptr,
    mid_lse_ptr,
    out_ptr,
    stride_ob,
    stride_oh,
    H,
    S: tl.constexpr,
    D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    row = b * H + h
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    smask = s < S
    lse = tl.load(mid_lse_ptr + row * S + s, mask=smask, other=float("-inf"))
    w = tl.exp2(lse - tl.max(lse, axis=0))
    w = w / tl.sum(w, axis=0)
    o = tl.load(mid_o_ptr + (row * S + s[:, None]) * D + d[None, :], mask=smask[:, None] & (d[None, :] < D), other=0.0)
    res = tl.sum(o * w[:, None], axis=0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + d, res.to(out_ptr.dtype.element_ty), mask=d < D)


def merge_splits_triton(mid_o, mid_lse, out, *, plan=None):
    _check(mid_o, mid_lse)
    require(mid_o.is_contiguous() and mid_lse.is_contiguous(), "mid_o and mid_lse must be contiguous")
    B, H, S, D = mid_o.shape
    require(tuple(out.shape) == (B, H, D) and out.stride(2) == 1, f"out must be [{B}, {H}, {D}] with unit last stride")
    if B == 0 or H == 0:
        return out
    plan = plan or merge_splits_plan(DeviceSpec.of(out.device), num_splits=S, head_dim=D)
    _merge_kernel[(B, H)](mid_o, mid_lse, out, out.stride(0), out.stride(1), H, **plan.launch_kwargs())
    return out
