"""What a simulation reports: per-request records, their TTFT/TPOT/ITL distributions, goodput
(CONVENTIONS.md's vocabulary, bench/serve.py's definitions, common.stats' percentiles), per-pool
utilisation and queueing, LoRA adapters' requests and loads, as JSON and PNG plots."""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from common.stats import summary as latency_summary

__all__ = ["ItlSample", "LoRAStats", "RequestRecord", "SLO", "SimResult", "pyplot"]


@dataclass(frozen=True)
class SLO:
    ttft_s: float | None = None
    tpot_s: float | None = None

    def met(self, r: RequestRecord) -> bool:
        if not r.completed:
            return False
        if self.ttft_s is not None and r.ttft_s > self.ttft_s:
            return False
        tpot = r.tpot_s
        return self.tpot_s is None or tpot is None or tpot <= self.tpot_s


@dataclass
class RequestRecord:
    request_id: str
    client: str
    prompt_len: int
    output_len: int
    sent_s: float
    first_token_s: float | None = None
    done_s: float | None = None
    tokens: int = 0
    last_token_s: float = 0.0
    route: str = ""
    prefill_worker: str | None = None
    decode_worker: str = ""
    cached_tokens: int = 0
    queue_s: float | None = None  # routed to its first chunk scheduled on the prefilling worker
    failed: str = ""
    end_reason: str = ""  # router.flow_commands.EndReason's value
    migrations: int = 0  # decode workers it moved off (lost or drained)
    adapter: str | None = None  # its LoRA adapter (None: the base model)

    @property
    def completed(self) -> bool:
        return self.done_s is not None and not self.failed

    @property
    def ttft_s(self) -> float:
        return (self.first_token_s or 0.0) - self.sent_s

    @property
    def e2el_s(self) -> float:
        return (self.done_s or 0.0) - self.sent_s

    @property
    def tpot_s(self) -> float | None:
        return (self.e2el_s - self.ttft_s) / (self.tokens - 1) if self.completed and self.tokens > 1 else None


class ItlSample:
    """Inter-token gaps: all of them up to `cap`, then a uniform reservoir sample (bounded memory at scale)."""

    def __init__(self, cap: int = 500_000, seed: int = 0) -> None:
        self.cap = cap
        self.values: list[float] = []
        self.seen = 0
        self._rng = random.Random(seed)

    def add(self, gap: float) -> None:
        self.seen += 1
        if len(self.values) < self.cap:
            self.values.append(gap)
        else:
            j = self._rng.randrange(self.seen)
            if j < self.cap:
                self.values[j] = gap


@dataclass
class PoolStats:
    workers: int
    gpu_seconds: float
    busy_seconds: float
    steps: int
    prefill_tokens: int
    decode_tokens: int
    queue_s: list[float] = field(default_factory=list)

    def summary(self, duration_s: float) -> dict:
        return {
            "workers_at_end": self.workers,
            "gpu_seconds": self.gpu_seconds,
            "utilisation": self.busy_seconds / self.gpu_seconds if self.gpu_seconds else 0.0,
            "steps": self.steps,
            "prefill_tokens": self.prefill_tokens,
            "decode_tokens": self.decode_tokens,
            "queue_ms": latency_summary(self.queue_s),
        }


@dataclass
class LoRAStats:
    """LoRA over the whole run, all workers together (cluster.sim.lora.LoRACounters summed):
    adapter loads by adapter, seconds steps waited for them, steps by distinct adapters in their batch."""

    max_loras: int  # each worker's device slots (0: LoRA not modelled)
    max_cpu_loras: int | None
    slot_loads: dict[str, int] = field(default_factory=dict)
    disk_loads: dict[str, int] = field(default_factory=dict)
    load_s: float = 0.0
    steps_by_adapters: dict[int, int] = field(default_factory=dict)

    def summary(self, records: list[RequestRecord], loads: bool = True) -> dict:
        """Requests per adapter (and the base model's), with each adapter's loads when `loads`."""
        adapters: dict[str, dict] = {}
        base = 0
        for r in records:
            if r.adapter is None:
                base += 1
                continue
            row = adapters.setdefault(r.adapter, {"requests": 0, "completed": 0})
            row["requests"] += 1
            row["completed"] += r.completed
        out: dict = {"max_loras": self.max_loras, "max_cpu_loras": self.max_cpu_loras, "base_requests": base}
        if loads:
            for name in {*self.slot_loads, *self.disk_loads}:
                adapters.setdefault(name, {"requests": 0, "completed": 0})
            for name, row in adapters.items():
                row["slot_loads"] = self.slot_loads.get(name, 0)
                row["disk_loads"] = self.disk_loads.get(name, 0)
            out.update(
                slot_loads=sum(self.slot_loads.values()),
                disk_loads=sum(self.disk_loads.values()),
                load_s=self.load_s,
                steps_by_adapters={str(k): v for k, v in sorted(self.steps_by_adapters.items())},
            )
        out["adapters"] = dict(sorted(adapters.items(), key=lambda kv: (-kv[1]["requests"], kv[0])))
        return out


@dataclass
class SimResult:
    records: list[RequestRecord]
    itl: ItlSample
    pools: Mapping[str, PoolStats]
    timeline: list[dict]  # sampled every heartbeat: time, pool sizes, queued work
    decision_s: list[float]
    duration_s: float
    sim_wall_s: float
    config: dict
    lora: LoRAStats | None = None  # None: no LoRA in the run (LoRA off and no request under an adapter)

    def select(self, client: str | None = None) -> list[RequestRecord]:
        return [r for r in self.records if client is None or r.client == client]

    def summary(self, slo: SLO | None = None, client: str | None = None) -> dict:
        slo = slo or SLO()
        recs = self.select(client)
        done = [r for r in recs if r.completed]
        duration = self.duration_s or 1e-9
        good = [r for r in recs if slo.met(r)]
        out_tokens = sum(r.tokens for r in done)
        itl = self.itl.values if client is None else []
        return {
            "requests": len(recs),
            "completed": len(done),
            "failed": len(recs) - len(done),
            "duration_s": duration,
            "request_throughput": len(done) / duration,
            "output_throughput": out_tokens / duration,
            "goodput": len(good) / duration,
            "slo_attainment": len(good) / len(recs) if recs else 0.0,
            "slo": {
                "ttft_ms": None if slo.ttft_s is None else slo.ttft_s * 1e3,
                "tpot_ms": None if slo.tpot_s is None else slo.tpot_s * 1e3,
            },
            "ttft_ms": latency_summary([r.ttft_s for r in done]),
            "tpot_ms": latency_summary([r.tpot_s for r in done if r.tpot_s is not None]),
            "itl_ms": latency_summary(itl),
            "e2el_ms": latency_summary([r.e2el_s for r in done]),
            "cached_token_fraction": (sum(r.cached_tokens for r in done) / max(1, sum(r.prompt_len for r in done))),
            "routes": _count(r.route for r in recs),
            **({"lora": self.lora.summary(recs, loads=client is None)} if self.lora is not None else {}),
        }

    def report(self, slo: SLO | None = None) -> dict:
        clients = sorted({r.client for r in self.records})
        return {
            "overall": self.summary(slo),
            "by_client": {c: self.summary(slo, c) for c in clients} if len(clients) > 1 else {},
            "pools": {name: p.summary(self.duration_s) for name, p in self.pools.items()},
            "router_decision_ms": latency_summary(self.decision_s),
            "simulated_s": self.duration_s,
            "simulation_wall_s": self.sim_wall_s,
            "config": self.config,
        }

    def plot(self, path: str | Path, title: str = "") -> None:
        """TTFT and TPOT distributions, and pool sizes and queued prefill work over time."""
        plt = pyplot()
        done = [r for r in self.records if r.completed]
        fig, axes = plt.subplots(1, 3, figsize=(15, 4))
        for ax, values, label in (
            (axes[0], [r.ttft_s * 1e3 for r in done], "TTFT (ms)"),
            (axes[1], [r.tpot_s * 1e3 for r in done if r.tpot_s is not None], "TPOT (ms)"),
        ):
            if values:
                ax.hist(values, bins=50)
            ax.set_xlabel(label)
            ax.set_ylabel("requests")
        ax = axes[2]
        if self.timeline:
            t = [p["t"] for p in self.timeline]
            ax.plot(t, [p["prefill_workers"] for p in self.timeline], label="prefill workers")
            ax.plot(t, [p["decode_workers"] for p in self.timeline], label="decode workers")
            ax.set_xlabel("time (s)")
            ax.set_ylabel("workers")
            ax2 = ax.twinx()
            ax2.plot(
                t,
                [p["queued_prefill_tokens"] for p in self.timeline],
                color="grey",
                alpha=0.5,
                label="queued prefill tokens",
            )
            ax2.set_ylabel("queued prefill tokens")
            ax.legend(loc="upper left")
        fig.suptitle(title)
        fig.tight_layout()
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=100)
        plt.close(fig)


def pyplot():
    """matplotlib's pyplot on the file-only backend, imported when a plot is drawn (the serving path
    imports this module for its metric helpers and never draws)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _count(items) -> dict:
    out: dict[str, int] = {}
    for item in items:
        out[item] = out.get(item, 0) + 1
    return out
