"""The kernel entry points the engine calls, chosen once: `kernel_ops(backend, device)` returns a
KernelOps whose attributes are the functions to call, so no call on the hot path decides anything.

Backends (EngineConfig.kernel_backend):
- "auto": Triton on CUDA (the PyTorch references when Triton is missing); on the CPU, the native
  C++ kernel (kernels/cpu_native.py) where an op has one and it builds, else the PyTorch reference.
- "native": "auto" on the CPU; the native kernels exist only there.
- "triton": the Triton kernels; on the CPU only under TRITON_INTERPRET=1 (how the tests check them).
- "reference": the PyTorch references, which are production code, not just test oracles.

The native kernels handle some dtypes and shapes only; each native op checks its inputs (a few
attribute reads) and runs the reference for the others, e.g. the FP8 KV store. A native library
that cannot be built (no compiler, unwritable cache) leaves its op on the reference, with a warning.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kernels import (
    block_copy,
    decode_attention,
    fp8_quant,
    kv_store,
    prefill_attention,
    rotary,
    sampling,
    silu_mul,
    token_bitmask,
)
from kernels import fp8_gemm as _fp8_gemm
from kernels import fused_moe as _fused_moe
from kernels import gelu_tanh_and_mul as gelu_mul
from kernels import rms_norm as _rms_norm
from kernels._triton_compat import HAS_TRITON, interpreting

# Module-level pack/unpack for callers without a KernelOps (the KV transports): Triton on CUDA tensors.
from kernels.block_copy import pack_kv_blocks, unpack_kv_blocks

__all__ = ["BACKENDS", "KernelOps", "kernel_ops", "resolve_backend", "pack_kv_blocks", "unpack_kv_blocks"]

log = logging.getLogger(__name__)

BACKENDS = ("auto", "triton", "native", "reference")

Op = Callable[..., Any]


@dataclass(frozen=True)
class KernelOps:
    """The resolved kernels. `backend` is what ran the choice: "triton", "native" (native CPU
    kernels where they apply, references elsewhere) or "reference"."""

    backend: str
    rms_norm: Op  # (x, weight, eps, residual=None) -> out, or (out, x + residual)
    rotary_embedding: Op  # (positions, q, k, cos_sin_cache) -> None, in place
    silu_and_mul: Op  # (x) -> silu(x[:, :I]) * x[:, I:]
    store_kv: Op  # (key, value, k_cache, v_cache, slot_mapping, k_scale=1.0, v_scale=1.0) -> None
    # (q, k_cache, v_cache, block_tables, context_lens, scale, k_scale, v_scale, *, window=None, softcap=None)
    paged_decode_attention: Op
    # (q, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale, ..., *, window=None, softcap=None)
    paged_prefill_attention: Op
    scaled_fp8_quant: Op  # (x, scale=None, per_token=False) -> (fp8, scale)
    fp8_gemm: Op  # (a, b, scale_a, scale_b, out_dtype, bias=None)
    pack_kv_blocks: Op  # (kv_cache, block_ids) -> packed
    unpack_kv_blocks: Op  # (kv_cache, block_ids, packed) -> None
    exponential_race: Op  # (logits, inv_temperature, keys) -> token ids: the sampler's draw
    fused_moe: Op  # (x, w13, w2, topk_weights, topk_ids) -> the weighted sum of each token's experts' MLPs
    gelu_tanh_and_mul: Op = gelu_mul.gelu_tanh_and_mul_reference  # (x) -> gelu_tanh(x[:, :I]) * x[:, I:] (Gemma)
    # (logits, bitmask, rows) -> None, in place: a grammar's disallowed tokens -> -inf (structured output)
    apply_token_bitmask: Op = token_bitmask.apply_token_bitmask_reference


def resolve_backend(backend: str, device: torch.device | str) -> str:
    """ "triton", "native" or "reference" for `backend` on `device`; ValueError when it cannot run there."""
    if backend not in BACKENDS:
        raise ValueError(f"kernel_backend must be one of {BACKENDS}, got {backend!r}")
    device_type = torch.device(device).type
    if backend == "reference":
        return backend
    if backend == "triton":
        if not HAS_TRITON:
            raise ValueError("kernel_backend 'triton' needs triton, which is not installed")
        if device_type != "cuda" and not interpreting():
            raise ValueError(
                f"kernel_backend 'triton' on {device_type} tensors needs TRITON_INTERPRET=1 (the Triton interpreter)"
            )
        return backend
    if device_type == "cpu":
        return "native"
    if backend == "native":
        raise ValueError(f"kernel_backend 'native' runs on the CPU only, not on {device_type}")
    if device_type == "cuda" and HAS_TRITON:
        return "triton"
    log.warning("no Triton kernels for %s tensors here: the PyTorch reference kernels run", device_type)
    return "reference"


def _native_or_reference(built: bool, native: Op, reference: Op, supports: Op) -> Op:
    """The native kernel for the inputs `supports` accepts, the reference for the others; the
    reference alone when the native library did not build."""
    if not built:
        return reference

    def op(*args, **kwargs):
        return (native if supports(*args, **kwargs) else reference)(*args, **kwargs)

    op.__name__ = op.__qualname__ = native.__name__.removesuffix("_cpu")
    return op


def kernel_ops(backend: str = "auto", device: torch.device | str = "cpu") -> KernelOps:
    """The kernels for `backend` (one of BACKENDS) on `device`; see the module docstring."""
    resolved = resolve_backend(backend, device)
    if resolved == "triton":
        return KernelOps(
            "triton",
            _rms_norm.rms_norm_triton,
            rotary.rotary_embedding_triton,
            silu_mul.silu_and_mul_triton,
            kv_store.store_kv_triton,
            decode_attention.paged_decode_attention_triton,
            prefill_attention.paged_prefill_attention_triton,
            fp8_quant.scaled_fp8_quant_triton,
            _fp8_gemm.fp8_gemm_triton,
            block_copy.pack_kv_blocks_triton,
            block_copy.unpack_kv_blocks_triton,
            # One pass of elementwise ops and an argmax: the PyTorch reference is already fused enough on CUDA.
            sampling.exponential_race_reference,
            _fused_moe.fused_moe_triton,
            gelu_mul.gelu_tanh_and_mul_triton,
            token_bitmask.apply_token_bitmask_gpu,
        )
    references: dict[str, Op] = dict(
        rms_norm=_rms_norm.rms_norm_reference,
        rotary_embedding=rotary.rotary_embedding_reference,
        silu_and_mul=silu_mul.silu_and_mul_reference,
        store_kv=kv_store.store_kv_reference,
        paged_decode_attention=decode_attention.paged_decode_attention_reference,
        paged_prefill_attention=prefill_attention.paged_prefill_attention_reference,
        scaled_fp8_quant=fp8_quant.scaled_fp8_quant_reference,
        fp8_gemm=_fp8_gemm.fp8_gemm_reference,
        pack_kv_blocks=block_copy.pack_kv_blocks_reference,
        unpack_kv_blocks=block_copy.unpack_kv_blocks_reference,
        exponential_race=sampling.exponential_race_reference,
        fused_moe=_fused_moe.fused_moe_reference,
        gelu_tanh_and_mul=gelu_mul.gelu_tanh_and_mul_reference,
        apply_token_bitmask=token_bitmask.apply_token_bitmask_reference,
    )
    if resolved == "reference":
        return KernelOps("reference", **references)
    native: dict[str, Op] = dict(
        rms_norm=_native_or_reference(
            _rms_norm.native_built(),
            _rms_norm.rms_norm_cpu,
            references["rms_norm"],
            lambda x, weight, eps, residual=None: _rms_norm.native_available(x, weight),
        ),
        rotary_embedding=_native_or_reference(
            rotary.native_built(),
            rotary.rotary_embedding_cpu,
            references["rotary_embedding"],
            lambda positions, q, k, cos_sin_cache: rotary.native_available(q),
        ),
        silu_and_mul=_native_or_reference(
            silu_mul.native_built(), silu_mul.silu_and_mul_cpu, references["silu_and_mul"], silu_mul.native_available
        ),
        store_kv=_native_or_reference(
            kv_store.native_built(),
            kv_store.store_kv_cpu,
            references["store_kv"],
            lambda key, value, k_cache, *rest, **kw: kv_store.native_available(key, k_cache),
        ),
        paged_decode_attention=_native_or_reference(
            decode_attention.native_built(),
            decode_attention.paged_decode_attention_cpu,
            references["paged_decode_attention"],
            lambda q, k_cache, *rest, **kw: decode_attention.native_available(q, k_cache),
        ),
        paged_prefill_attention=_native_or_reference(
            prefill_attention.native_built(),
            prefill_attention.paged_prefill_attention_cpu,
            references["paged_prefill_attention"],
            lambda q, k_cache, *rest, **kw: prefill_attention.native_available(q, k_cache),
        ),
        exponential_race=_native_or_reference(
            sampling.native_built(),
            sampling.exponential_race_cpu,
            references["exponential_race"],
            sampling.native_available,
        ),
        gelu_tanh_and_mul=_native_or_reference(
            gelu_mul.native_built(),
            gelu_mul.gelu_tanh_and_mul_cpu,
            references["gelu_tanh_and_mul"],
            gelu_mul.native_available,
        ),
        apply_token_bitmask=_native_or_reference(
            token_bitmask.native_built(),
            token_bitmask.apply_token_bitmask_cpu,
            references["apply_token_bitmask"],
            token_bitmask.native_available,
        ),
        # The reference's per-expert matmuls with the native SiLU-and-mul between them (the plain
        # reference when the native library is not built).
        fused_moe=functools.partial(
            _fused_moe.fused_moe_reference,
            silu_and_mul=_native_or_reference(
                True, silu_mul.silu_and_mul_cpu, references["silu_and_mul"], silu_mul.native_available
            ),
        )
        if silu_mul.native_built()
        else references["fused_moe"],
    )
    return KernelOps("native", **{**references, **native})
