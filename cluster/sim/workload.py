"""What the simulated clients send: requests (token ids and output lengths) and when.

A `Workload` is a list of `Client`s. A client runs *units* (lists of requests sent one after the
other: a conversation's turns, or a single request) with at most `concurrency` units in flight,
each unit's next request sent `think_s` after the previous one finished; or, when requests carry
`arrival_s`, it sends each at that time regardless (open loop). This covers bench/serve.py's two
modes (fixed concurrency, Poisson arrivals) and multi-turn chats.

Prompts are token ids, so the simulator's prefix index and block manager hash real blocks:
requests of one shared-prefix group start with the same tokens. `WorkloadSpec` generates
workloads from distributions (Poisson or bursty arrivals; fixed, uniform or lognormal lengths;
prefix groups); `read_trace` / `write_trace` handle JSON-lines traces
(`{"arrival_s", "prompt_len", "output_len", "prefix_group", "prefix_len", "adapter"}` per line).

A request may run under a LoRA adapter (`SimRequest.adapter`, None: the base model). `AdapterMix`
draws them for a workload's requests (Zipf or uniform over N adapters, with a share left on the
base model, seeded): `WorkloadSpec.adapters` applies one as it generates, `AdapterMix.assign` to
any workload.
"""

from __future__ import annotations

import itertools
import json
import math
import random
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from common.request import DEFAULT_TENANT

__all__ = [
    "AdapterMix",
    "Client",
    "LengthDist",
    "SimRequest",
    "Workload",
    "WorkloadSpec",
    "read_trace",
    "write_trace",
]

VOCAB_LOW, VOCAB_HIGH = 1000, 40000  # token ids drawn from here, as bench/serve.py does


@dataclass(frozen=True)
class SimRequest:
    request_id: str
    prompt: tuple[int, ...]
    output_len: int
    arrival_s: float | None = None  # open loop: sent at this time; None: when its client is ready
    adapter: str | None = None  # the LoRA adapter it runs under (None: the base model)
    priority: int = 0  # lower runs first under the priority scheduling policy (EngineSettings)
    tenant: str = DEFAULT_TENANT  # whose share it counts against under that policy

    def __post_init__(self) -> None:
        if not self.prompt:
            raise ValueError(f"request {self.request_id}: empty prompt")
        if self.adapter is not None and (not isinstance(self.adapter, str) or not self.adapter):
            raise ValueError(f"request {self.request_id}: adapter must be a non-empty name or None")
        if self.output_len < 1:
            raise ValueError(f"request {self.request_id}: output_len must be >= 1, got {self.output_len}")


@dataclass(frozen=True)
class Client:
    """One load source. units: requests sent in order within a unit (a conversation), units in parallel."""

    name: str
    units: tuple[tuple[SimRequest, ...], ...]
    concurrency: int | None = None  # units in flight at most (None: all)
    think_s: float = 0.0
    start_s: float = 0.0

    @classmethod
    def closed_loop(cls, name: str, requests: list[SimRequest], concurrency: int) -> Client:
        return cls(name, tuple((r,) for r in requests), concurrency)

    @classmethod
    def open_loop(cls, name: str, requests: list[SimRequest]) -> Client:
        if any(r.arrival_s is None for r in requests):
            raise ValueError(f"open-loop client {name}: every request needs arrival_s")
        return cls(name, tuple((r,) for r in requests), None)

    @property
    def requests(self) -> list[SimRequest]:
        return [r for unit in self.units for r in unit]


@dataclass(frozen=True)
class Workload:
    clients: tuple[Client, ...]

    def __post_init__(self) -> None:
        ids = [r.request_id for c in self.clients for r in c.requests]
        if len(ids) != len(set(ids)):
            raise ValueError("request ids must be unique across the workload")

    @property
    def num_requests(self) -> int:
        return sum(len(c.requests) for c in self.clients)


@dataclass(frozen=True)
class AdapterMix:
    """Which LoRA adapter each request of a workload runs under.

    `count` adapters named `{prefix}-0` .. `{prefix}-{count-1}`; a request runs on the base model
    with probability `base_fraction`, else under adapter k with weight 1 / (k + 1)^`zipf_s`
    (`dist: zipf`) or the same weight for all (`dist: uniform`). Draws are seeded by `seed` alone,
    one per unit (a conversation keeps its adapter over its turns), on a generator of their own: a
    workload's arrivals and prompts are the same with or without a mix.
    """

    count: int = 8
    dist: str = "zipf"
    zipf_s: float = 1.0
    base_fraction: float = 0.0
    seed: int = 0
    prefix: str = "lora"

    def __post_init__(self) -> None:
        if not isinstance(self.count, int) or isinstance(self.count, bool) or self.count < 1:
            raise ValueError(f"an adapter mix has count >= 1 adapters, got {self.count!r}")
        if self.dist not in ("zipf", "uniform"):
            raise ValueError(f"adapter dist must be zipf or uniform, got {self.dist!r}")
        if not self.zipf_s >= 0:
            raise ValueError(f"zipf_s must be >= 0, got {self.zipf_s!r}")
        if not 0 <= self.base_fraction < 1:
            raise ValueError(f"base_fraction must be in [0, 1), got {self.base_fraction!r}")
        if not self.prefix or any(c.isspace() for c in self.prefix):
            raise ValueError(f"adapter prefix must be a non-empty name without spaces, got {self.prefix!r}")

    @classmethod
    def parse(cls, value: Any) -> AdapterMix:
        if isinstance(value, AdapterMix):
            return value
        if isinstance(value, int) and not isinstance(value, bool):
            return cls(count=value)
        if not isinstance(value, dict):
            raise ValueError(f"an adapter mix is a count or a mapping with count, dist, ..., got {value!r}")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"unknown adapter mix keys {unknown}; known: {sorted(known)}")
        return cls(**value)

    @property
    def names(self) -> list[str]:
        return [f"{self.prefix}-{k}" for k in range(self.count)]

    def probabilities(self) -> dict[str | None, float]:
        """Each adapter's share of requests (None: the base model's)."""
        weights = [1.0 if self.dist == "uniform" else 1.0 / (k + 1) ** self.zipf_s for k in range(self.count)]
        total = sum(weights)
        out: dict[str | None, float] = {None: self.base_fraction} if self.base_fraction else {}
        for name, w in zip(self.names, weights):
            out[name] = (1 - self.base_fraction) * w / total
        return out

    def draw(self, rng: random.Random) -> str | None:
        """One request's adapter (None: the base model)."""
        if self.base_fraction and rng.random() < self.base_fraction:
            return None
        names = self.names
        if self.dist == "uniform":
            return names[rng.randrange(self.count)]
        return rng.choices(names, [1.0 / (k + 1) ** self.zipf_s for k in range(self.count)])[0]

    def assign(self, workload: Workload) -> Workload:
        """The workload with each unit's requests under an adapter drawn from this mix."""
        rng = random.Random(self.seed)
        clients = []
        for client in workload.clients:
            units = []
            for unit in client.units:
                adapter = self.draw(rng)
                units.append(tuple(replace(r, adapter=adapter) for r in unit))
            clients.append(replace(client, units=tuple(units)))
        return Workload(tuple(clients))


def _tokens(rng: random.Random, n: int) -> list[int]:
    """n draws of rng.randrange(VOCAB_LOW, VOCAB_HIGH), the very same ones: randrange takes
    getrandbits(k) until one falls below the span; here the loop runs in C, not one Python call
    per token (prompts were a tenth of a planner's time)."""
    span = VOCAB_HIGH - VOCAB_LOW
    draws = map(rng.getrandbits, itertools.repeat(span.bit_length()))
    return [VOCAB_LOW + r for r in itertools.islice(filter(span.__gt__, draws), n)]


@dataclass(frozen=True)
class LengthDist:
    """fixed (value), uniform (low..high inclusive) or lognormal (mean, sigma of the log), clipped to [low, high]."""

    dist: str = "fixed"
    value: int = 256
    low: int = 1
    high: int = 1 << 20
    mean: float = 0.0
    sigma: float = 0.0

    def __post_init__(self) -> None:
        if self.dist not in ("fixed", "uniform", "lognormal"):
            raise ValueError(f"length dist must be fixed, uniform or lognormal, got {self.dist!r}")
        if not 1 <= self.low <= self.high:
            raise ValueError(f"length bounds must satisfy 1 <= low <= high, got {self.low}, {self.high}")

    def sample(self, rng: random.Random) -> int:
        if self.dist == "fixed":
            return self.value
        if self.dist == "uniform":
            return rng.randint(self.low, self.high)
        return min(self.high, max(self.low, int(round(rng.lognormvariate(math.log(self.mean), self.sigma)))))

    def expected(self) -> float:
        if self.dist == "fixed":
            return float(self.value)
        if self.dist == "uniform":
            return (self.low + self.high) / 2
        return min(self.high, max(self.low, self.mean * math.exp(self.sigma**2 / 2)))

    @classmethod
    def parse(cls, value: Any) -> LengthDist:
        if isinstance(value, int):
            return cls("fixed", value)
        if not isinstance(value, dict):
            raise ValueError(f"a length is an integer or a mapping with dist, got {value!r}")
        return cls(**value)


@dataclass(frozen=True)
class WorkloadSpec:
    """A generator of open-loop workloads: arrivals at `rate` per second for `duration_s`.

    arrival: poisson, or bursty (gamma inter-arrival times with coefficient of variation `cv`);
    a fraction `prefix_fraction` of requests starts with one of `prefix_groups` shared prefixes
    of `prefix_len` tokens (a system prompt), chosen by a Zipf-like weight 1/(rank+1);
    `adapters` (an `AdapterMix`, or its mapping in YAML) puts requests under LoRA adapters.
    """

    rate: float = 10.0
    duration_s: float = 60.0
    arrival: str = "poisson"
    cv: float = 1.0
    prompt_len: LengthDist = field(default_factory=lambda: LengthDist("fixed", 512))
    output_len: LengthDist = field(default_factory=lambda: LengthDist("fixed", 128))
    prefix_groups: int = 0
    prefix_len: int = 0
    prefix_fraction: float = 0.0
    seed: int = 0
    name: str = "workload"
    # A time-varying rate: (time s, multiple of `rate`) points, linear in between, flat after the
    # last (a load step, a diurnal curve). Arrivals then follow it by thinning.
    rate_points: tuple[tuple[float, float], ...] = ()
    adapters: AdapterMix | None = None  # None: every request on the base model

    def __post_init__(self) -> None:
        if self.adapters is not None:
            object.__setattr__(self, "adapters", AdapterMix.parse(self.adapters))
        object.__setattr__(self, "rate_points", tuple((float(t), float(m)) for t, m in self.rate_points))
        if any(m < 0 for _, m in self.rate_points) or list(self.rate_points) != sorted(self.rate_points):
            raise ValueError("rate_points must be (time, multiple >= 0) pairs in time order")
        if not self.rate > 0 or not self.duration_s > 0:
            raise ValueError(f"rate and duration_s must be > 0, got {self.rate}, {self.duration_s}")
        if self.arrival not in ("poisson", "bursty"):
            raise ValueError(f"arrival must be poisson or bursty, got {self.arrival!r}")
        if not 0 <= self.prefix_fraction <= 1:
            raise ValueError(f"prefix_fraction must be in [0, 1], got {self.prefix_fraction}")

    @classmethod
    def from_dict(cls, data: dict) -> WorkloadSpec:
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown workload keys {unknown}; known: {sorted(known)}")
        data = dict(data)
        for key in ("prompt_len", "output_len"):
            if key in data:
                data[key] = LengthDist.parse(data[key])
        return cls(**data)

    @classmethod
    def load(cls, path: str | Path) -> WorkloadSpec:
        try:
            data = yaml.safe_load(Path(path).read_text())
        except (OSError, yaml.YAMLError) as exc:
            raise ValueError(f"cannot read workload {str(path)!r}: {exc}") from None
        if not isinstance(data, dict):
            raise ValueError(f"workload {str(path)!r} must be a mapping")
        return cls.from_dict(data)

    def to_dict(self) -> dict:
        return asdict(self)

    def scaled(self, factor: float) -> WorkloadSpec:
        return replace(self, rate=self.rate * factor)

    def rate_at(self, t: float) -> float:
        pts = self.rate_points
        if not pts:
            return self.rate
        if t <= pts[0][0]:
            return self.rate * pts[0][1]
        for (t0, m0), (t1, m1) in zip(pts, pts[1:]):
            if t <= t1:
                return self.rate * (m0 + (m1 - m0) * (t - t0) / (t1 - t0) if t1 > t0 else m1)
        return self.rate * pts[-1][1]

    def mean_prompt_len(self) -> float:
        return self.prompt_len.expected() + (self.prefix_len * self.prefix_fraction if self.prefix_groups else 0)

    def generate(self) -> Workload:
        rng = random.Random(self.seed)
        prefixes = [
            _tokens(random.Random(hash((self.seed, "prefix", g)) & 0xFFFFFFFF), self.prefix_len)
            for g in range(self.prefix_groups)
        ]
        weights = [1.0 / (g + 1) for g in range(self.prefix_groups)]
        t = 0.0
        requests: list[SimRequest] = []
        shape = 1.0 / (self.cv**2) if self.arrival == "bursty" else 1.0
        peak = self.rate * max([m for _, m in self.rate_points] or [1.0])
        while True:
            t += rng.gammavariate(shape, 1.0 / (peak * shape)) if self.arrival == "bursty" else rng.expovariate(peak)
            if t >= self.duration_s:
                break
            if self.rate_points and rng.random() * peak > self.rate_at(t):
                continue  # thinning: keep an arrival with probability rate(t) / peak
            prefix: list[int] = []
            if prefixes and rng.random() < self.prefix_fraction:
                prefix = prefixes[rng.choices(range(len(prefixes)), weights)[0]]
            prompt = prefix + _tokens(rng, self.prompt_len.sample(rng))
            requests.append(SimRequest(f"{self.name}-{len(requests)}", tuple(prompt), self.output_len.sample(rng), t))
        workload = Workload((Client.open_loop(self.name, requests),))
        return workload if self.adapters is None else self.adapters.assign(workload)


def write_trace(path: str | Path, requests: list[SimRequest]) -> None:
    """One JSON object per request: arrival_s, prompt (token ids), output_len, and adapter if any."""
    with open(path, "w") as f:
        for r in requests:
            row: dict[str, Any] = {
                "request_id": r.request_id,
                "arrival_s": r.arrival_s,
                "prompt": list(r.prompt),
                "output_len": r.output_len,
            }
            if r.adapter is not None:
                row["adapter"] = r.adapter
            f.write(json.dumps(row) + "\n")


def read_trace(path: str | Path, seed: int = 0, name: str = "trace") -> Workload:
    """An open-loop workload from a JSON-lines trace. Each line has arrival_s and output_len, and either
    prompt (token ids) or prompt_len with an optional prefix_group / prefix_len (shared-prefix groups);
    optionally adapter (a LoRA adapter's name)."""
    rng = random.Random(seed)
    prefixes: dict[Any, list[int]] = {}
    requests: list[SimRequest] = []
    for lineno, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            if "prompt" in row:
                prompt = [int(t) for t in row["prompt"]]
            else:
                group, plen = row.get("prefix_group"), int(row.get("prefix_len", 0))
                prefix = []
                if group is not None and plen:
                    prefix = prefixes.setdefault(group, _tokens(random.Random(f"{seed}-{group}"), plen))[:plen]
                prompt = prefix + _tokens(rng, int(row["prompt_len"]) - len(prefix))
            requests.append(
                SimRequest(
                    str(row.get("request_id", f"{name}-{len(requests)}")),
                    tuple(prompt),
                    int(row["output_len"]),
                    float(row["arrival_s"]),
                    row.get("adapter"),
                )
            )
        except (KeyError, TypeError, ValueError, json.JSONDecodeError) as exc:
            raise ValueError(f"{path}:{lineno}: bad trace line ({exc})") from None
    if not requests:
        raise ValueError(f"trace {str(path)!r} has no requests")
    return Workload((Client.open_loop(name, requests),))
