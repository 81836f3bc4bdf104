#!/usr/bin/env bash
# One prepared GPU check for a lent H200 (or any CUDA machine), run from the repository root copy:
#   1. the kernel tests compiled on CUDA (their kernel_ops("triton", "cuda"), no interpreter), spread
#      over pytest-xdist's workers where the image has it,
#   2. a kernel benchmark (decode bandwidth, prefill TFLOP/s, FP8 GEMM vs torch._scaled_mm and bf16),
#   3. an NCCL send/recv of a packed KV buffer between two processes,
#   4. tests/gpu/test_*.py: GPU tests, among them the engine on the Triton kernels against the CPU
#      reference and a CUDA-graph-replayed decode step against the eager one,
#   5. the engine's throughput against transformers `generate` on a 1B-shaped random Llama.
# The AOT compile check (tests/kernels/test_compile_targets.py) needs no GPU: `make test` runs it.
# Results go to $OUT when it is set (the device machine), else bench/results/. Budget: the step
# timeouts add up to 8 minutes (120 + 90 + 60 + 120 + 90 s); a normal run takes far less.
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
export BATON_TESTS_BESIDE=0
status=0
step() { echo; echo "=== $* ($(date -u +%H:%M:%S))"; }

if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "no CUDA device: nothing to check here (the kernel tests run in the interpreter on CPU)"
    exit 0
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
"$PY" -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
# The native CPU kernels' tests also run here, built with -march=native by this compiler for this CPU.
lscpu | grep -E "^(Model name|Flags)" | cut -c1-600
"$PY" -c 'from kernels import cpu_native; print("C++ compiler:", cpu_native.compiler())'
c++ --version 2>/dev/null | head -1

step "1. kernel tests on CUDA"
PARALLEL=()
if "$PY" -c 'import xdist' 2>/dev/null; then PARALLEL=(-n 8); fi
BATON_KERNEL_TEST_DEVICE=cuda timeout 120 \
    "$PY" -m pytest -q -p no:cacheprovider "${PARALLEL[@]}" tests/kernels \
    --deselect tests/kernels/test_compile_targets.py::test_kernels_compile_for_targets \
    2>&1 | tee "$RESULTS/gpu_kernel_tests.log" || status=1

step "2. kernel benchmark"
timeout 90 "$PY" tests/gpu/bench_kernels.py --out "$RESULTS/gpu_kernel_bench.json" || status=1

step "3. NCCL KV transfer between two processes"
timeout 60 "$PY" tests/gpu/bench_nccl.py --out "$RESULTS/gpu_nccl.json" || status=1

step "4. GPU tests: tests/gpu/test_*.py"
# Every tests/gpu/test_*.py runs here; each must skip cleanly without CUDA and fit the remaining budget.
timeout 120 "$PY" -m pytest -q -p no:cacheprovider tests/gpu 2>&1 | tee "$RESULTS/gpu_tests.log" || status=1

step "5. engine throughput against transformers"
timeout 90 "$PY" tests/gpu/bench_engine.py --out "$RESULTS/gpu_engine_bench.json" || status=1

step "done: status $status, results in $RESULTS"
ls -l "$RESULTS"
exit $status
