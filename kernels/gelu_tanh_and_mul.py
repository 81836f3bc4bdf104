"""GeGLU activation (Gemma): gelu_tanh(gate) * up on the fused gate_up projection output.

`gelu_tanh` is GELU's tanh approximation (transformers' "gelu_pytorch_tanh"). The Triton kernel
runs on CUDA; on the CPU, `gelu_tanh_and_mul_cpu` runs kernels/csrc/gelu_mul.cpp (built on first use
by kernels.cpu_native) for float32 and bfloat16.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from kernels import cpu_native
from kernels._checks import FLOAT_DTYPES, check_last_dim_contiguous, check_tensor
from kernels._triton_compat import cdiv, lazy_jit, tl
from kernels.plan import DeviceSpec, silu_mul_plan


def _check_gate_up(x) -> int:
    check_tensor(x, "x", 2, FLOAT_DTYPES)
    if x.shape[1] % 2 != 0:
        raise ValueError(f"x last dim must be even (gate and up halves), got {x.shape[1]}")
    return x.shape[1] // 2


def gelu_tanh_and_mul_reference(x):
    inter = _check_gate_up(x)
    # In float32, rounded once, as the kernel does (transformers rounds gelu(gate) to the model dtype first).
    gate = F.gelu(x[:, :inter].float(), approximate="tanh")
    return gate.mul_(x[:, inter:]).to(x.dtype)


_NATIVE_ARGS = (
    cpu_native.PTR,
    cpu_native.I64,
    cpu_native.PTR,
    cpu_native.I64,
    cpu_native.I64,
    cpu_native.I64,
    cpu_native.I32,
    cpu_native.I32,
)


def _native_fn():
    return cpu_native.function("gelu_mul", "baton_gelu_tanh_and_mul", _NATIVE_ARGS)


def native_built() -> bool:
    """Whether the native library loads on this machine (built, or found cached, once per process)."""
    return _native_fn() is not None


def native_available(x) -> bool:
    """Whether gelu_tanh_and_mul_cpu handles x (CPU float32/bfloat16, built library)."""
    return (
        isinstance(x, torch.Tensor)
        and x.device.type == "cpu"
        and x.dtype in (torch.float32, torch.bfloat16)
        and _native_fn() is not None
    )


def gelu_tanh_and_mul_cpu(x):
    """The native CPU kernel (kernels/csrc/gelu_mul.cpp); same contract as the reference."""
    inter = _check_gate_up(x)
    if not native_available(x):
        raise ValueError(f"no native CPU gelu_tanh_and_mul for {x.dtype} on {x.device}")
    check_last_dim_contiguous(x, "x")
    out = torch.empty((x.shape[0], inter), dtype=x.dtype)
    err = _native_fn()(
        x.data_ptr(),
        x.stride(0),
        out.data_ptr(),
        inter,
        x.shape[0],
        inter,
        cpu_native.DTYPE_CODES[x.dtype],
        torch.get_num_threads(),
    )
    if err != 0:
        raise ValueError(f"native gelu_tanh_and_mul failed with status {err}")
    return out


@lazy_jit
def _gelu_tanh_mul_kernel(x_ptr, out_ptr, inter, stride_x, stride_out, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    g = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0).to(tl.float32)
    inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)  # sqrt(2 / pi): a kernel reads no Python globals
    tanh = 1.0 - 2.0 / (tl.exp(2.0 * inner) + 1.0)  # saturates to +-1 without overflow trouble
    y = 0.5 * g * (1.0 + tanh) * u
    tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def gelu_tanh_and_mul_triton(x):
    inter = _check_gate_up(x)
    check_last_dim_contiguous(x, "x")
    T = x.shape[0]
    out = torch.empty((T, inter), dtype=x.dtype, device=x.device)
    if T > 0 and inter > 0:
        plan = silu_mul_plan(DeviceSpec.of(x.device))  # the same elementwise tiling as silu_and_mul
        _gelu_tanh_mul_kernel[(T, cdiv(inter, plan.meta["BLOCK"]))](
            x, out, inter, x.stride(0), out.stride(0), **plan.launch_kwargs()
        )
    return out
