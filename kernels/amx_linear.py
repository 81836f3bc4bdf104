"""float32 linear layers for prompt rows on Intel AMX, each product as three bfloat16 products.

y = x @ weight.T with x = xh + xl and weight = wh + wl split into bfloat16 parts (each rounded to
nearest even), and y ~ xh wh + xh wl + xl wh accumulated in float32 (kernels/csrc/amx_linear.cpp).
This is what PyTorch's `torch.set_float32_matmul_precision("high")` allows a float32 matmul to be
("each float32 number as the sum of two bfloat16 numbers"): about 16 bits of significand per
product, more than TF32's 10 that float32 dots use on CUDA (kernels/plan.py). On the default
model's projection shapes, 256 rows, the largest error against float64 was 3.1e-5 of the outputs'
mean magnitude, against 8.8e-6 for float32's own and 1.5e-2 for plain bfloat16
(`python -m bench.amx_linear` measures it and the speed: bench/results/amx_linear.json).

`bf16x3_linear_reference` computes the same three products in float64 from the same parts; the
kernel differs from it only by float32 accumulation. The weight is split once, at load time
(`pack_weight`, from kernels.small_m_linear's packing), which costs 4 bytes per weight beside the
float32 copy.
"""

from __future__ import annotations

import functools

import torch

from kernels import cpu_native
from kernels._checks import check_last_dim_contiguous, check_tensor, require

_LINEAR_ARGS = (
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
TILE_K = 32


def _fn(symbol: str, args: tuple):
    return cpu_native.function("amx_linear", symbol, args)


@functools.lru_cache(maxsize=1)
def ready() -> bool:
    """Whether this machine and process run the kernel: built with AMX-BF16 and granted the tiles."""
    fn = _fn("baton_amx_ready", ())
    return fn is not None and fn() == 1


def pack_weight(packed: torch.Tensor) -> torch.Tensor:
    """small_m_linear's [N / 16, K, 16] float32 packing -> the kernel's bfloat16 tiles, as int16
    [N / 16, Kp / 32, 2, 16, 32] (Kp: K rounded up to 32; hi then lo part)."""
    check_tensor(packed, "packed", 3, (torch.float32,))
    require(
        packed.is_contiguous() and packed.shape[2] == 16,
        f"packed must be a contiguous [N / 16, K, 16] float32 weight, got {tuple(packed.shape)}",
    )
    blocks, k, _ = packed.shape
    kp = -(-k // TILE_K) * TILE_K
    out = torch.empty(blocks, kp // TILE_K, 2, 16, 32, dtype=torch.int16)
    fn = _fn("baton_amx_pack_weight", (cpu_native.PTR, cpu_native.I64, cpu_native.I64, cpu_native.PTR))
    require(fn is not None, "the native amx_linear library is not built on this machine")
    err = fn(packed.data_ptr(), k, blocks * 16, out.data_ptr())
    require(err == 0, f"baton_amx_pack_weight failed with status {err}")
    return out


def split_bf16(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo) of a float32 tensor as float32 values: hi = bf16(t), lo = bf16(t - hi)."""
    hi = t.to(torch.bfloat16).float()
    return hi, (t - hi).to(torch.bfloat16).float()


def bf16x3_linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """xh wh + xh wl + xl wh in float64, returned as float32; weight is the plain [N, K] one."""
    xh, xl = (p.double() for p in split_bf16(x.float()))
    wh, wl = (p.double() for p in split_bf16(weight.float()))
    y = xh @ wh.T + xh @ wl.T + xl @ wh.T
    if bias is not None:
        y = y + bias.double()
    return y.float()


def amx_linear_cpu(x: torch.Tensor, amx_packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel on a weight from pack_weight; x is [..., K] float32 on CPU."""
    check_tensor(amx_packed, "amx_packed", 5, (torch.int16,))
    require(
        amx_packed.is_contiguous() and tuple(amx_packed.shape[2:]) == (2, 16, 32),
        f"amx_packed must be a contiguous [N / 16, Kp / 32, 2, 16, 32] from pack_weight, got {tuple(amx_packed.shape)}",
    )
    n, kp = amx_packed.shape[0] * 16, amx_packed.shape[1] * TILE_K
    check_tensor(x, "x", None, (torch.float32,))
    k = x.shape[-1]
    require(
        x.device.type == "cpu" and -(-k // TILE_K) * TILE_K == kp,
        f"x must be a CPU tensor [..., K] with K rounded up to 32 = {kp}, got {tuple(x.shape)} on {x.device}",
    )
    require(bias is None or (bias.dtype == torch.float32 and tuple(bias.shape) == (n,)), f"bias must be float32 [{n}]")
    require(ready(), "the AMX linear kernel does not run here (no AMX-BF16, or the tiles were not granted)")
    rows = x.reshape(-1, k)
    check_last_dim_contiguous(rows, "x")
    out = torch.empty(rows.shape[0], n, dtype=torch.float32)
    err = _fn("baton_amx_linear", _LINEAR_ARGS)(
        rows.data_ptr(),
        rows.stride(0),
        rows.shape[0],
        amx_packed.data_ptr(),
        out.data_ptr(),
        out.stride(0),
        k,
        n,
        torch.get_num_threads(),
    )
    require(err == 0, f"native amx_linear failed with status {err}")
    if bias is not None:
        out += bias
    return out.reshape(*x.shape[:-1], n)
