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


# The checks below run on every kernel call (hundreds per decode step), so each builds its
# message only once a check has failed.


def check_tensor(t, name: str, ndim: int | None = None, dtypes=None) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        raise ValueError(f"{name} dtype must be one of {[str(d) for d in dtypes]}, got {t.dtype}")


def check_same_device(**tensors) -> None:
    devices = {name: t.device for name, t in tensors.items() if isinstance(t, torch.Tensor)}
    if len(set(devices.values())) > 1:
        raise ValueError(f"tensors must share one device, got {devices}")


def check_last_dim_contiguous(t, name: str) -> None:
    if not (t.dim() == 0 or t.shape[-1] <= 1 or t.stride(-1) == 1):
        raise ValueError(f"{name} must be contiguous in its last dim, got strides {t.stride()}")


def check_kv_cache(k_cache, v_cache) -> None:
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        check_tensor(c, name, 4, KV_DTYPES)
        if not c.is_contiguous():
            raise ValueError(f"{name} must be contiguous [num_blocks, block_size, num_kv_heads, head_dim]")
    if k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise ValueError(
            f"k_cache {tuple(k_cache.shape)} {k_cache.dtype} and v_cache {tuple(v_cache.shape)} {v_cache.dtype} differ"
        )


def check_scale(value, name: str) -> float:
    if not (isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0):
        raise ValueError(f"{name} must be a positive python float, got {value!r}")
    return float(value)


def is_fp8(dtype) -> bool:
    return dtype == FP8_DTYPE
