"""Write new tokens' K and V into the paged cache at their slots, quantizing to FP8 when the cache is FP8."""

from __future__ import annotations

import torch

from kernels import cpu_native
from kernels._checks import (
    FLOAT_DTYPES,
    FP8_MAX,
    check_kv_cache,
    check_last_dim_contiguous,
    check_same_device,
    check_scale,
    check_tensor,
    is_fp8,
    require,
)
from kernels._triton_compat import lazy_jit, tl
from kernels.plan import DeviceSpec, store_kv_plan


def _check(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale):
    check_tensor(key, "key", 3, FLOAT_DTYPES)
    check_tensor(value, "value", 3, (key.dtype,))
    check_kv_cache(k_cache, v_cache)
    check_tensor(slot_mapping, "slot_mapping", 1, (torch.int64, torch.int32))
    if key.shape != value.shape:
        raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} differ")
    if key.shape[1:] != k_cache.shape[2:]:
        raise ValueError(f"key heads/head_dim {tuple(key.shape[1:])} != cache {tuple(k_cache.shape[2:])}")
    if slot_mapping.shape[0] != key.shape[0]:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries for {key.shape[0]} tokens")
    if not is_fp8(k_cache.dtype):
        if k_cache.dtype != key.dtype:
            raise ValueError(f"cache dtype {k_cache.dtype} must be key dtype {key.dtype} or float8_e4m3fn")
    check_same_device(key=key, value=value, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)
    return check_scale(k_scale, "k_scale"), check_scale(v_scale, "v_scale")


def quantize_fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def store_kv_reference(key, value, k_cache, v_cache, slot_mapping, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    k_scale, v_scale = _check(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    if key.shape[0] == 0:
        return
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    _, _, hk, d = k_cache.shape
    for src, cache, scale in ((key, k_cache, k_scale), (value, v_cache, v_scale)):
        rows = src[keep]
        if is_fp8(cache.dtype):
            rows = quantize_fp8(rows, scale)
        # index_put is not implemented for float8 on every backend; bytes are bytes.
        flat = cache.view(-1, hk, d)
        if is_fp8(cache.dtype):
            flat.view(torch.uint8)[slots] = rows.view(torch.uint8)
        else:
            flat[slots] = rows


_NATIVE_ARGS = (
    cpu_native.PTR,
    cpu_native.I64,
    cpu_native.I64,
    cpu_native.PTR,
    cpu_native.I64,
    cpu_native.I64,
    cpu_native.PTR,
    cpu_native.PTR,
    cpu_native.PTR,
    cpu_native.I64,
    cpu_native.I32,
    cpu_native.I32,
    cpu_native.I64,
    cpu_native.I32,
)


def _native_fn():
    return cpu_native.function("kv_store", "baton_store_kv", _NATIVE_ARGS)


def native_built() -> bool:
    """Whether the native library loads on this machine (built, or found cached, once per process)."""
    return _native_fn() is not None


def native_available(key, k_cache) -> bool:
    """Whether store_kv_cpu handles these tensors (CPU, cache of key's float dtype, built library);
    FP8 caches need quantizing and stay on the reference."""
    return (
        isinstance(key, torch.Tensor)
        and isinstance(k_cache, torch.Tensor)
        and k_cache.device.type == "cpu"
        and not is_fp8(k_cache.dtype)
        and k_cache.dtype == key.dtype
        and _native_fn() is not None
    )


def store_kv_cpu(key, value, k_cache, v_cache, slot_mapping, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """The native CPU kernel (kernels/csrc/kv_store.cpp); same contract as the reference."""
    _check(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    if not native_available(key, k_cache):
        raise ValueError(f"no native CPU store_kv for {key.dtype} into a {k_cache.dtype} cache")
    check_last_dim_contiguous(key, "key")
    check_last_dim_contiguous(value, "value")
    slots = slot_mapping.to(torch.int64).contiguous()
    nb, bs, hk, d = k_cache.shape
    err = _native_fn()(
        key.data_ptr(),
        key.stride(0),
        key.stride(1),
        value.data_ptr(),
        value.stride(0),
        value.stride(1),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        slots.data_ptr(),
        key.shape[0],
        hk,
        d,
        nb * bs,
        key.element_size(),
    )
    if err != 0:
        raise ValueError(
            f"slot_mapping has a slot past the cache's {nb * bs} slots"
            if err == 2
            else f"native store_kv failed with status {err}"
        )


@lazy_jit
def _store_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    H,
    D,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    k_scale,
    v_scale,
    QUANT: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot >= 0:
        h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        d = tl.arange(0, BLOCK_D)
        mask = (h[:, None] < H) & (d[None, :] < D)
        # The cache is contiguous, so a slot is a flat row of H * D elements.
        dst = slot * H * D + h[:, None] * D + d[None, :]
        k = tl.load(key_ptr + tok * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask, other=0.0)
        v = tl.load(value_ptr + tok * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask, other=0.0)
        if QUANT:
            # Round to the nearest e4m3 value by hand so the final cast is exact: the Triton
            # interpreter's fp8 cast loses the mantissa carry, and this keeps GPU and CPU bit-equal.
            k = tl.clamp(tl.div_rn(k.to(tl.float32), k_scale), -448.0, 448.0)
            kb = k.to(tl.uint32, bitcast=True)
            ka = (kb & 0x7FFFFFFF).to(tl.float32, bitcast=True)
            kr = tl.where(
                ka < 0.015625,
                ((ka + 24576.0) - 24576.0).to(tl.uint32, bitcast=True),
                ((kb & 0x7FFFFFFF) + 0x7FFFF + ((kb >> 20) & 1)) & 0x7FF00000,
            )
            k = (kr | (kb & 0x80000000)).to(tl.float32, bitcast=True)
            v = tl.clamp(tl.div_rn(v.to(tl.float32), v_scale), -448.0, 448.0)
            vb = v.to(tl.uint32, bitcast=True)
            va = (vb & 0x7FFFFFFF).to(tl.float32, bitcast=True)
            vr = tl.where(
                va < 0.015625,
                ((va + 24576.0) - 24576.0).to(tl.uint32, bitcast=True),
                ((vb & 0x7FFFFFFF) + 0x7FFFF + ((vb >> 20) & 1)) & 0x7FF00000,
            )
            v = (vr | (vb & 0x80000000)).to(tl.float32, bitcast=True)
        tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv_triton(key, value, k_cache, v_cache, slot_mapping, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    k_scale, v_scale = _check(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    check_last_dim_contiguous(key, "key")
    check_last_dim_contiguous(value, "value")
    require(slot_mapping.is_contiguous(), "slot_mapping must be contiguous")
    T, H, D = key.shape
    if T == 0:
        return
    plan = store_kv_plan(DeviceSpec.of(key.device), num_heads=H, head_dim=D, kv_dtype=k_cache.dtype)
    block_h = plan.meta["BLOCK_H"]
    _store_kv_kernel[(T, (H + block_h - 1) // block_h)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        H,
        D,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_scale,
        v_scale,
        **plan.launch_kwargs(),
    )
