#!/usr/bin/env bash
# Baton vs vLLM-CPU, both workloads of bench/compare_vllm.py (measured by `vllm bench serve`, with
# its defaults and with --temperature 0), every server one after the other in one session on
# 127.0.0.1 (the README's comparison table comes from one run of this script):
#   bash bench/run_comparison.sh [VLLM_VENV]          (default .venv-vllm; made by setup_vllm_peer.sh)
# Servers: vLLM-CPU float32 (its bfloat16 gives wrong answers on this model); Baton float32;
# Baton bfloat16; with ALL=1 also Baton bfloat16 with disaggregation off (every prompt prefilled on
# the decode worker). Set ONLY="baton-bf16 vllm-cpu" to run a subset, OWN_CLIENT=1 to add
# bench/serve.py's column. JSON: bench/results/compare_<label>.json.
set -euo pipefail
cd "$(dirname "$0")/.."
VLLM_VENV=${1:-.venv-vllm}
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 HF_HUB_OFFLINE=1
MODEL_DIR=$(.venv/bin/python -c 'from workers.model_files import resolve_model_dir; print(resolve_model_dir(None))')
PORT=8123
EXTRA=()
[ "${OWN_CLIENT:-0}" = 1 ] && EXTRA+=(--own-client)

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
  # Its own process group, so stopping it stops its workers too (and nothing else).
  setsid "$@" > "/tmp/baton_compare_$label.log" 2>&1 &
  local pid=$!
  if wait_healthy "$pid" "http://127.0.0.1:$PORT$health" 600; then
    .venv/bin/python bench/compare_vllm.py --base-url "http://127.0.0.1:$PORT" --label "$label" \
      --vllm "$VLLM_VENV/bin/vllm" --tokenizer "$MODEL_DIR" "${EXTRA[@]}" || echo "   $label: the benchmark failed" >&2
  fi
  kill -INT -- "-$pid" 2>/dev/null || true
  for _ in $(seq 1 30); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
  kill -KILL -- "-$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
  sleep 3
}

# vLLM reserves --gpu-memory-utilization of the machine's memory (0.92 by default) and refuses to
# start when other processes hold more than the rest: a fixed 2 GiB KV cache (Baton: 1 GiB per worker).
run_one vllm-cpu /health "$VLLM_VENV/bin/vllm" serve "$MODEL_DIR" --dtype float32 --max-model-len 4096 \
  --gpu-memory-utilization 0.15 --kv-cache-memory-bytes 2147483648 \
  --served-model-name SmolLM2-135M-Instruct --host 127.0.0.1 --port $PORT
run_one baton-fp32 /health .venv/bin/baton serve --port $PORT --dtype float32
run_one baton-bf16 /health .venv/bin/baton serve --port $PORT --dtype bfloat16
if [ "${ALL:-0}" = 1 ]; then
  run_one baton-bf16-local-prefill /health .venv/bin/baton serve --port $PORT --dtype bfloat16 \
    --local-prefill-threshold 1000000
fi
