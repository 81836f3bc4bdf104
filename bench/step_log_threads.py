"""How many threads the decode worker's steps ran on, and whether a prefill ran beside them.

Reads the step logs a served deployment writes (`BATON_STEP_LOG_DIR=DIR baton serve ...`, one
`<worker id>.jsonl` per worker, see workers/shell/worker.py) after a load such as workload 1:

    BATON_STEP_LOG_DIR=/tmp/steps baton serve --port 8000 --kv-cache-memory 512MiB &
    vllm bench serve --backend openai-chat --endpoint /v1/chat/completions --base-url http://127.0.0.1:8000 \\
        --model SmolLM2-135M-Instruct --tokenizer <model folder> --dataset-name random --random-input-len 256 \\
        --random-output-len 128 --num-prompts 64 --max-concurrency 16 --ignore-eos --seed 0
    python -m bench.step_log_threads /tmp/steps [--label NAME] [--out FILE.json]

Groups decode-0's steps by (threads, whether any step of prefill-0 overlapped it) and reports each
group's count and median step time: a step on a borrowed core beside a running prefill is what
workers/shell/elastic_threads.py must never let happen.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from common.stats import percentile


def read_steps(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def summarize(folder: Path) -> dict:
    decode = read_steps(folder / "decode-0.jsonl")
    prefill = [(s["end"] - s["seconds"], s["end"]) for s in read_steps(folder / "prefill-0.jsonl")]
    groups: dict[tuple[int, bool], list[float]] = {}
    for step in decode:
        start, end = step["end"] - step["seconds"], step["end"]
        beside_prefill = any(a < end and b > start for a, b in prefill)
        groups.setdefault((step.get("threads", 1), beside_prefill), []).append(step["seconds"])
    return {
        "decode_steps": len(decode),
        "prefill_busy_s": round(sum(b - a for a, b in prefill), 2),
        "groups": [
            {
                "threads": threads,
                "beside_prefill": beside,
                "steps": len(seconds),
                "step_p50_ms": round(1000 * percentile(seconds, 50), 1),
            }
            for (threads, beside), seconds in sorted(groups.items())
        ],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", type=Path)
    ap.add_argument("--label", default=None)
    ap.add_argument("--out", type=Path, default=None, help="append the summary to this JSON list")
    args = ap.parse_args()
    summary = {"label": args.label or str(args.folder), **summarize(args.folder)}
    print(json.dumps(summary, indent=1))
    if args.out:
        runs = json.loads(args.out.read_text()) if args.out.exists() else []
        args.out.write_text(json.dumps([*runs, summary], indent=2) + "\n")


if __name__ == "__main__":
    main()
