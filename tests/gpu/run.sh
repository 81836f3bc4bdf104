#!/usr/bin/env bash
# One prepared GPU check for a lent H200 (or any CUDA machine), run from the repository root copy:
#   1. the kernel tests compiled on CUDA (their kernel_ops("triton", "cuda"), no interpreter),
#   2. a kernel benchmark (decode bandwidth, prefill TFLOP/s, FP8 GEMM vs torch._scaled_mm and bf16),
#   3. an NCCL send/recv of a packed KV buffer between two processes,
#   4. tests/gpu/test_*.py: GPU tests, and the hook where the end-to-end model check goes; among
#      them test_cuda_graph_decode.py, a CUDA-graph-replayed decode step against the eager one.
# Results go to $OUT when it is set (the device machine), else bench/results/. Budget: the step
# timeouts add up to under 9 minutes (200 + 120 + 75 + 120 s); a normal run takes far less.
# Exit status: 0 when every step passed, else 1 (every step still runs).
set -uo pipefail
cd "$(dirname "$0")/../.."

RESULTS="${OUT:-bench/results}"
mkdir -p "$RESULTS"
# The device image's python3 holds CUDA torch and triton; the repo's .venv is a CPU build.
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# Compile the kernels (tests/conftest.py defaults to the interpreter for CPU runs).
export TRITON_INTERPRET=0
status=0
step() { echo; echo "=== $* ($(date -u +%H:%M:%S))"; }

if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "no CUDA device: nothing to check here (the kernel tests run in the interpreter on CPU)"
    exit 0
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
"$PY" -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'

step "1. kernel tests on CUDA"
# BATON_COMPILE_ALL=1: the AOT compile check takes every specialisation here (16 cores), not the subset.
BATON_KERNEL_TEST_DEVICE=cuda BATON_COMPILE_ALL=1 timeout 200 \
    "$PY" -m pytest -q -p no:cacheprovider tests/kernels 2>&1 | tee "$RESULTS/gpu_kernel_tests.log" || status=1

step "2. kernel benchmark"
timeout 120 "$PY" tests/gpu/bench_kernels.py --out "$RESULTS/gpu_kernel_bench.json" || status=1

step "3. NCCL KV transfer between two processes"
timeout 75 "$PY" tests/gpu/bench_nccl.py --out "$RESULTS/gpu_nccl.json" || status=1

step "4. GPU tests: tests/gpu/test_*.py (add the end-to-end model check as tests/gpu/test_e2e_*.py)"
# Every tests/gpu/test_*.py runs here; each must skip cleanly without CUDA and fit the remaining budget.
timeout 120 "$PY" -m pytest -q -p no:cacheprovider tests/gpu 2>&1 | tee "$RESULTS/gpu_tests.log" || status=1

step "done: status $status, results in $RESULTS"
ls -l "$RESULTS"
exit $status
