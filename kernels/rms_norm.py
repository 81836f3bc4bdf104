"""RMSNorm, optionally fused with the residual add before it (HF Llama semantics)."""

from __future__ import annotations

import torch

from kernels import cpu_native
from kernels._checks import FLOAT_DTYPES, check_last_dim_contiguous, check_same_device, check_tensor, require
from kernels._triton_compat import lazy_jit, tl
from kernels.plan import DeviceSpec, rms_norm_plan


def _check(x, weight, eps, residual) -> None:
    check_tensor(x, "x", 2, FLOAT_DTYPES)
    check_tensor(weight, "weight", 1, FLOAT_DTYPES)
    if weight.shape[0] != x.shape[1]:
        raise ValueError(f"weight has {weight.shape[0]} elements, x has hidden size {x.shape[1]}")
    if not (isinstance(eps, (int, float)) and eps >= 0):
        raise ValueError(f"eps must be a non-negative float, got {eps!r}")
    if residual is not None:
        check_tensor(residual, "residual", 2, (x.dtype,))
        if residual.shape != x.shape:
            raise ValueError(f"residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
    check_same_device(x=x, weight=weight, residual=residual)


def _norm(s: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    sf = s.float()
    inv = torch.rsqrt(sf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (sf * inv * weight.float()).to(s.dtype)


def rms_norm_reference(x, weight, eps: float, residual=None):
    _check(x, weight, eps, residual)
    if residual is None:
        return _norm(x, weight, eps)
    s = x + residual
    return _norm(s, weight, eps), s


_NATIVE_ARGS = (
    cpu_native.PTR,
    cpu_native.I64,
    cpu_native.PTR,
    cpu_native.I64,
    cpu_native.PTR,
    cpu_native.I32,
    cpu_native.PTR,
    cpu_native.I64,
    cpu_native.PTR,
    cpu_native.I64,
    cpu_native.I64,
    cpu_native.I64,
    cpu_native.F32,
    cpu_native.I32,
    cpu_native.I32,
)
_NATIVE_MAX_HIDDEN = 8192  # the kernel keeps one row on its stack


def _native_fn():
    return cpu_native.function("rms_norm", "baton_rms_norm", _NATIVE_ARGS)


def native_built() -> bool:
    """Whether the native library loads on this machine (built, or found cached, once per process)."""
    return _native_fn() is not None


def native_available(x, weight) -> bool:
    """Whether rms_norm_cpu handles these tensors (CPU float32/bfloat16, hidden size <= 8192, built library)."""
    native = (torch.float32, torch.bfloat16)
    return (
        isinstance(x, torch.Tensor)
        and isinstance(weight, torch.Tensor)
        and x.device.type == "cpu"
        and x.dtype in native
        and weight.dtype in native
        and x.shape[-1] <= _NATIVE_MAX_HIDDEN
        and _native_fn() is not None
    )


def rms_norm_cpu(x, weight, eps: float, residual=None):
    """The native CPU kernel (kernels/csrc/rms_norm.cpp); same contract as the reference."""
    _check(x, weight, eps, residual)
    if not native_available(x, weight):
        raise ValueError(f"no native CPU rms_norm for x {x.dtype} / weight {weight.dtype} on {x.device}")
    check_last_dim_contiguous(x, "x")
    weight = weight.contiguous()
    T, H = x.shape
    out = torch.empty((T, H), dtype=x.dtype)
    summed = None
    if residual is not None:
        check_last_dim_contiguous(residual, "residual")
        summed = torch.empty((T, H), dtype=x.dtype)
    err = _native_fn()(
        x.data_ptr(),
        x.stride(0),
        None if residual is None else residual.data_ptr(),
        0 if residual is None else residual.stride(0),
        weight.data_ptr(),
        cpu_native.DTYPE_CODES[weight.dtype],
        out.data_ptr(),
        out.stride(0),
        None if summed is None else summed.data_ptr(),
        H,
        T,
        H,
        float(eps),
        cpu_native.DTYPE_CODES[x.dtype],
        torch.get_num_threads(),
    )
    if err != 0:
        raise ValueError(f"native rms_norm failed with status {err}")
    return out if residual is None else (out, summed)


@lazy_jit
def _rms_norm_kernel(
    x_ptr,
    r_ptr,
    w_ptr,
    out_ptr,
    sum_ptr,
    H,
    stride_x,
    stride_r,
    stride_out,
    stride_sum,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + row * stride_r + cols, mask=mask, other=0.0)
        # Round the sum to the activation dtype first so the norm sees exactly the residual stream it returns.
        s = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(sum_ptr + row * stride_sum + cols, s, mask=mask)
        x = s
    xf = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / H + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (xf * inv * w).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm_triton(x, weight, eps: float, residual=None):
    _check(x, weight, eps, residual)
    check_last_dim_contiguous(x, "x")
    require(weight.is_contiguous(), "weight must be contiguous")
    if residual is not None:
        check_last_dim_contiguous(residual, "residual")
    T, H = x.shape
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    s = torch.empty_like(out) if residual is not None else None
    if T > 0:
        r = residual if residual is not None else x
        ss = s if s is not None else out
        plan = rms_norm_plan(DeviceSpec.of(x.device), hidden=H, has_residual=residual is not None)
        _rms_norm_kernel[(T,)](
            x,
            r,
            weight,
            out,
            ss,
            H,
            x.stride(0),
            r.stride(0),
            out.stride(0),
            ss.stride(0),
            float(eps),
            **plan.launch_kwargs(),
        )
    return out if residual is None else (out, s)
