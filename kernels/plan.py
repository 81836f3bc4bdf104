"""Launch plans: every choice a Triton host wrapper makes (tiles, warps, stages, splits, dot
precision, which specialisation) as a pure function of a described device and the problem shape.

The wrappers call `*_plan(DeviceSpec.of(tensor.device), ...)`; tests/kernels/test_compile_targets.py
calls the same functions with the described targets in TARGETS and compiles what they choose ahead
of time for sm_80/sm_89/sm_90/sm_100, so the check sees exactly what a GPU would launch. Nothing
here touches a GPU: `DeviceSpec.of` queries CUDA only for a CUDA device. The device description,
the targets and the FP8 rule are kernels/device_spec.py's (importable from here too); the docs'
table of these plans is kernels/plan_table.py's.

The CPU rows (kind "cpu") are the Triton interpreter's plans (the tests' path); they keep the tiles
the kernels were first written with, so the interpreter's results do not change.

Accuracy contract (what the CUDA choices keep):
- bfloat16 / float16 models: dots on 16-bit operands with float32 accumulation.
- float32 models on CUDA: attention dots run in TF32 (`input_precision="tf32"`, 10-bit mantissa
  operands, float32 accumulation), never IEEE fp32 on the FMA units: that spilled and needed more
  shared memory than sm_86/sm_89 have. Attention output stays within 1e-3 relative (Frobenius norm)
  of the float64 reference (tests/kernels/test_kernel_plan.py emulates the TF32 rounding on the CPU).
- The CPU (native, reference and interpreter) keeps float32 dots in IEEE precision: there greedy
  decoding matches the float32 reference token for token.
- FP8 (KV cache, quantization, GEMM) needs native FP8 conversions, compute capability >= 8.9:
  `check_fp8_supported` raises a ValueError naming the GPU and the alternative below that.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from kernels._triton_compat import cdiv, next_pow2
from kernels.device_spec import TARGETS, DeviceSpec, check_fp8_supported, fp8_supported

__all__ = [
    "DeviceSpec",
    "LaunchPlan",
    "DecodePlan",
    "TARGETS",
    "check_fp8_supported",
    "fp8_supported",
    "decode_attention_plan",
    "merge_splits_plan",
    "prefill_attention_plan",
    "fp8_gemm_plan",
    "fp8_quant_plan",
    "store_kv_plan",
    "rms_norm_plan",
    "rotary_plan",
    "silu_mul_plan",
    "block_copy_plan",
    "block_sums_plan",
    "MoePlan",
    "fused_moe_plan",
]

FP8 = torch.float8_e4m3fn


@dataclass(frozen=True)
class LaunchPlan:
    """One kernel launch's compile-time choices: its constexprs and launch options."""

    kernel: str  # "module:function" of the kernel, e.g. "kernels.decode_attention:_decode_split_kernel"
    meta: Mapping[str, Any] = field(hash=False)  # constexpr arguments
    num_warps: int = 4
    num_stages: int | None = None  # None: Triton's default

    def launch_kwargs(self) -> dict[str, Any]:
        kw = dict(self.meta, num_warps=self.num_warps)
        if self.num_stages is not None:
            kw["num_stages"] = self.num_stages
        return kw

    def __hash__(self) -> int:
        return hash((self.kernel, tuple(sorted(self.meta.items())), self.num_warps, self.num_stages))


def _dtype(d) -> torch.dtype:
    return d if isinstance(d, torch.dtype) else getattr(torch, str(d))


# -- attention ---------------------------------------------------------------------------------------


def _dot_precision(device: DeviceSpec, dtype: torch.dtype) -> tuple[bool, str]:
    """(DOT_F32, PRECISION) for attention dots on `dtype` activations.

    float32 on CUDA: TF32 tensor cores (the accuracy contract above). float32 on the CPU: IEEE.
    The interpreter multiplies bfloat16 dot operands as raw bits, so under it bfloat16 is widened to
    float32 too."""
    if dtype == torch.float32:
        return True, "tf32" if device.is_cuda else "ieee"
    if dtype == torch.bfloat16 and (device.interpreted or not device.is_cuda):
        return True, "ieee"
    return False, "tf32"  # ignored for 16-bit operands


def _fp8_via_float32(device: DeviceSpec, dtype: torch.dtype, kv_dtype: torch.dtype) -> dict[str, bool]:
    """Triton 3.6 converts FP8 to bfloat16 through float16 with `cvt.bf16.f16`, an sm_90
    instruction that ptxas refuses for sm_89: there FP8 K/V tiles go through float32 instead."""
    below_sm90 = device.is_cuda and device.capability < (9, 0)
    return {"FP8_VIA_F32": True} if below_sm90 and kv_dtype == FP8 and dtype == torch.bfloat16 else {}


@dataclass(frozen=True)
class DecodePlan:
    split: LaunchPlan  # the split-K kernel
    merge: LaunchPlan | None  # the merge kernel, None with a single split
    num_splits: int
    split_len: int  # context tokens per split, a multiple of BLOCK_N


@functools.lru_cache(maxsize=1024)
def decode_attention_plan(
    device: DeviceSpec,
    *,
    batch: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    max_ctx: int,
    dtype,
    kv_dtype,
    num_splits: int | None = None,
) -> DecodePlan:
    """Split-K decode attention. `max_ctx` bounds the context (block table width * block size)."""
    dtype, kv_dtype = _dtype(dtype), _dtype(kv_dtype)
    if kv_dtype == FP8:
        check_fp8_supported(device, "an FP8 KV cache")
    group = num_q_heads // num_kv_heads
    block_n = 64
    num_warps, num_stages = 4, 2
    dot_f32, precision = _dot_precision(device, dtype)
    if num_splits is None:
        # Enough programs to fill the GPU twice over, but no split shorter than 256 tokens.
        want = cdiv(2 * device.sm_count, max(batch * num_kv_heads, 1))
        num_splits = max(1, min(want, cdiv(max_ctx, 256), 64))
    if not (isinstance(num_splits, int) and not isinstance(num_splits, bool) and num_splits >= 1):
        raise ValueError(f"num_splits must be a positive int, got {num_splits!r}")
    split_len = cdiv(cdiv(max_ctx, num_splits), block_n) * block_n
    num_splits = cdiv(max_ctx, split_len)
    split = LaunchPlan(
        "kernels.decode_attention:_decode_split_kernel",
        dict(
            G=group,
            HK=num_kv_heads,
            D=head_dim,
            BS=block_size,
            NUM_SPLITS=num_splits,
            BLOCK_G=max(16, next_pow2(group)),
            BLOCK_N=block_n,
            BLOCK_D=max(16, next_pow2(head_dim)),
            DOT_F32=dot_f32,
            PRECISION=precision,
            **_fp8_via_float32(device, dtype, kv_dtype),
        ),
        num_warps,
        num_stages,
    )
    merge = merge_splits_plan(device, num_splits=num_splits, head_dim=head_dim) if num_splits > 1 else None
    return DecodePlan(split, merge, num_splits, split_len)


@functools.lru_cache(maxsize=256)
def merge_splits_plan(device: DeviceSpec, *, num_splits: int, head_dim: int) -> LaunchPlan:
    return LaunchPlan(
        "kernels.decode_attention_reduce:_merge_kernel",
        dict(S=num_splits, D=head_dim, BLOCK_S=max(2, next_pow2(num_splits)), BLOCK_D=next_pow2(head_dim)),
        4,
    )


@functools.lru_cache(maxsize=1024)
def prefill_attention_plan(
    device: DeviceSpec,
    *,
    max_q: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype,
    kv_dtype,
    windowed: bool = False,
) -> LaunchPlan:
    """Paged prefill attention; `max_q` is the longest sequence's count of new tokens; `windowed`:
    a sliding window masks keys (the query tile may then be no taller than the key tile)."""
    dtype, kv_dtype = _dtype(dtype), _dtype(kv_dtype)
    if kv_dtype == FP8:
        check_fp8_supported(device, "an FP8 KV cache")
    block_m = 16 if max_q <= 16 else 32 if max_q <= 64 else 64
    num_warps, block_n = 4, 64
    dot_f32, precision = _dot_precision(device, dtype)
    if device.is_cuda:
        if dtype == torch.float32:
            # float32 (TF32) tiles are twice the bytes: 128 x 64 tiles needed 164 KB of shared memory
            # (sm_86/sm_89 have 99 KiB) and 64 x 64 ones 160 KB; 64 x 32 need at most 96 KiB.
            block_n = 32
            if kv_dtype == FP8 and device.capability < (9, 0):
                # sm_89 converts FP8 tiles in registers: 64 x 32 spilled 28 B with Triton 3.6.
                block_m = min(block_m, 32)
        elif max_q >= 128:
            # Long prompts: bigger tiles amortise each K/V tile over more queries.
            block_m, num_warps = 128, 8
        if block_m == 16:
            block_n = 32  # 16 x 64 spilled 8 B on sm_90 / sm_100 at 4 warps; 16 x 32 does not
        if block_m == 128 and kv_dtype == FP8 and device.capability < (9, 0):
            block_n = 32  # sm_89 converts FP8 K/V tiles in registers: 128 x 64 spilled 56 B there
    if windowed and block_m > block_n:
        # A window starts each query row's keys at a different place: the kernel begins a tile's key
        # loop at its first row's first visible key, so every row must find a key in the first key
        # tile (else a row is all masked and its softmax is NaN).
        block_m, num_warps = block_n, 4
    return LaunchPlan(
        "kernels.prefill_attention:_prefill_kernel",
        dict(
            G=num_q_heads // num_kv_heads,
            HK=num_kv_heads,
            D=head_dim,
            BS=block_size,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            BLOCK_D=max(16, next_pow2(head_dim)),
            DOT_F32=dot_f32,
            PRECISION=precision,
            **_fp8_via_float32(device, dtype, kv_dtype),
        ),
        num_warps,
        2,
    )


# -- FP8 GEMM and quantization -----------------------------------------------------------------------


@functools.lru_cache(maxsize=1024)
def fp8_gemm_plan(
    device: DeviceSpec,
    *,
    M: int,
    N: int,
    K: int,
    has_bias: bool = False,
    sa_per_row: bool = False,
    sb_per_col: bool = False,
) -> LaunchPlan:
    check_fp8_supported(device, "the FP8 GEMM")
    flags = dict(SA_PER_ROW=sa_per_row, SB_PER_COL=sb_per_col, HAS_BIAS=has_bias)
    name = "kernels.fp8_gemm:_fp8_gemm_kernel"
    if not device.is_cuda:
        # Interpreter: small tiles keep numpy fast; 16 is tl.dot's minimum.
        return LaunchPlan(
            name,
            dict(
                flags,
                BLOCK_M=max(16, min(next_pow2(M), 32)),
                BLOCK_N=max(16, min(next_pow2(N), 32)),
                BLOCK_K=max(16, min(next_pow2(K), 64)),
                GROUP_M=4,
            ),
            4,
            1,
        )
    # BLOCK_M stays >= 64 so Hopper's warp-group MMA applies even to decode-sized M.
    if M <= 64:
        return LaunchPlan(name, dict(flags, BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, GROUP_M=8), 4, 4)
    if device.capability < (9, 0):
        # No warp-group MMA before Hopper: the 128 x 256 tile on mma.sync spilled 112 B on sm_89.
        return LaunchPlan(name, dict(flags, BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, GROUP_M=8), 8, 3)
    if device.capability[0] >= 10 and has_bias:
        # sm_100: with a bias (and per-row / per-column scales) the 128 x 256 tile's epilogue spilled
        # 112 B at 255 registers, at any stage count; 128 x 128 at 4 stages does not.
        return LaunchPlan(name, dict(flags, BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, GROUP_M=8), 8, 4)
    return LaunchPlan(name, dict(flags, BLOCK_M=128, BLOCK_N=256, BLOCK_K=128, GROUP_M=8), 8, 3)


@functools.lru_cache(maxsize=256)
def fp8_quant_plan(
    device: DeviceSpec, *, N: int, dynamic_row: bool, scale_per_row: bool, min_scale: float
) -> LaunchPlan:
    check_fp8_supported(device, "FP8 quantization")
    return LaunchPlan(
        "kernels.fp8_quant:_fp8_quant_kernel",
        dict(DYNAMIC_ROW=dynamic_row, SCALE_PER_ROW=scale_per_row, MIN_S=min_scale, BLOCK=min(next_pow2(N), 1024)),
        4,
    )


# -- fused mixture of experts ------------------------------------------------------------------------


@dataclass(frozen=True)
class MoePlan:
    """The two grouped-GEMM launches of kernels.fused_moe; both tile the same expert-sorted rows."""

    block_m: int  # rows per tile, and the padding of each expert's run of (token, slot) pairs
    gate_up: LaunchPlan
    down: LaunchPlan


@functools.lru_cache(maxsize=1024)
def fused_moe_plan(
    device: DeviceSpec, *, num_pairs: int, num_experts: int, hidden: int, inter: int, dtype, top_k: int
) -> MoePlan:
    """`num_pairs` = tokens * top_k; `inter` is one expert's intermediate size. float32 dots follow
    the attention contract above (TF32 on CUDA, IEEE on the CPU)."""
    dtype = _dtype(dtype)
    dot_f32, precision = _dot_precision(device, dtype)
    name = "kernels.fused_moe:_moe_gemm_kernel"
    common = dict(TOP_K=top_k, DOT_F32=dot_f32, PRECISION=precision)
    gated = dict(common, GATED=True, A_PER_TOKEN=True, MUL_WEIGHT=False)
    weighted = dict(common, GATED=False, A_PER_TOKEN=False, MUL_WEIGHT=True)
    if not device.is_cuda:
        # Interpreter: small tiles keep numpy fast; 16 is tl.dot's minimum.
        bm = 16
        return MoePlan(
            bm,
            LaunchPlan(
                name,
                dict(
                    gated,
                    BLOCK_M=bm,
                    BLOCK_N=max(16, min(next_pow2(inter), 32)),
                    BLOCK_K=max(16, min(next_pow2(hidden), 64)),
                ),
                4,
                1,
            ),
            LaunchPlan(
                name,
                dict(
                    weighted,
                    BLOCK_M=bm,
                    BLOCK_N=max(16, min(next_pow2(hidden), 32)),
                    BLOCK_K=max(16, min(next_pow2(inter), 64)),
                ),
                4,
                1,
            ),
        )
    # Rows per expert decide the tile height: decode batches give each expert a handful of rows,
    # and padding each run to a tall tile would waste the tensor cores on zeros.
    per_expert = cdiv(num_pairs, num_experts)
    bm = 16 if per_expert <= 16 else 32 if per_expert <= 64 else 64
    # float32 (TF32) tiles are twice the bytes: half the K depth keeps the stages in shared memory.
    bk = 32 if dtype == torch.float32 else 64
    return MoePlan(
        bm,
        LaunchPlan(name, dict(gated, BLOCK_M=bm, BLOCK_N=64, BLOCK_K=bk), 4, 3),
        LaunchPlan(name, dict(weighted, BLOCK_M=bm, BLOCK_N=64 if bm <= 32 else 128, BLOCK_K=bk), 4, 3),
    )


# -- the elementwise kernels -------------------------------------------------------------------------


@functools.lru_cache(maxsize=256)
def store_kv_plan(device: DeviceSpec, *, num_heads: int, head_dim: int, kv_dtype) -> LaunchPlan:
    quant = _dtype(kv_dtype) == FP8
    if quant:
        check_fp8_supported(device, "an FP8 KV cache")
    return LaunchPlan(
        "kernels.kv_store:_store_kv_kernel",
        dict(QUANT=quant, BLOCK_H=min(next_pow2(num_heads), 8), BLOCK_D=next_pow2(head_dim)),
        4,
    )


@functools.lru_cache(maxsize=256)
def rms_norm_plan(device: DeviceSpec, *, hidden: int, has_residual: bool) -> LaunchPlan:
    block = next_pow2(hidden)
    return LaunchPlan(
        "kernels.rms_norm:_rms_norm_kernel", dict(HAS_RESIDUAL=has_residual, BLOCK=block), min(max(block // 256, 1), 16)
    )


@functools.lru_cache(maxsize=256)
def rotary_plan(device: DeviceSpec, *, num_heads: int, head_dim: int) -> LaunchPlan:
    half = head_dim // 2
    return LaunchPlan(
        "kernels.rotary:_rotary_kernel",
        dict(HALF=half, BLOCK_H=min(next_pow2(num_heads), 16), BLOCK_HALF=next_pow2(half)),
        4,
    )


@functools.lru_cache(maxsize=16)
def silu_mul_plan(device: DeviceSpec) -> LaunchPlan:
    return LaunchPlan("kernels.silu_mul:_silu_mul_kernel", dict(BLOCK=1024), 4)


@functools.lru_cache(maxsize=16)
def block_copy_plan(device: DeviceSpec, *, scatter: bool) -> LaunchPlan:
    return LaunchPlan("kernels.block_copy:_block_copy_kernel", dict(SCATTER=scatter, BLOCK=1024), 4)


@functools.lru_cache(maxsize=16)
def block_sums_plan(device: DeviceSpec) -> LaunchPlan:
    # 256 int64 words (2 KiB) per load: a block's pieces are at least that on the shapes served.
    return LaunchPlan("kernels.block_checksum:_block_sums_kernel", dict(BLOCK=256), 4)
