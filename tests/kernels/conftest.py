"""Kernel tests run every Triton kernel in the interpreter on CPU tensors, unless the GPU script
sets BATON_KERNEL_TEST_DEVICE=cuda, in which case the same tests run compiled on the GPU."""

import os

import pytest

if os.environ.get("BATON_KERNEL_TEST_DEVICE", "cpu") != "cuda":
    # Read by kernels._triton_compat at each first launch, so setting it here is early enough.
    os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture(autouse=True)
def _force_triton(monkeypatch):
    """ops.* calls go to the Triton kernels unless a test sets BATON_KERNELS itself."""
    monkeypatch.setenv("BATON_KERNELS", "triton")
