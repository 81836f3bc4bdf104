"""Kernel tests run every Triton kernel in the interpreter on CPU tensors, unless the GPU script
sets BATON_KERNEL_TEST_DEVICE=cuda, in which case the same tests run compiled on the GPU."""

import os

if os.environ.get("BATON_KERNEL_TEST_DEVICE", "cpu") != "cuda":
    # Read by kernels._triton_compat at each first launch, so setting it here is early enough.
    os.environ["TRITON_INTERPRET"] = "1"
