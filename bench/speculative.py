"""Speculative decoding over HTTP, measured by `vllm bench serve` with its defaults (it samples at the
server's default temperature of 1), on a workload where speculation is real: requests that ask the
model to repeat or lightly edit a passage of the CPython documentation (`pydoc_data.topics`), and
conversations that quote an earlier turn, sent as a custom dataset.

    .venv/bin/python -m bench.speculative [--vllm .venv-vllm/bin/vllm] [--num-prompts 16] \
        [--concurrency 1 4 16] [--rounds 2] [--servers LABEL ...] [--temperature T] \
        [--out bench/results/speculative_serve.json]

Servers, all started first and left up, each on its own port: Baton without speculation, with
`ngram`, with `suffix` and with `draft_model` (the served model itself in bfloat16 as its own draft:
the cheapest draft this machine has, see docs/speculative-decoding.md); and, when `--vllm` names a
vLLM CLI, vLLM-CPU without speculation and with the same ngram configuration. All of them at once
need more than 24 GiB: `--servers` runs a subset (each ratio needs its baseline in the same run).
Every (concurrency, server) pair runs in turn, the server order reversed every round (--rounds, 2
by default; each server's tokens/s is the mean of its rounds), so the
machine's other load and any aftermath of the previous run fall on all alike. Reported per run:
output tokens/s, TPOT and TTFT percentiles; per Baton server, its decode worker's drafts and
accepted drafts over the runs (acceptance rate); the ratio of each speculative server's tokens/s
to its own engine's without speculation, side by side; and how much of the replies a prompt lookup
could have drafted (`copied_share`: the share of their token 4-grams found in the prompts).
`--temperature` sends one temperature with every request (0: greedy), to separate what the servers
do from what the model writes; a run where any request fails stops with the error.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common.envs import ensure_private_ray_env

ensure_private_ray_env()  # the Baton servers it starts keep Ray on loopback

import httpx
from transformers import AutoTokenizer

from bench.compare_vllm import summary
from workers.models.files import resolve_model_dir

NGRAM = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}'
SUFFIX = '{"method": "suffix", "num_speculative_tokens": 4}'
MODEL = "SmolLM2-135M-Instruct"
TOPICS = ("assert", "pass", "del", "return", "break", "continue", "global", "import")


def draft_config(model_dir: str) -> str:
    """The served model in bfloat16 drafting for itself (no smaller model shares its tokenizer here)."""
    return json.dumps({"method": "draft_model", "model": model_dir, "dtype": "bfloat16", "num_speculative_tokens": 4})


def dataset(path: Path) -> int:
    """The custom dataset (JSON lines of {"prompt": ...}): per topic a repeat, an edit and a quoting
    turn of a conversation. Returns the number of prompts."""
    from pydoc_data.topics import topics

    rows = []
    for key in TOPICS:
        passage = topics[key].strip()[:600]
        rows.append(f"Repeat this passage exactly, word for word:\n\n{passage}")
        rows.append(
            f"Rewrite this passage with every occurrence of 'statement' replaced by 'instruction', "
            f"changing nothing else:\n\n{passage}"
        )
        rows.append(
            f"Earlier you wrote:\n\n{passage}\n\nQuote your previous answer back to me, then add one "
            f"sentence saying what it is about."
        )
    path.write_text("".join(json.dumps({"prompt": row}) + "\n" for row in rows))
    return len(rows)


def start(label: str, port: int, command: list[str], logs: Path) -> subprocess.Popen:
    proc = subprocess.Popen(
        command,
        stdout=open(logs / f"{label}.log", "w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    deadline = time.monotonic() + 600
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{label} did not become healthy; see {logs / (label + '.log')}")
        time.sleep(1)


def stop(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=30)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def spec_counters(port: int) -> dict | None:
    """A Baton server's decode pool's draft totals (None for a server without /v1/status)."""
    try:
        status = httpx.get(f"http://127.0.0.1:{port}/v1/status", timeout=10).json()
    except (httpx.HTTPError, json.JSONDecodeError):
        return None
    decode = status.get("pools", {}).get("decode", [])
    return {
        "draft_tokens": sum(w.get("spec_draft_tokens", 0) for w in decode),
        "accepted_tokens": sum(w.get("spec_accepted_tokens", 0) for w in decode),
    }


def token_grams(text: str, tokenizer) -> list[tuple[int, ...]]:
    """The text's token 4-grams, in order."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    return [tuple(ids[i : i + 4]) for i in range(len(ids) - 3)]


def prompt_grams(prompts: list[str], tokenizer) -> set[tuple[int, ...]]:
    """Every token 4-gram of the prompts."""
    return {gram for prompt in prompts for gram in token_grams(prompt, tokenizer)}


def copied_share(replies: list[str], grams: set[tuple[int, ...]], tokenizer) -> float:
    """Mean over the replies of the share of each reply's token 4-grams found in the prompts (`grams`):
    how much of what the model wrote a prompt lookup could have proposed (a reply that wanders off the
    passage it was asked to repeat scores low, whatever the speculation)."""
    shares = []
    for reply in replies:
        if reply_grams := token_grams(reply, tokenizer):
            shares.append(sum(gram in grams for gram in reply_grams) / len(reply_grams))
    return statistics.mean(shares) if shares else 0.0


def bench_serve(
    vllm: str,
    port: int,
    data: Path,
    num_prompts: int,
    concurrency: int,
    tokenizer: str,
    out: Path,
    temperature: float | None = None,
) -> dict:
    command = [
        vllm,
        "bench",
        "serve",
        "--backend",
        "openai-chat",
        "--endpoint",
        "/v1/chat/completions",
        "--base-url",
        f"http://127.0.0.1:{port}",
        "--model",
        MODEL,
        "--tokenizer",
        tokenizer,
        "--dataset-name",
        "custom",
        "--dataset-path",
        str(data),
        "--custom-output-len",
        "128",
        "--num-prompts",
        str(num_prompts),
        "--max-concurrency",
        str(concurrency),
        "--seed",
        "0",
        "--percentile-metrics",
        "ttft,tpot,itl,e2el",
        "--metric-percentiles",
        "50,90,99",
        "--disable-tqdm",
        "--save-result",
        "--save-detailed",
        "--result-dir",
        str(out.parent),
        "--result-filename",
        out.name,
    ]
    if temperature is not None:
        command += ["--temperature", str(temperature)]
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if done.returncode != 0:
        raise RuntimeError(f"vllm bench serve failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    saved = json.loads(out.read_text())
    if saved.get("failed"):  # e.g. a worker killed for memory: a figure over failed requests means nothing
        raise RuntimeError(
            f"{saved['failed']} of {num_prompts} requests failed on port {port} "
            f"(its server's log says why): {' '.join(command)}"
        )
    return {"command": " ".join(command), **summary(saved), "replies": saved.get("generated_texts", [])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm", default=".venv-vllm/bin/vllm", help="vLLM's CLI: the client, and the vLLM servers")
    parser.add_argument("--no-vllm-servers", action="store_true", help="Baton's servers only")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument(
        "--rounds", type=int, default=2, help="runs per server and concurrency, the server order reversed every round"
    )
    parser.add_argument(
        "--servers",
        nargs="+",
        help="only these servers (labels; a ratio needs its baseline too), "
        "for a machine without memory for all at once",
    )
    parser.add_argument(
        "--temperature",
        type=float,
        default=None,
        help="sent with every request (default: none, so the servers' default of 1 applies, as "
        "with vllm bench serve's defaults)",
    )
    parser.add_argument("--out", type=Path, default=Path("bench/results/speculative_serve.json"))
    args = parser.parse_args()
    model_dir = str(resolve_model_dir(quiet=True))
    servers = {
        "baton": [".venv/bin/baton", "serve", "--kv-cache-memory", "512MiB"],
        "baton-ngram": [".venv/bin/baton", "serve", "--kv-cache-memory", "512MiB", "--speculative-config", NGRAM],
        "baton-suffix": [".venv/bin/baton", "serve", "--kv-cache-memory", "512MiB", "--speculative-config", SUFFIX],
        "baton-draft": [
            ".venv/bin/baton",
            "serve",
            "--kv-cache-memory",
            "512MiB",
            "--speculative-config",
            draft_config(model_dir),
        ],
    }
    if not args.no_vllm_servers:
        vllm_serve = [
            args.vllm,
            "serve",
            model_dir,
            "--dtype",
            "float32",
            "--max-model-len",
            "4096",
            "--gpu-memory-utilization",
            "0.15",
            "--kv-cache-memory-bytes",
            "1073741824",
            "--served-model-name",
            MODEL,
        ]
        servers["vllm-cpu"] = vllm_serve
        servers["vllm-cpu-ngram"] = [*vllm_serve, "--speculative-config", NGRAM]
    if args.servers:
        unknown = sorted(set(args.servers) - set(servers))
        if unknown:
            parser.error(f"unknown server {unknown[0]!r}; known: {', '.join(servers)}")
        servers = {label: command for label, command in servers.items() if label in args.servers}
    sampling = (
        "vllm bench serve defaults (temperature 1)"
        if args.temperature is None
        else f"vllm bench serve defaults but --temperature {args.temperature:g}"
    )
    result = {
        "benchmark": f"speculative decoding over HTTP, {sampling}",
        "command": "python -m bench.speculative "
        + " ".join(
            f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
            for k, v in vars(args).items()
            if k not in ("out", "no_vllm_servers") and v is not None
        ),
        "speculative_configs": {
            "ngram": json.loads(NGRAM),
            "suffix": json.loads(SUFFIX),
            "draft_model": json.loads(draft_config(model_dir)),
        },
        "rounds": args.rounds,
        "loadavg_before": list(os.getloadavg()),
        "servers": {},
        "runs": {},
        "errors": {},
    }
    procs: dict[str, subprocess.Popen] = {}
    ports: dict[str, int] = {}
    # A SIGTERM (a timeout, a killed job) unwinds like an error, so that the servers are stopped below.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(f"{parser.prog}: terminated"))
    with tempfile.TemporaryDirectory(prefix="baton-bench-spec-") as tmp:
        tmp = Path(tmp)
        data = tmp / "dataset.jsonl"
        num_prompts = min(args.num_prompts, dataset(data))
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        grams = prompt_grams([json.loads(line)["prompt"] for line in data.read_text().splitlines()], tokenizer)
        try:
            for i, (label, command) in enumerate(servers.items()):
                ports[label] = 18451 + i
                try:
                    procs[label] = start(
                        label, ports[label], [*command, "--host", "127.0.0.1", "--port", str(ports[label])], tmp
                    )
                    result["servers"][label] = " ".join(command)
                except RuntimeError as exc:
                    result["errors"][label] = str(exc) + "\n" + (tmp / f"{label}.log").read_text()[-2000:]
                    print(f"{label}: {exc}")
            before = {label: spec_counters(ports[label]) for label in procs}
            order = list(procs)
            for c in args.concurrency:
                rounds: dict[str, list[dict]] = {label: [] for label in procs}
                for r in range(args.rounds):
                    for label in order:
                        run = bench_serve(
                            args.vllm,
                            ports[label],
                            data,
                            num_prompts,
                            c,
                            model_dir,
                            tmp / f"{label}-{c}-{r}.json",
                            args.temperature,
                        )
                        run["copied_share"] = copied_share(run.pop("replies"), grams, tokenizer)
                        rounds[label].append(run)
                        print(
                            f"concurrency {c:2d} round {r} {label:15s} {run['output_throughput']:7.1f} tok/s  "
                            f"TPOT p50 {run['tpot_ms']['p50']:.1f} ms  copied {run['copied_share']:.0%}",
                            flush=True,
                        )
                    order.reverse()
                # Each server's tokens/s: the mean of its rounds (every server ran first and last alike).
                result["runs"][str(c)] = {
                    label: {
                        **runs[0],
                        "output_throughput": statistics.mean(run["output_throughput"] for run in runs),
                        "copied_share": statistics.mean(run["copied_share"] for run in runs),
                        "rounds": runs,
                    }
                    for label, runs in rounds.items()
                }
            after = {label: spec_counters(ports[label]) for label in procs}
        finally:
            for proc in procs.values():
                stop(proc)
    for label, counters in after.items():
        if counters and before[label] and counters["draft_tokens"] > before[label]["draft_tokens"]:
            drafted = counters["draft_tokens"] - before[label]["draft_tokens"]
            accepted = counters["accepted_tokens"] - before[label]["accepted_tokens"]
            result.setdefault("acceptance", {})[label] = {
                "draft_tokens": drafted,
                "accepted_tokens": accepted,
                "rate": accepted / drafted,
            }
    result["speedup_vs_own_baseline"] = {
        c: {
            label: runs[label]["output_throughput"] / runs[base]["output_throughput"]
            for label, base in (
                ("baton-ngram", "baton"),
                ("baton-suffix", "baton"),
                ("baton-draft", "baton"),
                ("vllm-cpu-ngram", "vllm-cpu"),
            )
            if label in runs and base in runs
        }
        for c, runs in result["runs"].items()
    }
    result["loadavg_after"] = list(os.getloadavg())
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["speedup_vs_own_baseline"], indent=2))


if __name__ == "__main__":
    main()
