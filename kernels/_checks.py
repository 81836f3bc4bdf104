"""Input checks shared by the host wrappers: every failure is a ValueError naming the argument."""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
KV_DTYPES = FLOAT_DTYPES + (FP8_DTYPE,)


def require(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def check_tensor(t, name: str, ndim: int | None = None, dtypes=None) -> None:
    require(isinstance(t, torch.Tensor), f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None:
        require(t.dim() == ndim, f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if dtypes is not None:
        require(t.dtype in dtypes, f"{name} dtype must be one of {[str(d) for d in dtypes]}, got {t.dtype}")


def check_same_device(**tensors) -> None:
    devices = {name: t.device for name, t in tensors.items() if isinstance(t, torch.Tensor)}
    require(len(set(devices.values())) <= 1, f"tensors must share one device, got {devices}")


def check_last_dim_contiguous(t, name: str) -> None:
    require(t.dim() == 0 or t.shape[-1] <= 1 or t.stride(-1) == 1,
            f"{name} must be contiguous in its last dim, got strides {t.stride()}")


def check_kv_cache(k_cache, v_cache) -> None:
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        check_tensor(c, name, 4, KV_DTYPES)
        require(c.is_contiguous(), f"{name} must be contiguous [num_blocks, block_size, num_kv_heads, head_dim]")
    require(k_cache.shape == v_cache.shape and k_cache.dtype == v_cache.dtype,
            f"k_cache {tuple(k_cache.shape)} {k_cache.dtype} and v_cache {tuple(v_cache.shape)} {v_cache.dtype} differ")


def check_scale(value, name: str) -> float:
    require(isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0,
            f"{name} must be a positive python float, got {value!r}")
    return float(value)


def is_fp8(dtype) -> bool:
    return dtype == FP8_DTYPE
