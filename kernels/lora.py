"""Batched LoRA: each row of a batch adds its own adapter's low-rank update to a projection's output.

    y[r] += scaling[s] * B[s] @ (A[s] @ x[r])      where s = row_slots[r] >= 0 (-1: the base model alone)

A step's batch mixes the base model and several adapters (the S-LoRA / Punica idea): the adapters
resident on a worker sit in slots of one stacked tensor per projection, A [slots, max_rank, in]
and B [slots, out, max_rank], an adapter of a smaller rank zero-padded to max_rank, so one call
serves every row whatever its adapter's rank. The update runs in two products per slot: shrink
(x by A, down to the rank) and expand (by B, back up to the output's width).

`lora_add_` is the host wrapper: it checks shapes, dtypes and strides and updates y in place (y
may be a column slice of a fused projection's output, e.g. the q part of qkv), then picks:

- CUDA: Triton (`lora_add_triton_`), two launches and no host sync (decode CUDA graphs can capture
  it). Shrink: each program takes BLOCK_M rows, one BLOCK_R slice of the rank and one split of the
  input width, and for each distinct slot among its rows one tile product of those rows (the
  others masked to zero) by that slot's A, in float32; the splits' partial sums land in a float32
  [split_k, rows, max_rank] buffer (split-K gives decode batches, a tile or two of rows, enough
  programs to spread A's read over the GPU). Expand: each program takes BLOCK_M rows and BLOCK_N
  outputs, sums the partials, and for each distinct slot adds those rows' product by B's tile, then
  scales by the row's slot's scaling and adds into y in float32; rows of slot -1 are neither read
  nor written. A batch of more than BLOCK_M rows is first sorted by slot on the device
  (`torch.sort`, stable), so a tile holds one adapter's rows, two at a boundary; a decode tile of
  mixed adapters loops over them, which costs what one row at a time would. Tiles, warps and the
  split come from `lora_plan` (a function of the described device and the shape, as kernels/plan.py's).
- CPU, float32 or bfloat16, native library built: the C++ kernel (kernels/csrc/lora.cpp,
  `lora_add_cpu_`): rows grouped by slot, shrink then expand per group of up to 8 rows of one
  slot, float32 throughout, OpenMP over (group, ranks) and (group, output chunk).
- Otherwise (float16 on the CPU, no compiler): `lora_add_grouped_`, the update in PyTorch grouped
  by slot (rows of one adapter in one product each).

`lora_add_reference` is the row-by-row float32 definition the tests compare against.

Slot ids must lie in [-1, slots) (any negative one means the base model). The CPU paths check it
(ValueError); the CUDA path cannot without waiting for the device, so there an id >= slots reads
out of bounds.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from kernels import cpu_native
from kernels._checks import FLOAT_DTYPES, check_last_dim_contiguous, check_same_device, check_tensor
from kernels._triton_compat import HAS_TRITON, cdiv, lazy_jit, next_pow2, tl
from kernels.plan import DeviceSpec, LaunchPlan, _dot_precision

__all__ = [
    "LoraPlan",
    "lora_add_",
    "lora_add_cpu_",
    "lora_add_grouped_",
    "lora_add_reference",
    "lora_add_triton_",
    "lora_plan",
    "native_available",
    "native_built",
]

SLOT_DTYPES = (torch.int32, torch.int64)


def lora_add_reference(
    y: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    row_slots: torch.Tensor,
    scaling: torch.Tensor,
) -> torch.Tensor:
    """y plus every row's update, row by row in float32 (a new tensor; y is not touched)."""
    out = y.float().clone()
    for r, s in enumerate(row_slots.tolist()):
        if s >= 0:
            out[r] += scaling[s].float() * (b[s].float() @ (a[s].float() @ x[r].float()))
    return out.to(y.dtype)


def _check(
    y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, row_slots: torch.Tensor, scaling: torch.Tensor
) -> None:
    check_tensor(x, "x", None, FLOAT_DTYPES)
    check_tensor(y, "y", None, FLOAT_DTYPES)
    check_tensor(a, "a", None, FLOAT_DTYPES)
    check_tensor(b, "b", None, FLOAT_DTYPES)
    check_tensor(row_slots, "row_slots", None, SLOT_DTYPES)
    check_tensor(scaling, "scaling", 1, (torch.float32,))
    if x.dim() != 2 or y.dim() != 2 or x.shape[0] != y.shape[0]:
        raise ValueError(
            f"lora_add_: x [rows, in] and y [rows, out] expected, got {tuple(x.shape)} and {tuple(y.shape)}"
        )
    if a.dim() != 3 or b.dim() != 3:
        raise ValueError(
            f"lora_add_: a [slots, rank, in] and b [slots, out, rank] expected, got {tuple(a.shape)}, {tuple(b.shape)}"
        )
    slots, rank, width = a.shape
    if width != x.shape[1] or b.shape != (slots, y.shape[1], rank):
        raise ValueError(
            f"lora_add_: shapes disagree: x {tuple(x.shape)}, y {tuple(y.shape)}, "
            f"a {tuple(a.shape)}, b {tuple(b.shape)}"
        )
    if row_slots.shape != (x.shape[0],):
        raise ValueError(
            f"lora_add_: row_slots must be an integer [rows] tensor, got {row_slots.dtype} {tuple(row_slots.shape)}"
        )
    if scaling.shape != (slots,):
        raise ValueError(f"lora_add_: scaling must be [slots], got {tuple(scaling.shape)}")
    if not (x.dtype == y.dtype == a.dtype == b.dtype):
        raise ValueError(f"lora_add_: x, y, a and b must share a dtype, got {x.dtype}, {y.dtype}, {a.dtype}, {b.dtype}")
    if y.shape[1] > 1 and y.stride(1) != 1:
        raise ValueError("lora_add_: y's rows must be contiguous (stride 1 along the output)")
    for t, name in ((x, "x"), (a, "a"), (b, "b")):
        check_last_dim_contiguous(t, name)
    check_same_device(y=y, x=x, a=a, b=b, row_slots=row_slots, scaling=scaling)


def _nothing_to_add(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor) -> bool:
    return y.numel() == 0 or a.shape[0] == 0 or a.shape[1] == 0 or x.shape[1] == 0


def _check_slot_range(slot_list: list[int], slots: int) -> None:
    if slot_list and max(slot_list) >= slots:
        raise ValueError(f"lora_add_: row_slots holds slot {max(slot_list)}, but a and b have {slots} slots")


def lora_add_(
    y: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    row_slots: torch.Tensor,
    scaling: torch.Tensor,
) -> None:
    """y[r] += scaling[s] * b[s] @ (a[s] @ x[r]) for every row r whose slot s = row_slots[r] is >= 0."""
    _check(y, x, a, b, row_slots, scaling)
    if x.device.type == "cuda" and HAS_TRITON:
        lora_add_triton_(y, x, a, b, row_slots, scaling)
    elif native_available(x):
        lora_add_cpu_(y, x, a, b, row_slots, scaling)
    else:
        lora_add_grouped_(y, x, a, b, row_slots, scaling)


# -- PyTorch, grouped by slot ----------------------------------------------------------------------


def lora_add_grouped_(
    y: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    row_slots: torch.Tensor,
    scaling: torch.Tensor,
) -> None:
    """The update in PyTorch, one pair of products per slot present (in the activation dtype)."""
    _check(y, x, a, b, row_slots, scaling)
    slots = row_slots.tolist()
    _check_slot_range(slots, a.shape[0])
    if _nothing_to_add(y, x, a):
        return
    for s in sorted(set(slots)):
        if s < 0:
            continue
        rows = [r for r, v in enumerate(slots) if v == s]
        if len(rows) == rows[-1] - rows[0] + 1:  # one run of rows (a decode batch sorted by adapter, a prompt)
            sl = slice(rows[0], rows[-1] + 1)
            y[sl] += (x[sl] @ a[s].t() @ b[s].t()) * scaling[s].to(y.dtype)
        else:
            idx = torch.tensor(rows, device=x.device)
            y[idx] += (x[idx] @ a[s].t() @ b[s].t()) * scaling[s].to(y.dtype)


# -- native CPU ------------------------------------------------------------------------------------

_NATIVE_ARGS = (
    cpu_native.PTR,  # x
    cpu_native.I64,  # x row stride
    cpu_native.PTR,  # y
    cpu_native.I64,  # y row stride
    cpu_native.PTR,  # a
    cpu_native.I64,  # a slot stride
    cpu_native.I64,  # a rank stride
    cpu_native.PTR,  # b
    cpu_native.I64,  # b slot stride
    cpu_native.I64,  # b output stride
    cpu_native.PTR,  # row_slots (int64)
    cpu_native.PTR,  # scaling (float32)
    cpu_native.I64,  # rows
    cpu_native.I64,  # in
    cpu_native.I64,  # out
    cpu_native.I64,  # rank
    cpu_native.I64,  # slots
    cpu_native.I32,  # dtype code
    cpu_native.I32,  # threads
)
_NATIVE_STATUS = {1: "unsupported dtype", 2: "a slot id >= the number of slots"}


def _native_fn():
    return cpu_native.function("lora", "baton_lora_add", _NATIVE_ARGS)


def native_built() -> bool:
    """Whether the native library loads on this machine (built, or found cached, once per process)."""
    return _native_fn() is not None


def native_available(x: torch.Tensor) -> bool:
    """Whether lora_add_cpu_ handles activations like x (CPU float32/bfloat16, built library)."""
    return (
        isinstance(x, torch.Tensor)
        and x.device.type == "cpu"
        and x.dtype in (torch.float32, torch.bfloat16)
        and _native_fn() is not None
    )


def lora_add_cpu_(
    y: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    row_slots: torch.Tensor,
    scaling: torch.Tensor,
) -> None:
    """The native CPU kernel (kernels/csrc/lora.cpp); same contract as lora_add_."""
    _check(y, x, a, b, row_slots, scaling)
    if not native_available(x):
        raise ValueError(f"no native CPU lora_add_ for {x.dtype} on {x.device}")
    slots = row_slots.to(torch.int64).contiguous()
    scale = scaling.contiguous()
    err = _native_fn()(
        x.data_ptr(),
        x.stride(0),
        y.data_ptr(),
        y.stride(0),
        a.data_ptr(),
        a.stride(0),
        a.stride(1),
        b.data_ptr(),
        b.stride(0),
        b.stride(1),
        slots.data_ptr(),
        scale.data_ptr(),
        x.shape[0],
        x.shape[1],
        y.shape[1],
        a.shape[1],
        a.shape[0],
        cpu_native.DTYPE_CODES[x.dtype],
        torch.get_num_threads(),
    )
    if err != 0:
        raise ValueError(f"native lora_add_ failed: {_NATIVE_STATUS.get(err, f'status {err}')}")


# -- Triton ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LoraPlan:
    """The two launches of one lora_add_ call, and the host-side choices they share."""

    shrink: LaunchPlan
    expand: LaunchPlan
    block_m: int  # rows per tile (both launches)
    gather: bool  # rows sorted by slot first (more than one tile of rows)
    split_k: int  # shrink programs along the input width
    k_per_split: int  # input columns per split: a multiple of the shrink's BLOCK_K


@functools.lru_cache(maxsize=1024)
def lora_plan(
    device: DeviceSpec, *, rows: int, in_features: int, out_features: int, rank: int, dtype: torch.dtype
) -> LoraPlan:
    """Tiles, warps and split-K for `rows` rows of `in_features` -> `out_features` with adapters of
    `rank` (the padded max_rank). float32 dots follow kernels/plan.py's accuracy contract (TF32 on
    CUDA, IEEE on the CPU)."""
    dot_f32, precision = _dot_precision(device, dtype)
    block_r = min(max(16, next_pow2(rank)), 64)  # tl.dot's minimum is 16
    if device.is_cuda:
        block_m = 16 if rows <= 16 else 32 if rows <= 256 else 64
        block_k = 32 if dtype == torch.float32 else 64
        # Decode batches (one row tile) get narrow output tiles: more programs to spread B's read.
        # (16 x 64 tiles with rank tiles of 64 also spill 8 bytes on sm_100.)
        block_n = 32 if block_m == 16 else 128 if block_m == 64 and dtype != torch.float32 else 64
        # The largest tiles on 8 warps: on 4, ptxas needs ~250 registers for the expand's 64 x 128
        # and spills the shrink's 64 x 64 on sm_89 (tests/kernels/test_compile_targets.py).
        shrink_warps = 8 if block_m * block_r >= 64 * 64 else 4
        expand_warps = 8 if block_m * block_n >= 64 * 128 else 4
        stages = 2
        max_split = 16
    else:  # the interpreter: small tiles keep numpy fast, and a split-K on the tests' shapes
        block_m, block_k, block_n, block_r = 16, 32, 32, 16
        shrink_warps, expand_warps, stages = 4, 4, 1
        max_split = 4
    gather = rows > block_m
    tiles = cdiv(rows, block_m) * cdiv(rank, block_r)
    k_blocks = max(1, cdiv(in_features, block_k))
    split = max(1, min(k_blocks, max_split, device.sm_count // max(tiles, 1)))
    k_per_split = cdiv(k_blocks, split) * block_k
    split = max(1, cdiv(in_features, k_per_split))
    common = dict(GATHER=gather, DOT_F32=dot_f32, PRECISION=precision, BLOCK_M=block_m, BLOCK_R=block_r)
    return LoraPlan(
        LaunchPlan("kernels.lora:_lora_shrink_kernel", dict(common, BLOCK_K=block_k), shrink_warps, stages),
        LaunchPlan("kernels.lora:_lora_expand_kernel", dict(common, BLOCK_N=block_n), expand_warps, stages),
        block_m,
        gather,
        split,
        k_per_split,
    )


@lazy_jit
def _lora_shrink_kernel(
    x_ptr,
    a_ptr,
    slots_ptr,
    order_ptr,
    t_ptr,
    rows,
    K,
    R,
    k_per_split,
    stride_x,
    stride_as,
    stride_ar,
    GATHER: tl.constexpr,
    DOT_F32: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # t[split, p, r] = sum over this split's columns k of x[row(p), k] * a[slot(p), r, k], for the
    # BLOCK_M positions p of this tile (row(p) = order[p] when GATHER) and one BLOCK_R slice of r.
    pid_m = tl.program_id(0)
    pid_r = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_p = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pvalid = offs_p < rows
    slots = tl.load(slots_ptr + offs_p, mask=pvalid, other=-1).to(tl.int32)
    if GATHER:
        row_ids = tl.load(order_ptr + offs_p, mask=pvalid, other=0).to(tl.int64)
    else:
        row_ids = offs_p.to(tl.int64)
    offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = offs_r < R
    offs_k = tl.arange(0, BLOCK_K)
    k_start = pid_k * k_per_split
    acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    # The tile's distinct slots in increasing order (none_left: above any slot id, "no further
    # slot"); for each, the rows of other slots (and of -1) load as zeros.
    none_left = 1 << 30
    slot = tl.min(tl.where(slots >= 0, slots, none_left), axis=0)
    while slot < none_left:
        sel = slots == slot
        x_ptrs = x_ptr + row_ids[:, None] * stride_x + offs_k[None, :]
        a_ptrs = a_ptr + slot.to(tl.int64) * stride_as + offs_r[:, None].to(tl.int64) * stride_ar + offs_k[None, :]
        for k0 in range(k_start, k_start + k_per_split, BLOCK_K):
            kmask = (k0 + offs_k) < K
            xt = tl.load(x_ptrs + k0, mask=sel[:, None] & kmask[None, :], other=0.0)
            at = tl.load(a_ptrs + k0, mask=rmask[:, None] & kmask[None, :], other=0.0)
            if DOT_F32:
                xt = xt.to(tl.float32)
                at = at.to(tl.float32)
            acc = tl.dot(xt, tl.trans(at), acc, input_precision=PRECISION)
        slot = tl.min(tl.where(slots > slot, slots, none_left), axis=0)
    t_ptrs = t_ptr + (pid_k * rows + offs_p[:, None]).to(tl.int64) * R + offs_r[None, :]
    tl.store(t_ptrs, acc, mask=pvalid[:, None] & rmask[None, :])


@lazy_jit
def _lora_expand_kernel(
    t_ptr,
    b_ptr,
    slots_ptr,
    order_ptr,
    scaling_ptr,
    y_ptr,
    rows,
    N,
    R,
    split_k,
    stride_bs,
    stride_bn,
    stride_y,
    GATHER: tl.constexpr,
    DOT_F32: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # y[row(p), n] += scaling[slot(p)] * sum_r t[p, r] * b[slot(p), n, r] (t summed over the splits)
    # for the BLOCK_M positions p of this tile and BLOCK_N outputs n; rows of slot -1 untouched.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_p = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pvalid = offs_p < rows
    slots = tl.load(slots_ptr + offs_p, mask=pvalid, other=-1).to(tl.int32)
    active = slots >= 0
    none_left = 1 << 30  # as in the shrink
    first = tl.min(tl.where(active, slots, none_left), axis=0)
    if first >= none_left:  # a tile of base-model rows only
        return
    if GATHER:
        row_ids = tl.load(order_ptr + offs_p, mask=pvalid, other=0).to(tl.int64)
    else:
        row_ids = offs_p.to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for r0 in range(0, R, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        rmask = offs_r < R
        t = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
        for sp in range(0, split_k):
            t_ptrs = t_ptr + (sp * rows + offs_p[:, None]).to(tl.int64) * R + offs_r[None, :]
            t += tl.load(t_ptrs, mask=active[:, None] & rmask[None, :], other=0.0)
        slot = first
        while slot < none_left:
            ts = tl.where((slots == slot)[:, None], t, 0.0)
            b_ptrs = b_ptr + slot.to(tl.int64) * stride_bs + offs_n[:, None].to(tl.int64) * stride_bn + offs_r[None, :]
            bt = tl.load(b_ptrs, mask=nmask[:, None] & rmask[None, :], other=0.0)
            if DOT_F32:
                bt = bt.to(tl.float32)
            else:
                ts = ts.to(bt.dtype)
            acc = tl.dot(ts, tl.trans(bt), acc, input_precision=PRECISION)
            slot = tl.min(tl.where(slots > slot, slots, none_left), axis=0)
    scale = tl.load(scaling_ptr + slots, mask=active, other=0.0)
    y_ptrs = y_ptr + row_ids[:, None] * stride_y + offs_n[None, :]
    ymask = active[:, None] & nmask[None, :]
    yv = tl.load(y_ptrs, mask=ymask, other=0.0).to(tl.float32)
    tl.store(y_ptrs, (yv + acc * scale[:, None]).to(y_ptr.dtype.element_ty), mask=ymask)


def lora_add_triton_(
    y: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    row_slots: torch.Tensor,
    scaling: torch.Tensor,
) -> None:
    """The Triton kernels (CUDA, or CPU tensors under TRITON_INTERPRET=1); same contract as lora_add_,
    except that a slot id >= slots is not checked (that would wait for the device)."""
    _check(y, x, a, b, row_slots, scaling)
    if _nothing_to_add(y, x, a):
        return
    rows, width = x.shape
    rank = a.shape[1]
    out_features = y.shape[1]
    plan = lora_plan(
        DeviceSpec.of(x.device), rows=rows, in_features=width, out_features=out_features, rank=rank, dtype=x.dtype
    )
    scaling = scaling.contiguous()
    slot_ids = row_slots.to(torch.int32)
    if plan.gather:
        slot_ids, order = torch.sort(slot_ids, stable=True)
    else:
        slot_ids, order = slot_ids.contiguous(), slot_ids  # order is unused without GATHER
    t = torch.empty((plan.split_k, rows, rank), dtype=torch.float32, device=x.device)
    sk = plan.shrink.launch_kwargs()
    _lora_shrink_kernel[(cdiv(rows, plan.block_m), cdiv(rank, sk["BLOCK_R"]), plan.split_k)](
        x,
        a,
        slot_ids,
        order,
        t,
        rows,
        width,
        rank,
        plan.k_per_split,
        x.stride(0),
        a.stride(0),
        a.stride(1),
        **sk,
    )
    ek = plan.expand.launch_kwargs()
    _lora_expand_kernel[(cdiv(rows, plan.block_m), cdiv(out_features, ek["BLOCK_N"]))](
        t,
        b,
        slot_ids,
        order,
        scaling,
        y,
        rows,
        out_features,
        rank,
        plan.split_k,
        b.stride(0),
        b.stride(1),
        y.stride(0),
        **ek,
    )
