"""A grammar's token bitmask applied to logits in place (structured output, workers/engine/sampler.py).

The bitmask is xgrammar's layout: int32 [rows, ceil(vocab / 32)], bit j of word w set when token
32 * w + j is allowed. Only the listed rows are touched; their disallowed tokens become -inf.
The native CPU kernel (csrc/token_bitmask.cpp) skips all-allowed words and fills all-disallowed
ones whole, which is what a grammar's masks mostly are; on a GPU, xgrammar's own kernel runs.
"""

from __future__ import annotations

import torch

from kernels import cpu_native
from kernels._checks import check_last_dim_contiguous, check_tensor, require


def _check(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    check_tensor(logits, "logits", 2, (torch.float32,))
    check_tensor(bitmask, "bitmask", 2, (torch.int32,))
    check_last_dim_contiguous(logits, "logits")
    check_last_dim_contiguous(bitmask, "bitmask")
    vocab = logits.shape[1]
    require(
        bitmask.shape == (logits.shape[0], (vocab + 31) // 32),
        f"bitmask must be [{logits.shape[0]}, {(vocab + 31) // 32}] for logits {tuple(logits.shape)}, "
        f"got {tuple(bitmask.shape)}",
    )
    require(bitmask.device == logits.device, f"bitmask on {bitmask.device}, logits on {logits.device}")
    require(
        all(0 <= r < logits.shape[0] for r in rows), f"rows must index the logits' {logits.shape[0]} rows, got {rows}"
    )


_BITS = torch.arange(32, dtype=torch.int32)


def allocate_token_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """A bitmask of `rows` rows on the CPU with every token allowed (xgrammar's layout and initial value)."""
    return torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)


def apply_token_bitmask_reference(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    _check(logits, bitmask, rows)
    if not rows:
        return
    index = torch.tensor(rows, dtype=torch.long, device=logits.device)
    vocab = logits.shape[1]
    allowed = ((bitmask[index, :, None] >> _BITS.to(bitmask.device)) & 1).bool().flatten(1)[:, :vocab]
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))


_NATIVE_ARGS = (
    cpu_native.PTR,
    cpu_native.I64,
    cpu_native.PTR,
    cpu_native.I64,
    cpu_native.PTR,
    cpu_native.I64,
    cpu_native.I64,
    cpu_native.I32,
)


def _native_fn():
    return cpu_native.function("token_bitmask", "baton_apply_token_bitmask", _NATIVE_ARGS)


def native_built() -> bool:
    """Whether the native library loads on this machine (built, or found cached, once per process)."""
    return _native_fn() is not None


def native_available(logits, *rest, **kwargs) -> bool:
    """Whether apply_token_bitmask_cpu handles these logits (CPU float32, built library)."""
    return (
        isinstance(logits, torch.Tensor)
        and logits.device.type == "cpu"
        and logits.dtype == torch.float32
        and _native_fn() is not None
    )


def apply_token_bitmask_cpu(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    _check(logits, bitmask, rows)
    require(native_available(logits), f"no native CPU token bitmask for {logits.dtype} on {logits.device}")
    if not rows:
        return
    index = torch.tensor(rows, dtype=torch.int64)
    # A single row's stride is arbitrary (a view of one row): the kernel only multiplies row indices by it.
    logits_stride = logits.stride(0) if logits.shape[0] > 1 else logits.shape[1]
    bitmask_stride = bitmask.stride(0) if bitmask.shape[0] > 1 else bitmask.shape[1]
    err = _native_fn()(
        logits.data_ptr(),
        logits_stride,
        bitmask.data_ptr(),
        bitmask_stride,
        index.data_ptr(),
        len(rows),
        logits.shape[1],
        torch.get_num_threads(),
    )
    require(err == 0, f"native token bitmask failed with status {err}")


def apply_token_bitmask_gpu(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """xgrammar's CUDA kernel (its Triton one where that is what it picks)."""
    _check(logits, bitmask, rows)
    if rows:
        from xgrammar import apply_token_bitmask_inplace

        apply_token_bitmask_inplace(logits, bitmask, indices=rows)
