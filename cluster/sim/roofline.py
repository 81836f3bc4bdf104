"""The roofline cost model: a GPU (`GPUS`: H100, H200, from the vendors' data sheets) running a model
shape (`MODELS`: 8B, 70B, mixtures of experts, ...) in bf16 or FP8; step time = max(FLOPs /
compute, bytes / HBM bandwidth) per tensor-parallel rank, plus the all-reduces and a fixed per-step
overhead (formulas written out in docs/sim.md)."""

from __future__ import annotations

from dataclasses import dataclass, field

from cluster.sim.step_shape import StepShape
from common.tp_split import check_tp_split

__all__ = ["GPUS", "MODELS", "GpuSpec", "ModelShape", "RooflineCostModel"]


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
