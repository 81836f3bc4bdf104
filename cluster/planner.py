"""The SLO planner: how many prefill and decode workers a fixed number of GPUs should run.

A split's **goodput** is DistServe's: the highest request rate of the workload's mix at which at
least `attainment` (default 90%) of requests meet both the TTFT and the TPOT SLO, found by
bisection on the rate, each probe one simulation (cluster/sim) with the same random arrivals,
stopped as soon as it cannot pass (`probe`).
Goodput per GPU is that rate over the GPUs the split uses.

The planner does not simulate every split. It estimates each pool's capacity per worker from the
cost model (a prefill worker: prompts per second, chunk by chunk under the token budget; a decode
worker: requests per second at the largest batch whose step still meets the TPOT SLO and whose
KV fits), starts from the split that balances the two, and climbs to the better neighbour until
neither is better; the colocated layout (no prefill pool: decode workers prefill) is one more
candidate. `exhaustive` simulates every split, the yardstick the planner is tested against.

LoRA: a workload with an adapter mix (`WorkloadSpec.adapters`: how many adapters, their
distribution, the base model's share) is simulated with it, under the engine's `max_loras` slots
(`EngineSettings`, which must then be at least 1) and LoRA costs; the capacity estimate stretches
a step by the adapters a batch is expected to hold (load waits are left to the simulations).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path

from cluster.sim.costs import CostModel, LinkModel, ServingOverheads, StepShape
from cluster.sim.engine import EngineSettings
from cluster.sim.metrics import SLO, RequestRecord, pyplot
from cluster.sim.simulator import ClusterSpec, Simulator
from cluster.sim.workload import Client, SimRequest, WorkloadSpec
from router.routing import RoutingConfig

__all__ = [
    "Plan",
    "PlanProblem",
    "ProbeResult",
    "SplitEvaluations",
    "SplitResult",
    "capacity_estimate",
    "evaluate_split",
    "exhaustive",
    "plan",
    "plot_plan",
    "probe",
]


@dataclass(frozen=True)
class PlanProblem:
    gpus: int
    workload: WorkloadSpec
    slo: SLO
    cost: CostModel
    prefill_cost: CostModel | None = None  # default: the decode pool's
    overheads: ServingOverheads = field(default_factory=ServingOverheads)
    link: LinkModel = field(default_factory=lambda: LinkModel("default", 50e9))
    engine: EngineSettings = field(default_factory=EngineSettings)
    routing: RoutingConfig = field(default_factory=lambda: RoutingConfig(seed=0))
    attainment: float = 0.9
    requests_per_probe: int = 400
    # A probe must last long enough for an overloaded split to show it (the queue grows past the
    # TTFT SLO): default 10 x the TTFT SLO; requests in its first 20% only warm the caches up.
    min_probe_s: float | None = None
    rate_tolerance: float = 0.03  # bisection stops when hi/lo - 1 is below this
    allow_colocated: bool = True

    def __post_init__(self) -> None:
        if self.slo.ttft_s is None or self.slo.tpot_s is None:
            raise ValueError("the planner needs both a TTFT and a TPOT SLO")
        if self.workload.adapters is not None and not self.engine.max_loras:
            raise ValueError("a workload with LoRA adapters needs the engine's max_loras >= 1 (its device slots)")
        if not 0 < self.attainment <= 1:
            raise ValueError(f"attainment must be in (0, 1], got {self.attainment}")
        if self.max_workers < 2:
            raise ValueError(f"{self.gpus} GPUs hold fewer than 2 workers of {self.decode_gpus} GPU(s)")

    @property
    def pcost(self) -> CostModel:
        return self.prefill_cost or self.cost

    @property
    def decode_gpus(self) -> int:
        return self.cost.gpus_per_worker()

    @property
    def ttft_slo_s(self) -> float:
        assert self.slo.ttft_s is not None  # __post_init__ checked there is one
        return self.slo.ttft_s

    @property
    def tpot_slo_s(self) -> float:
        assert self.slo.tpot_s is not None  # __post_init__ checked there is one
        return self.slo.tpot_s

    @property
    def max_workers(self) -> int:
        return self.gpus // max(self.decode_gpus, self.pcost.gpus_per_worker())

    def splits(self) -> list[tuple[int, int]]:
        """Every (prefill, decode) worker pair that fills the GPUs as far as whole workers go."""
        out = [(0, self.gpus // self.decode_gpus)] if self.allow_colocated else []
        pg, dg = self.pcost.gpus_per_worker(), self.decode_gpus
        for p in range(1, self.gpus // pg):
            d = (self.gpus - p * pg) // dg
            if d >= 1:
                out.append((p, d))
        return out


@dataclass(frozen=True)
class SplitResult:
    prefill_workers: int
    decode_workers: int
    gpus: int
    goodput: float  # requests/s at which attainment >= target
    attainment_at_goodput: float
    probes: int

    @property
    def goodput_per_gpu(self) -> float:
        return self.goodput / self.gpus if self.gpus else 0.0

    @property
    def label(self) -> str:
        return f"{self.prefill_workers}P:{self.decode_workers}D"


@dataclass(frozen=True)
class Plan:
    best: SplitResult
    evaluated: tuple[SplitResult, ...]
    simulations: int
    method: str
    estimate: dict

    def to_dict(self) -> dict:
        def row(r):
            return {**dataclasses.asdict(r), "goodput_per_gpu": r.goodput_per_gpu, "split": r.label}

        return {
            "method": self.method,
            "best": row(self.best),
            "simulations": self.simulations,
            "estimate": self.estimate,
            "evaluated": [row(r) for r in self.evaluated],
        }


def _prefill_seconds(cost: CostModel, engine: EngineSettings, uncached: int, cached: int) -> float:
    """One prompt prefilled alone, chunk by chunk under the token budget."""
    t, done = 0.0, cached
    left = max(1, uncached)
    while left > 0:
        n = min(left, engine.max_num_batched_tokens)
        t += cost.step_time(StepShape.of([(done, n, left == n)]))
        done += n
        left -= n
    return t


def _lora_stretch(problem: PlanProblem, batch: int) -> float:
    """How much longer a step of `batch` requests of the workload's adapter mix is than the base
    model's: 1 + step_fraction x the distinct adapters such a batch is expected to hold (at most
    max_loras; what the scheduler defers to later steps is not counted)."""
    mix, eng = problem.workload.adapters, problem.engine
    if mix is None or not eng.max_loras:
        return 1.0
    shares = [p for name, p in mix.probabilities().items() if name is not None]
    expected = sum(1 - (1 - p) ** batch for p in shares)
    return 1 + eng.lora_step_fraction * min(float(eng.max_loras), expected)


def capacity_estimate(problem: PlanProblem) -> dict:
    """Per-worker capacities (requests/s) and the split that balances them."""
    wl, eng = problem.workload, problem.engine
    prompt = wl.mean_prompt_len()
    cached = wl.prefix_len * wl.prefix_fraction if wl.prefix_groups else 0.0
    out = max(1.0, wl.output_len.expected())
    prefill_cap = 1.0 / (
        _prefill_seconds(problem.pcost, eng, int(prompt - cached), int(cached)) * _lora_stretch(problem, 1)
    )
    cost = problem.cost
    kv_blocks = eng.num_kv_blocks or cost.kv_capacity_tokens() // eng.block_size
    context = prompt + out / 2
    best_batch, best_step = 1, cost.step_time(StepShape.of([(int(context), 1, True)]))
    for b in range(1, eng.max_num_seqs + 1):
        if b * math.ceil((prompt + out) / eng.block_size) > kv_blocks:
            break
        step = cost.step_time(StepShape.of([(int(context), 1, True)] * b)) * _lora_stretch(problem, b)
        if step > 0.9 * problem.tpot_slo_s:
            break
        best_batch, best_step = b, step
    decode_cap = best_batch / best_step / out
    pg, dg = problem.pcost.gpus_per_worker(), problem.decode_gpus
    # maximise min(p * prefill_cap, d * decode_cap) subject to p * pg + d * dg = gpus
    p_star = problem.gpus * decode_cap / (decode_cap * pg + prefill_cap * dg)
    return {
        "prefill_requests_per_s_per_worker": prefill_cap,
        "decode_requests_per_s_per_worker": decode_cap,
        "decode_batch_within_tpot": best_batch,
        "balanced_prefill_workers": p_star,
        "rate_upper_bound": min(p_star * prefill_cap, (problem.gpus - p_star * pg) / dg * decode_cap) * 1.5,
    }


@dataclass(frozen=True)
class ProbeResult:
    passed: bool  # at least the problem's `attainment` of the requests after the warm-up met both SLOs
    attainment: float | None  # the fraction that did; None when the probe stopped once it had failed


def _sent_s(client: Client, request: SimRequest) -> float:
    """When an open-loop client sends the request: its start plus the request's arrival."""
    if request.arrival_s is None:
        raise ValueError(f"request {request.request_id} has no arrival_s: the planner's workloads are open loop")
    return client.start_s + request.arrival_s


def probe(problem: PlanProblem, p: int, d: int, rate: float, stop_once_failed: bool = True) -> ProbeResult:
    """One simulation of the split at the rate. With stop_once_failed it ends as soon as so many
    requests have missed (failed, late for their TTFT, or done outside the TPOT SLO) that it cannot
    pass: the verdict is the one the whole run gives (an overloaded probe would otherwise run its
    queue down to the drain limit), only the fraction is not known."""
    slo, ttft_s, target = problem.slo, problem.ttft_slo_s, problem.attainment
    min_s = problem.min_probe_s if problem.min_probe_s is not None else 10 * ttft_s
    duration = max(min(problem.requests_per_probe / rate, 20 * min_s), min_s)
    warm_up = 0.2 * duration
    workload = dataclasses.replace(problem.workload, rate=rate, duration_s=duration).generate()
    # An open-loop client sends each request at its arrival time, which becomes its sent_s.
    counted = sum(1 for c in workload.clients for r in c.requests if _sent_s(c, r) >= warm_up)
    spec = ClusterSpec(p, d, problem.engine, problem.routing, drain_limit_s=max(10.0, 4 * ttft_s))
    sim = Simulator(spec, problem.cost, problem.overheads, problem.link, problem.pcost, record_itl=False)
    stopped = False

    def missed(r: RequestRecord, now: float) -> bool:
        if r.failed:
            return True
        if r.first_token_s is None:
            return now - r.sent_s > ttft_s  # its first token comes at now or later
        return r.ttft_s > ttft_s or (r.done_s is not None and not slo.met(r))

    def check(s: Simulator) -> None:
        nonlocal stopped
        now = s.loop.now
        misses = sum(1 for r in s.records if r.sent_s >= warm_up and missed(r, now))
        if (counted - misses) / counted < target:  # even if every other request meets both SLOs
            stopped = True
            s.stop()

    if stop_once_failed and counted:
        sim.every(ttft_s / 2, check)
    records = [r for r in sim.run(workload).records if r.sent_s >= warm_up]
    if stopped:
        return ProbeResult(False, None)
    assert len(records) == counted, (len(records), counted)
    att = sum(slo.met(r) for r in records) / len(records) if records else 0.0
    return ProbeResult(att >= target, att)


def evaluate_split(problem: PlanProblem, p: int, d: int, rate_hint: float) -> SplitResult:
    """Bisect the rate for the highest one whose SLO attainment reaches the target (geometric
    bisection between a passing and a failing rate, found by doubling or tripling down from the hint;
    a split that misses the target even at 1/100 of the hint has goodput 0)."""
    gpus = p * problem.pcost.gpus_per_worker() + d * problem.decode_gpus
    probes = 0

    def passing(rate: float) -> float | None:
        """The attainment at the rate when the split passes there; None when it fails."""
        nonlocal probes
        probes += 1
        result = probe(problem, p, d, rate)
        return result.attainment if result.passed else None

    hint = max(rate_hint, 1e-6)
    att = passing(hint)
    if att is not None:
        lo, lo_att, hi = hint, att, hint * 2
        while probes < 10:
            att = passing(hi)
            if att is None:
                break
            lo, lo_att, hi = hi, att, hi * 2
    else:
        hi, lo = hint, 0.0
        while hi > hint / 100:
            hi_fail, hi = hi, hi / 3
            att = passing(hi)
            if att is not None:
                lo, lo_att, hi = hi, att, hi_fail
                break
        if lo == 0.0:  # the last probe's attainment, in full (it stopped once it had failed)
            full = probe(problem, p, d, hi, stop_once_failed=False)
            assert full.attainment is not None  # a probe run to its end measures its attainment
            return SplitResult(p, d, gpus, 0.0, full.attainment, probes)
    while hi / lo - 1 > problem.rate_tolerance:
        mid = math.sqrt(lo * hi)
        att = passing(mid)
        if att is not None:
            lo, lo_att = mid, att
        else:
            hi = mid
    return SplitResult(p, d, gpus, lo, lo_att, probes)


@dataclass
class SplitEvaluations:
    """The splits evaluated for one problem, for `plan` and `exhaustive` to share: a split's result
    depends on the problem alone (seeded arrivals and routing), so a second search on the same
    problem (`baton plan --exhaustive`) reuses what the first simulated instead of simulating it
    again. Its results are the same either way; each keeps the probe count of its simulations."""

    problem: PlanProblem
    results: dict[tuple[int, int, float], SplitResult] = field(default_factory=dict)

    def evaluate(self, p: int, d: int, rate_hint: float) -> SplitResult:
        key = (p, d, rate_hint)
        if key not in self.results:
            self.results[key] = evaluate_split(self.problem, p, d, rate_hint)
        return self.results[key]


def _evaluations(problem: PlanProblem, evaluations: SplitEvaluations | None) -> SplitEvaluations:
    if evaluations is None:
        return SplitEvaluations(problem)
    if evaluations.problem != problem:
        raise ValueError("these split evaluations are for another planning problem")
    return evaluations


def exhaustive(problem: PlanProblem, evaluations: SplitEvaluations | None = None) -> Plan:
    """Every split, evaluated (those in `evaluations` already are not simulated again)."""
    est = capacity_estimate(problem)
    evaluations = _evaluations(problem, evaluations)
    results = [evaluations.evaluate(p, d, est["rate_upper_bound"]) for p, d in problem.splits()]
    best = max(results, key=lambda r: (r.goodput_per_gpu, -r.gpus))
    return Plan(best, tuple(results), sum(r.probes for r in results), "exhaustive", est)


def plan(problem: PlanProblem, evaluations: SplitEvaluations | None = None) -> Plan:
    """Estimate, then hill-climb over the split (and try the colocated layout)."""
    est = capacity_estimate(problem)
    evaluations = _evaluations(problem, evaluations)
    splits = [s for s in problem.splits() if s[0] > 0]
    by_p = {p: (p, d) for p, d in splits}
    seen: dict[tuple[int, int], SplitResult] = {}

    def score(split: tuple[int, int]) -> float:
        if split not in seen:
            seen[split] = evaluations.evaluate(*split, est["rate_upper_bound"])
        return seen[split].goodput_per_gpu

    if splits:
        p = min(max(1, round(est["balanced_prefill_workers"])), max(by_p))
        current = by_p[p]
        while True:
            neighbours = [by_p[q] for q in (current[0] - 1, current[0] + 1) if q in by_p]
            better = [n for n in neighbours if score(n) > score(current)]
            if not better:
                break
            current = max(better, key=score)
    if problem.allow_colocated:
        score((0, problem.gpus // problem.decode_gpus))
    results = sorted(seen.values(), key=lambda r: r.prefill_workers)
    best = max(results, key=lambda r: (r.goodput_per_gpu, -r.gpus))
    return Plan(best, tuple(results), sum(r.probes for r in results), "estimate + hill climb", est)


def plot_plan(plans: list[Plan], path: str | Path, title: str = "") -> None:
    """Goodput per GPU against the split, one line per plan (exhaustive first shows the whole curve)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for pl in plans:
        rows = sorted(pl.evaluated, key=lambda r: r.prefill_workers)
        ax.plot([r.prefill_workers for r in rows], [r.goodput_per_gpu for r in rows], marker="o", label=pl.method)
        ax.scatter([pl.best.prefill_workers], [pl.best.goodput_per_gpu], s=160, facecolors="none", edgecolors="red")
    ax.set_xlabel("prefill workers (the rest decode; 0: colocated)")
    ax.set_ylabel("goodput per GPU (requests/s)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
