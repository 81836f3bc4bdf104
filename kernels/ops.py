"""The kernel entry points the engine calls: Triton on CUDA tensors, PyTorch references otherwise.

`BATON_KERNELS` (read at each call) forces the choice: `auto` (default), `triton` (also on CPU
tensors, which needs `TRITON_INTERPRET=1`; that is how the tests check the kernels), or
`reference`. In `auto` mode CPU tensors go to a native C++ kernel (kernels/cpu_native.py) where
there is one and it can be built: decode and prefill attention, RMSNorm, rotary embedding,
SiLU-and-mul and the KV store. Every other op, and every op without a compiler, runs its PyTorch
reference, which is therefore production code, not just a test oracle.
"""

from __future__ import annotations

import os

import torch

from kernels import (block_copy, decode_attention, fp8_gemm as _fp8_gemm, fp8_quant, kv_store, prefill_attention,
                     rms_norm as _rms_norm, rotary, silu_mul)
from kernels._triton_compat import HAS_TRITON, interpreting
from kernels.rotary import build_rope_cache

__all__ = [
    "backend_for", "rms_norm", "rotary_embedding", "build_rope_cache", "silu_and_mul", "store_kv",
    "paged_decode_attention", "paged_prefill_attention", "scaled_fp8_quant", "fp8_gemm",
    "pack_kv_blocks", "unpack_kv_blocks",
]

_MODES = ("auto", "triton", "reference")


def backend_for(tensor: torch.Tensor) -> str:
    """"triton", "native" (auto mode on a CPU tensor) or "reference" for an op whose main input is `tensor`.

    Ops without a native CPU kernel treat "native" as "reference"."""
    mode = os.environ.get("BATON_KERNELS", "auto").strip().lower() or "auto"
    if mode not in _MODES:
        raise ValueError(f"BATON_KERNELS must be one of {_MODES}, got {mode!r}")
    on_cuda = bool(getattr(tensor, "is_cuda", False))
    if mode == "auto":
        if on_cuda:
            return "triton" if HAS_TRITON else "reference"
        return "native"
    if mode == "triton":
        if not HAS_TRITON:
            raise ValueError("BATON_KERNELS=triton but triton is not installed")
        if not on_cuda and isinstance(tensor, torch.Tensor) and not interpreting():
            raise ValueError("BATON_KERNELS=triton with CPU tensors needs TRITON_INTERPRET=1 (the Triton interpreter)")
    return mode


def _choose(tensor, triton_fn, native_ok, native_fn, reference_fn):
    """The implementation for an op whose main input is `tensor`; native_ok() is asked only when
    auto mode picks "native" (it checks dtypes and that the library builds)."""
    backend = backend_for(tensor)
    if backend == "triton":
        return triton_fn
    if backend == "native" and native_ok():
        return native_fn
    return reference_fn


def rms_norm(x, weight, eps: float, residual=None):
    fn = _choose(x, _rms_norm.rms_norm_triton, lambda: _rms_norm.native_available(x, weight),
                 _rms_norm.rms_norm_cpu, _rms_norm.rms_norm_reference)
    return fn(x, weight, eps, residual)


def rotary_embedding(positions, q, k, cos_sin_cache) -> None:
    fn = _choose(q, rotary.rotary_embedding_triton, lambda: rotary.native_available(q),
                 rotary.rotary_embedding_cpu, rotary.rotary_embedding_reference)
    fn(positions, q, k, cos_sin_cache)


def silu_and_mul(x):
    fn = _choose(x, silu_mul.silu_and_mul_triton, lambda: silu_mul.native_available(x),
                 silu_mul.silu_and_mul_cpu, silu_mul.silu_and_mul_reference)
    return fn(x)


def store_kv(key, value, k_cache, v_cache, slot_mapping, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    fn = _choose(k_cache, kv_store.store_kv_triton, lambda: kv_store.native_available(key, k_cache),
                 kv_store.store_kv_cpu, kv_store.store_kv_reference)
    fn(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale: float,
                           k_scale: float = 1.0, v_scale: float = 1.0):
    fn = _choose(q, decode_attention.paged_decode_attention_triton,
                 lambda: decode_attention.native_available(q, k_cache),
                 decode_attention.paged_decode_attention_cpu, decode_attention.paged_decode_attention_reference)
    return fn(q, k_cache, v_cache, block_tables, context_lens, scale, k_scale, v_scale)


def paged_prefill_attention(q, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale: float,
                            k_scale: float = 1.0, v_scale: float = 1.0):
    fn = _choose(q, prefill_attention.paged_prefill_attention_triton,
                 lambda: prefill_attention.native_available(q, k_cache),
                 prefill_attention.paged_prefill_attention_cpu, prefill_attention.paged_prefill_attention_reference)
    return fn(q, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale, k_scale, v_scale)


def scaled_fp8_quant(x, scale=None, per_token: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    fn = fp8_quant.scaled_fp8_quant_triton if backend_for(x) == "triton" else fp8_quant.scaled_fp8_quant_reference
    return fn(x, scale, per_token)


def fp8_gemm(a, b, scale_a, scale_b, out_dtype, bias=None):
    fn = _fp8_gemm.fp8_gemm_triton if backend_for(a) == "triton" else _fp8_gemm.fp8_gemm_reference
    return fn(a, b, scale_a, scale_b, out_dtype, bias)


def pack_kv_blocks(kv_cache, block_ids) -> torch.Tensor:
    fn = block_copy.pack_kv_blocks_triton if backend_for(kv_cache) == "triton" else block_copy.pack_kv_blocks_reference
    return fn(kv_cache, block_ids)


def unpack_kv_blocks(kv_cache, block_ids, packed) -> None:
    fn = (block_copy.unpack_kv_blocks_triton if backend_for(kv_cache) == "triton"
          else block_copy.unpack_kv_blocks_reference)
    fn(kv_cache, block_ids, packed)
