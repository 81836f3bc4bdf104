"""Shared helpers for the kernel tests: device choice, tolerances per dtype, paged-cache builders."""

import os

import pytest
import torch

pytest.importorskip("triton")

from kernels.ops import kernel_ops

DEVICE = torch.device("cuda" if os.environ.get("BATON_KERNEL_TEST_DEVICE") == "cuda" else "cpu")
if DEVICE.type == "cuda" and not torch.cuda.is_available():
    pytest.skip("BATON_KERNEL_TEST_DEVICE=cuda but no CUDA device", allow_module_level=True)

FP8 = torch.float8_e4m3fn
# The kernel tests' `ops.*` calls run the Triton kernels (interpreted on CPU tensors, see conftest.py).
ops = kernel_ops("triton", DEVICE)

# (atol, rtol) for a Triton kernel against its reference, by the dtype of the output.
TOL = {
    torch.float32: (2e-5, 2e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (2e-2, 2e-2),
}
# Attention accumulates in a different order than the reference; a few more ulps.
ATTN_TOL = {
    torch.float32: (1e-4, 1e-4),
    torch.float16: (4e-3, 4e-3),
    torch.bfloat16: (3e-2, 3e-2),
}
# Compiled on CUDA, float32 matrix products run on the tensor cores: attention and MoE dots in TF32
# (10-bit mantissa operands: kernels/plan.py's accuracy contract) and FP8 GEMMs in the tensor cores'
# accumulator. Their float32 results are held to that precision there; the interpreter keeps IEEE.
# Measured on an H200 before these tolerances: at most 9.6e-3 absolute on MoE outputs
# of magnitude up to ~10, 2.1e-3 on attention outputs of magnitude ~1, 7.4e-4 on FP8 GEMMs.
ON_TENSOR_CORES = DEVICE.type == "cuda"
TENSOR_CORE_F32_TOL = (1e-2, 1e-2)


def dot_tol(tol: dict) -> dict:
    """`tol` for a kernel whose float32 results come from matrix products: TF32's on CUDA."""
    return {**tol, torch.float32: TENSOR_CORE_F32_TOL} if ON_TENSOR_CORES else tol


ATTN_TOL = dot_tol(ATTN_TOL)


def assert_close(actual, expected, dtype=None, tol=TOL):
    atol, rtol = tol[dtype or expected.dtype]
    torch.testing.assert_close(actual.float().cpu(), expected.float().cpu(), atol=atol, rtol=rtol)


def gen(seed=0):
    return torch.Generator(device="cpu").manual_seed(seed)


def randn(*shape, dtype=torch.float32, seed=0, scale=1.0):
    return (torch.randn(*shape, generator=gen(seed)) * scale).to(dtype).to(DEVICE)


def make_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype, seed=1, scale=1.0):
    """Random K and V caches; FP8 caches hold values quantized with the given scale."""
    k = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen(seed))
    v = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen(seed + 1))
    if dtype == FP8:
        k, v = (k / scale).clamp(-448, 448).to(FP8), (v / scale).clamp(-448, 448).to(FP8)
    else:
        k, v = k.to(dtype), v.to(dtype)
    return k.to(DEVICE), v.to(DEVICE)


def make_block_tables(context_lens, block_size, num_blocks, max_blocks, seed=2, pad_value=None):
    """Distinct random blocks per sequence; padding entries are out-of-range garbage on purpose."""
    g = gen(seed)
    perm = torch.randperm(num_blocks, generator=g)
    rows, used = [], 0
    for n in context_lens:
        need = -(-n // block_size)
        ids = perm[used : used + need].tolist()
        used += need
        pad = pad_value if pad_value is not None else 10**6
        rows.append(ids + [pad] * (max_blocks - need))
    assert used <= num_blocks, "test asks for more blocks than the cache has"
    return torch.tensor(rows, dtype=torch.int32).reshape(len(context_lens), max_blocks).to(DEVICE)
