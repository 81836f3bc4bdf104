"""float8_e4m3fn quantization with a per-tensor or per-token scale, dynamic (from amax) or static."""

from __future__ import annotations

import torch

from kernels._checks import FLOAT_DTYPES, FP8_DTYPE, FP8_MAX, check_last_dim_contiguous, check_tensor, require
from kernels._triton_compat import lazy_jit, tl
from kernels.plan import DeviceSpec, fp8_quant_plan

# An all-zero row would otherwise get scale 0 and divide by it.
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)


def _check(x, scale) -> torch.Tensor | None:
    """The static scale as a float32 tensor ([1] or [T, 1]), or None for dynamic quantization."""
    check_tensor(x, "x", 2, FLOAT_DTYPES)
    if scale is None:
        return None
    if isinstance(scale, (int, float)) and not isinstance(scale, bool):
        scale = torch.tensor([float(scale)], dtype=torch.float32, device=x.device)
    check_tensor(scale, "scale", None, (torch.float32,))
    require(scale.device == x.device, f"scale on {scale.device}, x on {x.device}")
    T = x.shape[0]
    ok = scale.numel() == 1 or tuple(scale.shape) == (T, 1)
    require(ok, f"scale must have shape [1] (per-tensor) or [{T}, 1] (per-token), got {tuple(scale.shape)}")
    return scale.reshape(1) if scale.numel() == 1 and scale.shape != (T, 1) else scale


def _dynamic_scale(x: torch.Tensor, per_token: bool) -> torch.Tensor:
    if per_token:
        amax = x.abs().amax(dim=-1, keepdim=True) if x.shape[0] else x.new_zeros((0, 1))
        return (amax.float() / FP8_MAX).clamp(min=MIN_SCALE)
    amax = x.abs().amax().float() if x.numel() else torch.zeros((), device=x.device)
    return (amax / FP8_MAX).clamp(min=MIN_SCALE).reshape(1)


def scaled_fp8_quant_reference(x, scale=None, per_token: bool = False):
    scale = _check(x, scale)
    if scale is None:
        scale = _dynamic_scale(x, per_token)
    q = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale.float()


@lazy_jit
def _fp8_quant_kernel(
    x_ptr,
    out_ptr,
    scale_ptr,
    N,
    stride_x,
    stride_out,
    DYNAMIC_ROW: tl.constexpr,
    SCALE_PER_ROW: tl.constexpr,
    MIN_S: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # One program per row; DYNAMIC_ROW computes the row's amax first and writes the scale it used.
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    if DYNAMIC_ROW:
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, N, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            v = tl.load(x_row + cols, mask=cols < N, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(v))
        scale = tl.maximum(tl.max(amax, axis=0) / 448.0, MIN_S)
        tl.store(scale_ptr + row, scale)
    elif SCALE_PER_ROW:
        scale = tl.load(scale_ptr + row)
    else:
        scale = tl.load(scale_ptr)
    for start in range(0, N, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        m = cols < N
        v = tl.load(x_row + cols, mask=m, other=0.0).to(tl.float32)
        q = tl.clamp(tl.div_rn(v, scale), -448.0, 448.0)
        # Round to the nearest e4m3 value by hand so the cast below is exact: the Triton interpreter's
        # fp8 cast loses the mantissa carry, and this keeps GPU and CPU results bit-equal.
        qb = q.to(tl.uint32, bitcast=True)
        qa = (qb & 0x7FFFFFFF).to(tl.float32, bitcast=True)
        qr = tl.where(
            qa < 0.015625,
            ((qa + 24576.0) - 24576.0).to(tl.uint32, bitcast=True),
            ((qb & 0x7FFFFFFF) + 0x7FFFF + ((qb >> 20) & 1)) & 0x7FF00000,
        )
        q = (qr | (qb & 0x80000000)).to(tl.float32, bitcast=True)
        tl.store(out_ptr + row * stride_out + cols, q.to(out_ptr.dtype.element_ty), mask=m)


def scaled_fp8_quant_triton(x, scale=None, per_token: bool = False):
    scale = _check(x, scale)
    check_last_dim_contiguous(x, "x")
    T, N = x.shape
    out = torch.empty((T, N), dtype=FP8_DTYPE, device=x.device)
    dynamic_row = scale is None and per_token
    if scale is None:
        scale = torch.empty((T, 1), dtype=torch.float32, device=x.device) if per_token else _dynamic_scale(x, False)
    scale = scale.contiguous()
    if T > 0 and N > 0:
        _fp8_quant_kernel[(T,)](
            x,
            out,
            scale,
            N,
            x.stride(0),
            out.stride(0),
            **fp8_quant_plan(
                DeviceSpec.of(x.device),
                N=N,
                dynamic_row=dynamic_row,
                scale_per_row=scale.dim() == 2,
                min_scale=MIN_SCALE,
            ).launch_kwargs(),
        )
    elif dynamic_row:
        scale.fill_(MIN_SCALE)
    return out, scale
