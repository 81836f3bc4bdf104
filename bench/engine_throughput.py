"""Offline engine throughput: Baton vs transformers `generate` on the same model, same requests.

    .venv/bin/python -m bench.engine_throughput                      # default: 64 requests, concurrency 1 8 32
    .venv/bin/python -m bench.engine_throughput --num-requests 16 --concurrency 1 32 --skip-hf-batched
    .venv/bin/python -m bench.engine_throughput --moe --num-requests 32 --concurrency 1 16 --sequential-requests 8 \
        --max-output 64 --hf-batch-sizes 16     # the bench's own tiny Mixtral (MOE_SHAPE), random weights

--moe builds a small Mixtral (MOE_SHAPE: 8 experts, top-2, hidden 512, 4 layers) from a seeded random
init, saves it as safetensors under a temporary folder and runs both systems on it (output:
bench/results/engine_throughput_moe.json unless --out is given).

Requests: fixed RNG seed; prompts of 32-512 random token ids from the vocabulary (special ids
excluded), outputs of 16-96 tokens, greedy, ignore_eos (so every request yields exactly its
requested length). Baton runs all requests added at once with EngineConfig(max_num_seqs=C) for
each concurrency C (fresh engine each time, so no prefix-cache reuse between runs; random prompts
share no prefixes). transformers runs (a) sequentially, one request at a time, and (b) in padded
batches (left padding, attention mask); a padded batch generates up to its longest requested
output, but only each request's requested tokens count as useful output.

The one-at-a-time configs (transformers sequential, Baton max_num_seqs=1) run only the first
--sequential-requests requests (default 16) to keep a default run near 10 minutes on 2 cores.
Engine construction and model loading are not timed; a small warm-up runs before each timed run.
Output: a markdown table on stdout and JSON (--out, default bench/results/engine_throughput.json).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import random
import shlex
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]

from common.sampling_params import SamplingParams
from workers.build import load_engine
from workers.config import EngineConfig
from workers.models.files import resolve_model_dir

SEED = 20261130
PROMPT_RANGE = (32, 512)
OUTPUT_MIN = 16


# The --moe model: a Mixtral small enough for this machine, with the routing of the real ones.
MOE_SHAPE = dict(
    vocab_size=4096,
    hidden_size=512,
    intermediate_size=1024,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    num_local_experts=8,
    num_experts_per_tok=2,
    max_position_embeddings=2048,
    sliding_window=None,
    tie_word_embeddings=False,
    initializer_range=0.1,
)  # wider than the default 0.02, so greedy choices are not near ties


def build_moe_model(folder: Path) -> Path:
    """MOE_SHAPE as a seeded random transformers Mixtral, saved (safetensors) into folder."""
    import transformers

    torch.manual_seed(SEED)
    model = transformers.MixtralForCausalLM(transformers.MixtralConfig(**MOE_SHAPE)).eval()
    model.save_pretrained(folder)
    return folder


def make_requests(n: int, vocab: int, max_output: int, seed: int = SEED) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    low = min(100, vocab // 4)  # skip the special / control tokens at the start of the vocabulary
    reqs = []
    for _ in range(n):
        plen = rng.randint(*PROMPT_RANGE)
        olen = rng.randint(min(OUTPUT_MIN, max_output), max_output)
        reqs.append(([rng.randrange(low, vocab) for _ in range(plen)], olen))
    return reqs


def machine_info() -> dict:
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        nproc = int(subprocess.run(["nproc"], capture_output=True, text=True).stdout.strip())
    except Exception:
        nproc = os.cpu_count()
    try:
        load = os.getloadavg()
    except OSError:
        load = None
    return {
        "nproc": nproc,
        "cpu_model": cpu,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "loadavg_at_start": load,
    }


# ---- Baton ---------------------------------------------------------------------------------
# Offline throughput: a step may batch several whole prompts (serving keeps the smaller default so
# that decoding starts sooner).
OFFLINE_MAX_NUM_BATCHED_TOKENS = 1024


def run_baton(model_dir, reqs, concurrency: int, kv_cache_memory: int, dtype: str = "float32") -> dict:
    engine = load_engine(
        model_dir,
        EngineConfig(
            max_num_seqs=concurrency,
            kv_cache_memory=kv_cache_memory,
            dtype=dtype,
            max_num_batched_tokens=OFFLINE_MAX_NUM_BATCHED_TOKENS,
        ),
    )
    warm = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    engine.generate([[101 + i for i in range(40)], [201 + i for i in range(20)]], warm)
    prompts = [p for p, _ in reqs]
    params = [SamplingParams(max_tokens=o, temperature=0.0, ignore_eos=True) for _, o in reqs]
    pre = engine.stats()
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params)
    secs = time.perf_counter() - t0
    st = engine.stats()
    tokens = sum(len(o.token_ids) for o in outs)
    assert tokens == sum(o for _, o in reqs), "ignore_eos run produced a different number of tokens"
    return {
        "output_tokens": tokens,
        "seconds": secs,
        "tok_s": tokens / secs,
        "num_preemptions": st.num_preemptions - pre.num_preemptions,
        "kv_blocks": st.num_blocks,
        "token_ids": [o.token_ids for o in outs],
    }


# ---- transformers --------------------------------------------------------------------------
def load_hf(model_dir, dtype: str = "float32"):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    model.generation_config.eos_token_id = None  # same as ignore_eos: always the requested length
    return model


def _hf_generate(model, batch: list[list[int]], new_tokens: int, pad_id: int) -> torch.Tensor:
    width = max(len(p) for p in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for i, p in enumerate(batch):  # left padding
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    out = model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=pad_id,
    )
    return out[:, width:]


def run_hf_sequential(model, reqs) -> dict:
    with torch.inference_mode():
        _hf_generate(model, [[101 + i for i in range(40)]], 4, 0)  # warm-up
        t0 = time.perf_counter()
        token_ids = []
        for p, o in reqs:
            token_ids.append(_hf_generate(model, [p], o, 0)[0].tolist())
        secs = time.perf_counter() - t0
    tokens = sum(len(t) for t in token_ids)
    return {"output_tokens": tokens, "seconds": secs, "tok_s": tokens / secs, "token_ids": token_ids}


def run_hf_batched(model, reqs, batch_size: int) -> dict:
    useful = generated = 0
    with torch.inference_mode():
        _hf_generate(model, [[101 + i for i in range(40)], [7] * 10], 4, 0)  # warm-up
        t0 = time.perf_counter()
        token_ids = []
        for s in range(0, len(reqs), batch_size):
            chunk = reqs[s : s + batch_size]
            longest = max(o for _, o in chunk)
            out = _hf_generate(model, [p for p, _ in chunk], longest, 0)
            generated += out.numel()
            for row, (_, o) in zip(out, chunk):
                token_ids.append(row[:o].tolist())
                useful += o
        secs = time.perf_counter() - t0
    return {
        "output_tokens": useful,
        "generated_tokens_incl_padding": generated,
        "seconds": secs,
        "tok_s": useful / secs,
        "token_ids": token_ids,
    }


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Fraction of requests whose greedy tokens are identical (float32, order of sums may flip near ties)."""
    same = sum(x == y for x, y in zip(a, b))
    return same / max(1, min(len(a), len(b)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model folder (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--max-output", type=int, default=96, help="outputs are uniform in [16, max-output] tokens")
    ap.add_argument(
        "--sequential-requests",
        type=int,
        default=16,
        help="one-at-a-time configs (transformers sequential and Baton max_num_seqs=1) run the first N "
        "requests only, to bound run time (tok/s is a rate); 0 = all (default 16)",
    )
    ap.add_argument("--hf-batch-sizes", type=int, nargs="*", default=[8, 32])
    ap.add_argument("--skip-hf-batched", action="store_true")
    ap.add_argument("--kv-cache-memory", type=int, default=2 << 30, help="bytes of KV cache for Baton")
    ap.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="weights and activations, the same for Baton and transformers",
    )
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores, nproc)")
    ap.add_argument("--moe", action="store_true", help="run on the bench's own small Mixtral (MOE_SHAPE, random init)")
    ap.add_argument(
        "--out",
        default=None,
        help="JSON output (default bench/results/engine_throughput.json, engine_throughput_moe.json with --moe)",
    )
    args = ap.parse_args(argv)
    if args.out is None:
        args.out = str(
            REPO / "bench" / "results" / ("engine_throughput_moe.json" if args.moe else "engine_throughput.json")
        )
    if args.moe and args.model:
        ap.error("--moe builds its own model; drop --model")

    info = machine_info()
    threads = args.threads or info["nproc"] or os.cpu_count()
    torch.set_num_threads(threads)
    if args.moe:
        import tempfile

        model_dir = build_moe_model(Path(tempfile.mkdtemp(prefix="baton-bench-moe-")))
    else:
        model_dir = resolve_model_dir(args.model)
    from workers.models.config import ModelConfig

    vocab = ModelConfig.from_model_dir(model_dir).vocab_size
    reqs = make_requests(args.num_requests, vocab, args.max_output)
    n_seq = min(args.sequential_requests or len(reqs), len(reqs))
    started = dt.datetime.now(dt.timezone.utc)

    results: dict[str, dict] = {}

    def log(msg):
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)

    def loadavg():
        try:
            return [round(x, 2) for x in os.getloadavg()]
        except OSError:
            return None

    def report(complete: bool) -> None:
        base = results["hf_sequential"]["tok_s"]
        ref_ids = results["hf_sequential"]["token_ids"]
        for r in results.values():
            r["ratio_vs_hf_sequential"] = r["tok_s"] / base
            r["greedy_agreement_vs_hf_sequential"] = agreement(r["token_ids"][:n_seq], ref_ids)

        rows = []
        order = sorted(results, key=lambda k: (results[k]["system"] != "baton", results[k]["concurrency"], k))
        for name, r in ((k, results[k]) for k in order):
            label = (
                f"Baton, max_num_seqs={r['concurrency']}"
                if r["system"] == "baton"
                else "transformers sequential"
                if name == "hf_sequential"
                else f"transformers padded batch {r['concurrency']}"
            )
            rows.append((label, r))
        table = [
            "| config | requests | output tokens | seconds | output tok/s | vs transformers sequential |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for label, r in rows:
            table.append(
                f"| {label} | {r['requests']} | {r['output_tokens']} | {r['seconds']:.1f} | {r['tok_s']:.1f} | "
                f"{r['ratio_vs_hf_sequential']:.2f}x |"
            )
        print("\n" + "\n".join(table))

        best = max(
            (r for r in results.values() if r["system"] == "baton" and r["concurrency"] == 32),
            default=None,
            key=lambda r: r["tok_s"],
        )
        target = {
            "goal": "Baton at 32 concurrent sequences >= 5x transformers sequential output tok/s",
            "ratio": None if best is None else best["ratio_vs_hf_sequential"],
            "met": None if best is None else best["ratio_vs_hf_sequential"] >= 5.0,
        }
        print(f"\ntarget: {target}")

        prompt_lens = [len(p) for p, _ in reqs]
        out_lens = [o for _, o in reqs]
        doc = {
            "benchmark": "offline output tokens/s, Baton engine vs transformers generate",
            "date": started.isoformat(timespec="seconds"),
            "complete": complete,
            "wall_seconds": round(time.time() - started.timestamp(), 1),
            "command": " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]),
            "machine": info,
            "torch_threads": threads,
            "model": str(model_dir),
            "model_name": "bench-mixtral-8x-top2 (random init)" if args.moe else Path(model_dir).name,
            "model_shape": MOE_SHAPE if args.moe else None,
            "dtype": args.dtype,
            "workload": {
                "num_requests": len(reqs),
                "seed": SEED,
                "prompt_tokens": {
                    "range": list(PROMPT_RANGE),
                    "total": sum(prompt_lens),
                    "mean": sum(prompt_lens) / len(reqs),
                },
                "output_tokens": {
                    "range": [min(OUTPUT_MIN, args.max_output), args.max_output],
                    "total": sum(out_lens),
                    "mean": sum(out_lens) / len(reqs),
                },
                "prompts": "random token ids from the vocabulary (ids >= 100), no shared prefixes",
                "sequential_subset": {
                    "num_requests": n_seq,
                    "prompt_tokens_mean": sum(prompt_lens[:n_seq]) / n_seq,
                    "output_tokens_mean": sum(out_lens[:n_seq]) / n_seq,
                },
                "sampling": "greedy (temperature 0), ignore_eos: each request yields exactly its requested tokens",
            },
            "notes": [
                "Baton: all requests added at once, "
                f"EngineConfig(max_num_seqs=C, kv_cache_memory={args.kv_cache_memory}, "
                f"dtype={args.dtype}), fresh engine per C; "
                "engine construction not timed; a 2-request warm-up precedes each timed run.",
                f"transformers: AutoModelForCausalLM {args.dtype}, "
                "generate(do_sample=False, eos_token_id=None, "
                "min_new_tokens=max_new_tokens), one warm-up call.",
                "transformers padded batches: requests in order, left padding + attention mask, "
                "each batch generates up to "
                "its longest requested output (generated_tokens_incl_padding); "
                "only each request's requested tokens count "
                "as output tokens.",
                (
                    "one-at-a-time configs (transformers sequential, Baton max_num_seqs=1) "
                    f"measured on the first {n_seq} of "
                    f"{len(reqs)} requests (the same requests, a subset to bound run time on this machine; see "
                    f"workload.sequential_subset for its token mix); tok/s is a rate, so ratios compare rates."
                    if n_seq < len(reqs)
                    else "all configs measured on all requests."
                ),
                f"torch.set_num_threads({threads}) for both systems; the machine is shared with other developers, so "
                "timings carry noise (machine.loadavg_at_start; loadavg_after per result: 1/5/15-minute load averages, "
                "where 2.0 means both cores busy).",
                "greedy_agreement_vs_hf_sequential: fraction of the requests measured by transformers sequential whose "
                "greedy tokens are identical (float32; summation order can flip near ties in random-token prompts).",
            ],
            "target": target,
            "results": {k: {kk: vv for kk, vv in v.items() if kk != "token_ids"} for k, v in results.items()},
            "table_markdown": "\n".join(table),
        }
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
        print(f"wrote {args.out}")

    hf = None

    def baton_job(c):
        sub = reqs[:n_seq] if c == 1 else reqs
        log(f"Baton, max_num_seqs={c}, {len(sub)} requests ...")
        results[f"baton_c{c}"] = {
            "system": "baton",
            "concurrency": c,
            "requests": len(sub),
            **run_baton(model_dir, sub, c, args.kv_cache_memory, args.dtype),
            "loadavg_after": loadavg(),
        }
        log(f"  {results[f'baton_c{c}']['tok_s']:.1f} tok/s")

    def hf_seq_job():
        nonlocal hf
        if hf is None:
            hf = load_hf(model_dir, args.dtype)
        log(f"transformers sequential, {n_seq} of {len(reqs)} requests ...")
        results["hf_sequential"] = {
            "system": "transformers",
            "concurrency": 1,
            "requests": n_seq,
            **run_hf_sequential(hf, reqs[:n_seq]),
            "loadavg_after": loadavg(),
        }
        log(f"  {results['hf_sequential']['tok_s']:.1f} tok/s")

    def hf_batch_job(b):
        nonlocal hf
        if hf is None:
            hf = load_hf(model_dir, args.dtype)
        log(f"transformers padded batches of {b}, {len(reqs)} requests ...")
        results[f"hf_batch{b}"] = {
            "system": "transformers",
            "concurrency": b,
            "requests": len(reqs),
            **run_hf_batched(hf, reqs, b),
            "loadavg_after": loadavg(),
        }
        log(f"  {results[f'hf_batch{b}']['tok_s']:.1f} tok/s")

    # The headline pair first and back to back (similar machine load), then the rest; the JSON is
    # rewritten after every config (complete: false until the last), so an interrupted run keeps its numbers.
    conc = sorted(set(args.concurrency), reverse=True)
    jobs = [lambda: baton_job(conc[0]), hf_seq_job] + [lambda c=c: baton_job(c) for c in conc[1:]]
    if not args.skip_hf_batched:
        jobs += [lambda b=b: hf_batch_job(b) for b in args.hf_batch_sizes]
    for i, job in enumerate(jobs):
        job()
        if "hf_sequential" in results:
            report(complete=i == len(jobs) - 1)

    return 0


if __name__ == "__main__":
    sys.exit(main())
