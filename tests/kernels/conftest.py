"""Kernel tests run every Triton kernel in the interpreter on CPU tensors, unless the GPU script
sets BATON_KERNEL_TEST_DEVICE=cuda, in which case the same tests run compiled on the GPU."""

import os

COMPILE_CHECK = "tests/kernels/test_compile_targets.py::test_kernels_compile_for_targets"

if os.environ.get("BATON_KERNEL_TEST_DEVICE", "cpu") != "cuda":
    # Read by kernels._triton_compat at each first launch, so setting it here is early enough.
    os.environ["TRITON_INTERPRET"] = "1"


def pytest_collection_finish(session):
    # The AOT compile check is about a minute of CPU whose jobs are known before any test runs:
    # started now at the lowest priority (tests/idle_priority.py), it fills the time the earlier
    # tests leave a core idle, and the test collects its results (tests/kernels/test_compile_targets.py).
    if session.config.option.collectonly or not any(item.nodeid == COMPILE_CHECK for item in session.items):
        return
    from tests.kernels import background
    from tests.kernels import test_compile_targets as check

    session.config.stash[background.COMPILES] = background.start_in_background(
        check.jobs_to_compile(), check.run_compiles
    )


def pytest_sessionfinish(session):
    from tests.kernels.background import COMPILES

    background = session.config.stash.get(COMPILES, None)
    if background is not None:
        background.stop()  # the run ended first (or the results are in: nothing is left to kill)
