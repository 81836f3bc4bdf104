"""float32 linear layers for decode-sized batches on CPU: y = x @ weight.T + bias.

The native kernel (kernels/csrc/small_m_linear.cpp) reads the weight in a layout packed once at load
time, [N / 16][K][16]: 16 outputs side by side for each k, so that a panel of outputs streams from
memory in one sequential run. With the default model's shapes and 1 to 32 rows on one thread it
took 0.72-0.87x of oneDNN's prepacked linear's time (`python -m bench.small_m_linear`). The
reference is F.linear; the two differ only in summation order.
"""

from __future__ import annotations

import torch

from kernels import cpu_native
from kernels._checks import check_last_dim_contiguous, check_tensor

_NATIVE_ARGS = (
    cpu_native.PTR,
    cpu_native.I64,
    cpu_native.I64,
    cpu_native.PTR,
    cpu_native.PTR,
    cpu_native.I64,
    cpu_native.I64,
    cpu_native.I64,
    cpu_native.I32,
)


def _native_fn():
    return cpu_native.function("small_m_linear", "baton_small_m_linear", _NATIVE_ARGS)


def native_built() -> bool:
    """Whether the native library loads on this machine (built, or found cached, once per process)."""
    return _native_fn() is not None


def packable(weight: torch.Tensor) -> bool:
    """Whether the native kernel takes this weight: a CPU float32 [N, K] with N a multiple of 16."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and weight.dim() == 2
        and weight.shape[0] % 16 == 0
        and native_built()
    )


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [N / 16, K, 16], the layout the kernel reads."""
    check_tensor(weight, "weight", 2, (torch.float32,))
    n, k = weight.shape
    if n % 16 != 0:
        raise ValueError(f"weight rows (out_features) must be a multiple of 16, got {n}")
    return weight.detach().reshape(n // 16, 16, k).transpose(1, 2).contiguous()


def unpack_weight(packed: torch.Tensor) -> torch.Tensor:
    """pack_weight's inverse: [N / 16, K, 16] -> the [N, K] weight."""
    blocks, k, _ = packed.shape
    return packed.transpose(1, 2).reshape(blocks * 16, k)


def small_m_linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.nn.functional.linear(x, weight, bias)


def small_m_linear_cpu(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The native kernel on a weight from pack_weight; x is [..., K] float32 on CPU."""
    check_tensor(packed, "packed", 3, (torch.float32,))
    if not packed.is_contiguous() or packed.shape[2] != 16:
        raise ValueError(f"packed must be a contiguous [N / 16, K, 16] from pack_weight, got {tuple(packed.shape)}")
    blocks, k, _ = packed.shape
    n = blocks * 16
    check_tensor(x, "x", None, (torch.float32,))
    if x.device.type != "cpu" or x.shape[-1] != k:
        raise ValueError(f"x must be a CPU tensor [..., {k}], got {tuple(x.shape)} on {x.device}")
    if bias is not None and (bias.dtype != torch.float32 or tuple(bias.shape) != (n,)):
        raise ValueError(f"bias must be float32 [{n}], got {bias.dtype} {tuple(bias.shape)}")
    fn = _native_fn()
    if fn is None:
        raise ValueError("the native small_m_linear kernel is not built on this machine")
    rows = x.reshape(-1, k)
    check_last_dim_contiguous(rows, "x")
    out = torch.empty(rows.shape[0], n, dtype=torch.float32)
    err = fn(
        rows.data_ptr(),
        rows.stride(0),
        rows.shape[0],
        packed.data_ptr(),
        out.data_ptr(),
        out.stride(0),
        k,
        n,
        torch.get_num_threads(),
    )
    if err != 0:
        raise ValueError(f"native small_m_linear failed with status {err}")
    if bias is not None:
        out += bias
    return out.reshape(*x.shape[:-1], n)
