#!/usr/bin/env bash
# Before/after check of a change, back to back on this machine: workload 1 of bench/compare_vllm.py
# (Baton float32, `vllm bench serve` with its defaults) and bench/engine_throughput.py (Baton at
# concurrency 32), each run ROUNDS times for the checkout at REV and for the working tree,
# alternating (A B A B ...), so both meet the same load from other processes.
#   bash bench/ab_compare.sh REV [OUT_DIR]     (needs .venv-vllm: bash bench/setup_vllm_peer.sh)
# REV is checked out in a temporary git worktree and run with this checkout's .venv (PYTHONPATH
# first). JSON: OUT_DIR/{before,after}_{N}_{compare,engine}.json and OUT_DIR/summary.json.
# WORKLOAD=mixed runs workload 2 instead (streams beside long prompts: ITL and TTFT percentiles)
# and no engine benchmark; BUSY=1 runs every round beside bench/cpu_hog.py (one core 50% busy);
# ENGINE=0 leaves the engine benchmark out (a change of the router or the pools only).
set -euo pipefail
cd "$(dirname "$0")/.."
REV=${1:?usage: bench/ab_compare.sh REV [OUT_DIR]}
OUT=${2:-bench/results/ab_compare}
case $OUT in /*) ;; *) OUT="$(pwd)/$OUT" ;; esac  # the engine benchmark runs from the other tree
ROUNDS=${ROUNDS:-2}
WORKLOAD=${WORKLOAD:-throughput}
case $WORKLOAD in throughput|mixed) ;; *) echo "WORKLOAD must be throughput or mixed, got $WORKLOAD" >&2; exit 2 ;; esac
PORT=${PORT:-18440}
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 HF_HUB_OFFLINE=1 RAY_memory_monitor_refresh_ms=0
HERE=$(pwd)
BEFORE=$(mktemp -d /tmp/baton_ab.XXXXXX)
git worktree add -f -q "$BEFORE" "$REV"
SERVER=
HOG=
cleanup() {
  [ -n "$SERVER" ] && kill -INT -- "-$SERVER" 2>/dev/null && sleep 5 && kill -KILL -- "-$SERVER" 2>/dev/null
  [ -n "$HOG" ] && kill -TERM "$HOG" 2>/dev/null
  git worktree remove --force "$BEFORE" || true
}
trap cleanup EXIT
mkdir -p "$OUT"
rm -f "$OUT"/before_* "$OUT"/after_*

run_side() {  # label, tree, round
  local label=$1 tree=$2 round=$3
  # the engine alone (no Ray, no HTTP): that tree's own benchmark script and code
  [ "$WORKLOAD" = throughput ] && [ "${ENGINE:-1}" = 1 ] && (cd "$tree" && PYTHONPATH="$tree" "$HERE/.venv/bin/python" bench/engine_throughput.py \
      --num-requests 32 --concurrency 32 --sequential-requests 2 --skip-hf-batched \
      --out "$OUT/${label}_${round}_engine.json") > "/tmp/baton_ab_${label}_engine.log" 2>&1
  # the server, measured by vLLM's client
  # exec: the background job is the server itself, leader of its own process group (setsid), so
  # the kills below reach it and its Ray.
  (cd "$tree" && exec env PYTHONPATH="$tree" setsid "$HERE/.venv/bin/python" \
      -c 'import sys; from cluster.cli import main; sys.exit(main())' \
      serve --port "$PORT" --dtype float32 --kv-cache-memory 512MiB > "/tmp/baton_ab_${label}_server.log" 2>&1) &
  SERVER=$!
  curl -sf "http://127.0.0.1:$PORT/health" >/dev/null 2>&1 && { echo "port $PORT is taken" >&2; exit 1; }
  for _ in $(seq 1 300); do
    curl -sf "http://127.0.0.1:$PORT/health" >/dev/null 2>&1 && break
    kill -0 "$SERVER" 2>/dev/null || { echo "the $label server exited: /tmp/baton_ab_${label}_server.log" >&2; exit 1; }
    sleep 1
  done
  "$HERE/.venv/bin/python" -m bench.compare_vllm --base-url "http://127.0.0.1:$PORT" --label "${label}_${round}" \
      --workload "$WORKLOAD" --modes default --condition "$CONDITION" --out-dir "$OUT" \
      >> "/tmp/baton_ab_${label}_client.log" 2>&1
  mv "$OUT/compare_${label}_${round}.json" "$OUT/${label}_${round}_compare.json"
  kill -INT -- "-$SERVER" 2>/dev/null || true
  for _ in $(seq 1 30); do kill -0 -- "-$SERVER" 2>/dev/null || break; sleep 1; done
  kill -KILL -- "-$SERVER" 2>/dev/null || true
  while curl -sf "http://127.0.0.1:$PORT/health" >/dev/null 2>&1; do sleep 1; done
  SERVER=
}

CONDITION=quiet
if [ "${BUSY:-0}" = 1 ]; then
  CONDITION=busy
  setsid "$HERE/.venv/bin/python" -m bench.cpu_hog --duty 0.5 --period-ms 20 --seconds 7200 > /tmp/baton_ab_hog.log &
  HOG=$!
fi
for round in $(seq 1 "$ROUNDS"); do
  run_side before "$BEFORE" "$round"
  run_side after "$HERE" "$round"
done
"$HERE/.venv/bin/python" - "$OUT" "$REV" "$(git rev-parse HEAD)" "$WORKLOAD" "$CONDITION" <<'EOF'
import json, sys, pathlib
out, rev, head, workload, condition = pathlib.Path(sys.argv[1]), *sys.argv[2:]
key = "default" if condition == "quiet" else f"{condition}: default"
rows = {}
for side in ("before", "after"):
    runs = [json.loads(p.read_text())["runs"][key] for p in sorted(out.glob(f"{side}_*_compare.json"))]
    if workload == "throughput":
        engine = []
        for p in sorted(out.glob(f"{side}_*_engine.json")):
            results = json.loads(p.read_text())["results"].values()
            engine += [r["tok_s"] for r in results if r.get("system") == "baton" and r.get("concurrency") == 32]
        rows[side] = {"workload1_output_tok_s": [r["throughput"]["throughput"]["output_throughput"] for r in runs],
                      "engine_c32_output_tok_s": engine}
    else:
        rows[side] = {"streams_output_tok_s": [r["mixed"]["streams"]["output_throughput"] for r in runs],
                      "streams_itl_p50_ms": [r["mixed"]["streams"]["itl_ms"]["p50"] for r in runs],
                      "streams_itl_p99_ms": [r["mixed"]["streams"]["itl_ms"]["p99"] for r in runs],
                      "long_prompts_ttft_p50_ms": [r["mixed"]["long prompts"]["ttft_ms"]["p50"] for r in runs],
                      "cpu_steal": [r["mixed"]["cpu_steal"] for r in runs],
                      "loadavg_after": [r["mixed"]["loadavg_after"][0] for r in runs]}
mean = lambda xs: sum(xs) / len(xs)
summary = {"benchmark": "ab_compare", "workload": workload, "condition": condition, "before_rev": rev,
           "after_rev": f"{head} + working tree", **rows,
           "ratio_after_over_before": {k: mean(rows["after"][k]) / mean(rows["before"][k]) for k in rows["after"]
                                       if rows["after"][k] and rows["before"][k] and None not in rows["after"][k] + rows["before"][k]}}
(out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
print(json.dumps(summary, indent=2))
EOF
