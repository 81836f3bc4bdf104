"""Worker cost models: how long one engine step takes, how many KV tokens fit, how fast KV moves.

A step is summarised by its `StepShape` (what the real scheduler put in the batch). Two models
turn a shape into seconds (formulas written out in docs/sim.md):

- `FittedCostModel`: coefficients fitted by `bench/profile_costs.py` from real engine steps on
  this machine (least squares over measured steps, with a floor below which a step costs as much
  as `knee` tokens: streaming the weights once);
- `RooflineCostModel`: a GPU (H100, H200) running a model shape (8B, 70B, ...) in bf16 or FP8,
  step time = max(FLOPs / compute, bytes / HBM bandwidth) per tensor-parallel rank, plus the
  all-reduces and a fixed per-step overhead.

`LinkModel` gives KV transfer time from bytes: latency + bytes / bandwidth (NVLink, InfiniBand,
Ethernet presets, or this machine's shared memory as measured by bench/kv_transfer.py).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np

from common.stats import percentile
from common.tp_split import check_tp_split

__all__ = [
    "GPUS",
    "LINKS",
    "MODELS",
    "CostModel",
    "FittedCostModel",
    "GpuSpec",
    "LinkModel",
    "ModelShape",
    "RooflineCostModel",
    "ServingOverheads",
    "StepShape",
    "TensorParallelCost",
    "fit_cost_model",
    "load_cost_model",
]


@dataclass(frozen=True)
class StepShape:
    """One engine step as the scheduler built it.

    tokens: tokens run through the model (prefill chunk tokens + one per decoding sequence);
    sampled: rows that produce a token (lm_head + sampler run for these only);
    decode_seqs / decode_context: sequences decoding one token and the sum of their contexts
      (the K/V tokens their attention reads);
    prefill_tokens / prefill_pairs: prefill chunk tokens and their causal attention pairs
      (sum over chunks of n * cached_or_computed_before + n * (n + 1) / 2);
    prefill_context: K/V tokens the prefill chunks' attention reads (sum of their contexts).
    """

    tokens: int = 0
    sampled: int = 0
    decode_seqs: int = 0
    decode_context: int = 0
    prefill_tokens: int = 0
    prefill_pairs: int = 0
    prefill_context: int = 0

    @classmethod
    def of(cls, chunks: list[tuple[int, int, bool]]) -> StepShape:
        """From (tokens computed before, tokens this step, sampled) per scheduled chunk."""
        tokens = sampled = dseqs = dctx = ptok = ppairs = pctx = 0
        for before, n, sample in chunks:
            tokens += n
            sampled += sample
            if n == 1:
                dseqs += 1
                dctx += before + 1
            else:
                ptok += n
                ppairs += n * before + n * (n + 1) // 2
                pctx += before + n
        return cls(tokens, sampled, dseqs, dctx, ptok, ppairs, pctx)


class CostModel(Protocol):
    """What the simulator needs from a worker model."""

    def step_time(self, shape: StepShape) -> float:
        """Seconds one engine step of this shape takes."""
        ...

    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V for one token over all layers (what a KV transfer moves per token)."""
        ...

    def kv_capacity_tokens(self) -> int:
        """KV tokens one worker's cache holds."""
        ...

    def gpus_per_worker(self) -> int:
        """Accelerators (or CPU slots) one worker occupies: the unit the planner spends."""
        ...


@dataclass(frozen=True)
class ServingOverheads:
    """Times outside the engine steps, measured on the serving path (seconds).

    router_s: request arrival to routing done (HTTP, tokenisation, decision);
    rpc_s: one router -> worker call (Ray), each way together;
    stream_s: a worker's output to the client (long-poll, SSE);
    heartbeat_s: how often the router refreshes worker stats and KV events.
    """

    router_s: float = 0.002
    rpc_s: float = 0.001
    stream_s: float = 0.0015
    heartbeat_s: float = 2.0

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if not value >= 0:
                raise ValueError(f"overhead {name} must be >= 0 seconds, got {value!r}")


@dataclass(frozen=True)
class LinkModel:
    """KV transfer between a prefill and a decode worker: latency + bytes / bandwidth."""

    name: str
    bandwidth_bytes_s: float
    latency_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.bandwidth_bytes_s > 0 or self.latency_s < 0:
            raise ValueError(f"link {self.name}: bandwidth must be > 0 and latency >= 0")

    def transfer_time(self, nbytes: int) -> float:
        return self.latency_s + nbytes / self.bandwidth_bytes_s if nbytes > 0 else 0.0


# Per direction, per GPU; effective rather than line rate where a transfer cannot reach it.
LINKS: dict[str, LinkModel] = {
    "nvlink": LinkModel("nvlink", 450e9 * 0.8, 10e-6),  # NVLink 4: 900 GB/s both ways
    "infiniband": LinkModel("infiniband", 50e9 * 0.8, 5e-6),  # one 400 Gb/s NDR NIC per GPU
    "ethernet": LinkModel("ethernet", 12.5e9 * 0.7, 30e-6),  # 100 Gb/s, TCP
    "cpu-shm": LinkModel("cpu-shm", 0.9e9, 60e-6),  # bench/kv_transfer.py on this machine
}


class FittedCostModel:
    """step = c0 + c_token * max(tokens, knee) + c_sampled * sampled + c_decode_ctx * decode_context
    + c_prefill_pairs * prefill_pairs + c_decode_seq * decode_seqs, coefficients from profiling."""

    COEFFICIENTS = ("c0", "c_token", "c_sampled", "c_decode_ctx", "c_prefill_pairs", "c_decode_seq")

    def __init__(
        self,
        coefficients: dict[str, float],
        knee: float,
        kv_bytes_per_token: int,
        kv_capacity_tokens: int,
        gpus_per_worker: int = 1,
    ) -> None:
        missing = [c for c in self.COEFFICIENTS if c not in coefficients]
        if missing:
            raise ValueError(f"fitted cost model lacks coefficients {missing}")
        if knee < 1 or kv_bytes_per_token < 1 or kv_capacity_tokens < 1:
            raise ValueError("knee, kv_bytes_per_token and kv_capacity_tokens must be >= 1")
        self.coefficients = {k: float(coefficients[k]) for k in self.COEFFICIENTS}
        self.knee = float(knee)
        self._kv_bytes = int(kv_bytes_per_token)
        self._kv_tokens = int(kv_capacity_tokens)
        self._gpus = gpus_per_worker
        c = self.coefficients
        self._c = (c["c0"], c["c_token"], c["c_sampled"], c["c_decode_ctx"], c["c_prefill_pairs"], c["c_decode_seq"])

    @staticmethod
    def features(shape: StepShape, knee: float) -> list[float]:
        return [
            1.0,
            max(float(shape.tokens), knee),
            float(shape.sampled),
            float(shape.decode_context),
            float(shape.prefill_pairs),
            float(shape.decode_seqs),
        ]

    def step_time(self, shape: StepShape) -> float:
        c0, ct, cs, cd, cp, cq = self._c
        return (
            c0
            + ct * max(shape.tokens, self.knee)
            + cs * shape.sampled
            + cd * shape.decode_context
            + cp * shape.prefill_pairs
            + cq * shape.decode_seqs
        )

    def kv_bytes_per_token(self) -> int:
        return self._kv_bytes

    def kv_capacity_tokens(self) -> int:
        return self._kv_tokens

    def gpus_per_worker(self) -> int:
        return self._gpus

    def to_dict(self) -> dict:
        return {
            "kind": "fitted",
            "coefficients": self.coefficients,
            "knee": self.knee,
            "kv_bytes_per_token": self._kv_bytes,
            "kv_capacity_tokens": self._kv_tokens,
            "gpus_per_worker": self._gpus,
        }


@dataclass(frozen=True)
class GpuSpec:
    """Dense peak rates (no sparsity) from the vendors' data sheets, and memory."""

    name: str
    bf16_flops: float
    fp8_flops: float
    hbm_bytes_s: float
    hbm_bytes: float
    nvlink_bytes_s: float  # per direction, for tensor-parallel all-reduces


GPUS: dict[str, GpuSpec] = {
    # H100 SXM5: 989 TFLOP/s bf16, 1,979 TFLOP/s FP8 (dense), 3.35 TB/s HBM3, 80 GB.
    "H100": GpuSpec("H100", 989e12, 1979e12, 3.35e12, 80e9, 450e9),
    # H200 SXM: the H100's compute with 4.8 TB/s HBM3e and 141 GB.
    "H200": GpuSpec("H200", 989e12, 1979e12, 4.8e12, 141e9, 450e9),
}


@dataclass(frozen=True)
class ModelShape:
    """A Llama-family decoder: what its FLOPs and bytes depend on. With `experts` > 0 a mixture of
    experts (Mixtral, Qwen3-MoE): every layer's MLP is `experts` gated MLPs of `expert_intermediate`,
    of which each token runs `experts_per_tok`, chosen by a router (hidden x experts)."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int  # the dense MLP's (0 for an MoE)
    vocab: int
    experts: int = 0
    experts_per_tok: int = 0
    expert_intermediate: int = 0

    @property
    def _attention_params(self) -> int:
        return self.hidden * self.head_dim * (self.heads + 2 * self.kv_heads) + self.heads * self.head_dim * self.hidden

    @property
    def _expert_params(self) -> int:
        return 3 * self.hidden * self.expert_intermediate

    @property
    def layer_params(self) -> int:
        """Weights in the transformer blocks (attention projections + gated MLP, or router + all experts):
        what the weights take in memory."""
        if not self.experts:
            return self.layers * (self._attention_params + 3 * self.hidden * self.intermediate)
        return self.layers * (self._attention_params + self.hidden * self.experts + self.experts * self._expert_params)

    @property
    def active_layer_params(self) -> int:
        """Weights one token multiplies (FLOPs per token = 2 x this): for an MoE its k experts only."""
        if not self.experts:
            return self.layer_params
        return self.layers * (
            self._attention_params + self.hidden * self.experts + self.experts_per_tok * self._expert_params
        )

    def layer_params_read(self, tokens: int) -> float:
        """Weights a step of `tokens` tokens streams from memory: all of a dense model; for an MoE the
        attention and routers plus each expert some token was routed to, E * (1 - (1 - k/E)^tokens)
        of them per layer in expectation under uniform routing."""
        if not self.experts:
            return float(self.layer_params)
        touched = self.experts * (1.0 - (1.0 - self.experts_per_tok / self.experts) ** max(tokens, 0))
        return self.layers * (self._attention_params + self.hidden * self.experts + touched * self._expert_params)

    @property
    def lm_head_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def sharded_weight_fraction(self) -> float:
        """The share of the weights a decode step streams that tensor parallelism splits (the
        layers'; the embedding and lm_head are replicated): of a one-sequence decode step's time too,
        where streaming the weights is the step."""
        return self.layer_params_read(1) / (self.layer_params_read(1) + self.lm_head_params)


MODELS: dict[str, ModelShape] = {
    "llama-8b": ModelShape("llama-8b", 32, 4096, 32, 8, 128, 14336, 128256),  # Llama 3.1 8B
    "llama-70b": ModelShape("llama-70b", 80, 8192, 64, 8, 128, 28672, 128256),  # Llama 3.1 70B
    "smollm2-135m": ModelShape("smollm2-135m", 30, 576, 9, 3, 64, 1536, 49152),
    # Mixtral 8x7B: 46.7B parameters, 12.9B active per token (8 experts, top-2).
    "mixtral-8x7b": ModelShape("mixtral-8x7b", 32, 4096, 32, 8, 128, 0, 32000, 8, 2, 14336),
    # Qwen3-30B-A3B: 30.5B parameters, 3.3B active (128 experts, top-8).
    "qwen3-30b-a3b": ModelShape("qwen3-30b-a3b", 48, 2048, 32, 4, 128, 0, 151936, 128, 8, 768),
}


@dataclass(frozen=True)
class RooflineCostModel:
    """A step on `tp` GPUs: max(FLOPs / (peak * compute_eff), bytes / (HBM * bandwidth_eff)) per rank,
    plus 2 all-reduces per layer when tp > 1, plus step_overhead_s (launches, scheduling, sampling)."""

    gpu: GpuSpec
    model: ModelShape
    weight_dtype: str = "fp8"  # fp8 | bf16
    kv_dtype: str = "fp8"
    tp: int = 1
    compute_eff: float = 0.6
    bandwidth_eff: float = 0.8
    memory_util: float = 0.9  # of HBM for weights + KV (the rest: activations, CUDA graphs)
    step_overhead_s: float = 0.0015
    allreduce_latency_s: float = 8e-6
    kv_bytes_override: int | None = field(default=None)

    def __post_init__(self) -> None:
        for name in ("weight_dtype", "kv_dtype"):
            if getattr(self, name) not in ("fp8", "bf16"):
                raise ValueError(f"{name} must be fp8 or bf16, got {getattr(self, name)!r}")
        if self.tp not in (1, 2, 4, 8):
            raise ValueError(f"tensor-parallel size must be 1, 2, 4 or 8, got {self.tp}")
        m = self.model
        try:  # a size the engine cannot shard this model at is no plan
            check_tp_split(
                self.tp, m.heads, m.kv_heads, m.intermediate, m.experts, m.expert_intermediate, dense_mlps=not m.experts
            )
        except ValueError as exc:
            raise ValueError(f"{m.name} at TP {self.tp}: {exc}") from None
        if self.kv_capacity_tokens() < 1:
            raise ValueError(f"{self.model.name} in {self.weight_dtype} does not fit on {self.tp} x {self.gpu.name}")

    @property
    def weight_bytes(self) -> float:
        per = 1 if self.weight_dtype == "fp8" else 2
        return (self.model.layer_params + self.model.lm_head_params) * per

    @property
    def peak_flops(self) -> float:
        return self.gpu.fp8_flops if self.weight_dtype == "fp8" else self.gpu.bf16_flops

    def kv_bytes_per_token(self) -> int:
        if self.kv_bytes_override is not None:
            return self.kv_bytes_override
        m = self.model
        return 2 * m.layers * m.kv_heads * m.head_dim * (1 if self.kv_dtype == "fp8" else 2)

    def kv_capacity_tokens(self) -> int:
        free = self.tp * self.gpu.hbm_bytes * self.memory_util - self.weight_bytes
        return int(free // self.kv_bytes_per_token())

    def gpus_per_worker(self) -> int:
        return self.tp

    def step_time(self, shape: StepShape) -> float:
        m = self.model
        attn_pairs = shape.prefill_pairs + shape.decode_context
        flops = (
            2 * m.active_layer_params * shape.tokens
            + 2 * m.lm_head_params * shape.sampled
            + 4 * m.layers * m.heads * m.head_dim * attn_pairs
        )
        kv = self.kv_bytes_per_token()
        per = 1 if self.weight_dtype == "fp8" else 2
        weights_read = (m.layer_params_read(shape.tokens) + m.lm_head_params) * per  # = weight_bytes when dense
        nbytes = weights_read + kv * (shape.decode_context + shape.prefill_context + shape.tokens)
        t = max(flops / (self.peak_flops * self.compute_eff), nbytes / (self.gpu.hbm_bytes_s * self.bandwidth_eff))
        t /= self.tp
        if self.tp > 1:  # ring all-reduce of the bf16 activations, twice per layer
            volume = 2 * shape.tokens * m.hidden * 2 * (self.tp - 1) / self.tp
            t += 2 * m.layers * (self.allreduce_latency_s + volume / self.gpu.nvlink_bytes_s)
        return t + self.step_overhead_s if shape.tokens else 0.0

    def to_dict(self) -> dict:
        return {
            "kind": "roofline",
            "gpu": self.gpu.name,
            "model": self.model.name,
            "weight_dtype": self.weight_dtype,
            "kv_dtype": self.kv_dtype,
            "tp": self.tp,
            "compute_eff": self.compute_eff,
            "bandwidth_eff": self.bandwidth_eff,
            "memory_util": self.memory_util,
            "step_overhead_s": self.step_overhead_s,
        }


@dataclass(frozen=True)
class TensorParallelCost:
    """A worker of `tp` ranks on hosts measured at one rank (`base`, e.g. a FittedCostModel of this
    CPU): rank 0's step is base's with the sharded layers' share of it divided by tp (the embedding,
    lm_head and sampling stay whole on rank 0), plus 2 all-reduces per layer and the step's
    broadcast, both as measured on the host (bench/tp.py times them between rank processes, an
    all-reduce between compute of one layer's share, since a rank that is still computing is what
    the other waits for)."""

    base: CostModel
    tp: int
    layers: int
    sharded_fraction: float  # of base's step in the sharded layers (ModelShape.sharded_weight_fraction)
    allreduce_s: float
    broadcast_s: float

    def __post_init__(self) -> None:
        if self.tp < 1 or self.layers < 1 or not 0 <= self.sharded_fraction <= 1:
            raise ValueError(f"need tp >= 1, layers >= 1 and 0 <= sharded_fraction <= 1, got {self}")

    def step_time(self, shape: StepShape) -> float:
        base = self.base.step_time(shape)
        if self.tp == 1:
            return base
        share = self.sharded_fraction / self.tp + 1.0 - self.sharded_fraction
        return base * share + 2 * self.layers * self.allreduce_s + self.broadcast_s

    def kv_bytes_per_token(self) -> int:
        return self.base.kv_bytes_per_token()

    def kv_capacity_tokens(self) -> int:
        return self.base.kv_capacity_tokens()

    def gpus_per_worker(self) -> int:
        return self.base.gpus_per_worker() * self.tp


def cost_model_from_dict(spec: dict) -> CostModel:
    """A cost model from its JSON form (a profile written by bench/profile_costs.py, or a roofline spec)."""
    kind = spec.get("kind")
    if kind == "fitted":
        return FittedCostModel(
            spec["coefficients"],
            spec["knee"],
            spec["kv_bytes_per_token"],
            spec["kv_capacity_tokens"],
            spec.get("gpus_per_worker", 1),
        )
    if kind == "roofline":
        gpu, model = spec.get("gpu", "H200"), spec.get("model", "llama-8b")
        if gpu not in GPUS:
            raise ValueError(f"unknown gpu {gpu!r}; known: {sorted(GPUS)}")
        if model not in MODELS:
            raise ValueError(f"unknown model {model!r}; known: {sorted(MODELS)}")
        extra = {
            k: spec[k]
            for k in (
                "weight_dtype",
                "kv_dtype",
                "tp",
                "compute_eff",
                "bandwidth_eff",
                "memory_util",
                "step_overhead_s",
            )
            if k in spec
        }
        return RooflineCostModel(GPUS[gpu], MODELS[model], **extra)
    raise ValueError(f"cost model kind must be 'fitted' or 'roofline', got {kind!r}")


def load_cost_model(path: str | Path) -> tuple[CostModel, ServingOverheads, LinkModel]:
    """A model profile file: {"cost_model": {...}, "overheads": {...}, "link": "cpu-shm" | {...}}."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read model profile {str(path)!r}: {exc}") from None
    spec = data.get("cost_model", data)
    overheads = ServingOverheads(**data.get("overheads", {}))
    link = data.get("link", "nvlink")
    if isinstance(link, str):
        if link not in LINKS:
            raise ValueError(f"unknown link {link!r}; known: {sorted(LINKS)}")
        link = LINKS[link]
    else:
        link = LinkModel(**link)
    return cost_model_from_dict(spec), overheads, link


def fit_cost_model(samples: list[dict]) -> tuple[dict[str, float], float, dict]:
    """Least squares on relative error (each step weighs the same whatever its length), coefficients >= 0."""
    names = FittedCostModel.COEFFICIENTS
    t = np.array([s["seconds"] for s in samples])
    shapes = [StepShape(**{k: s[k] for k in StepShape.__dataclass_fields__}) for s in samples]
    best = None
    for knee in (1, 2, 4, 6, 8, 12, 16, 24, 32, 48, 64):
        x = np.array([FittedCostModel.features(sh, knee) for sh in shapes]) / t[:, None]
        active = list(range(len(names)))
        while True:
            coef, *_ = np.linalg.lstsq(x[:, active], np.ones(len(t)), rcond=None)
            negative = [a for a, c in zip(active, coef) if c < 0]
            if not negative:
                break
            active.remove(min(negative, key=lambda a: coef[active.index(a)]))
        full = np.zeros(len(names))
        full[active] = coef
        pred = np.array([FittedCostModel.features(sh, knee) for sh in shapes]) @ full
        err = float(np.sqrt(np.mean(((pred - t) / t) ** 2)))
        if best is None or err < best[2]:
            best = (full, knee, err, pred)
    full, knee, err, pred = best
    rel = np.abs(pred - t) / t
    quality = {
        "rms_relative_error": err,
        "median_relative_error": float(np.median(rel)),
        "p90_relative_error": percentile(rel.tolist(), 90),
        "samples": len(samples),
    }
    return dict(zip(names, map(float, full))), float(knee), quality
