"""Engine configuration: one dataclass, checked on construction; and `WorkerConfig`, what the
launcher hands each worker actor (torch-free: the driver builds it without loading the engine).

Each user-facing field carries its help text (and allowed values) in its dataclass metadata;
`cluster.config` builds the `baton serve` flags, the YAML reader and the JSON Schema from them.
Fields marked `internal` are set by code (the launcher, calibration), never by users.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from common.lora import LoRALimits, LoRAModuleSpec, parse_lora_modules
from common.roles import ROLES, Role
from common.tenants import parse_tenant_weights
from workers.quantization.registry import check_quantization, quantization_help, quantization_names

DTYPES = ("float32", "float16", "bfloat16")
KV_CACHE_DTYPES = ("auto", "fp8")
QUANTIZATIONS = (None, *quantization_names())  # the registered methods (workers/quantization/registry.py)
KERNEL_BACKENDS = ("auto", "triton", "native", "reference")
FLOAT32_PROMPT_MATMULS = ("bf16x3", "ieee")
SCHEDULING_POLICIES = ("fcfs", "priority")  # workers.engine.scheduling_policy's
CPU_KV_CACHE_MEMORY = 1 << 30  # kv_cache_memory's default on the CPU


SPECULATIVE_METHODS = ("ngram", "suffix", "draft_model")
# vLLM's methods that Baton will take later: refused with "not yet supported" rather than "unknown".
SPECULATIVE_METHODS_LATER = ("eagle", "eagle3", "medusa", "mlp_speculator", "mtp")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding, from `--speculative-config` JSON with vLLM's keys.

    ngram (prompt lookup): the last n tokens of a sequence (n from prompt_lookup_max down to
    prompt_lookup_min) are looked up earlier in its prompt and output; the tokens that followed the
    latest match are the drafts (at most num_speculative_tokens).
    suffix (workers.speculative.suffix_decoding): the longest match of the sequence's last tokens in its own
    tokens and in this worker's recent outputs, continued along the most frequent path while its
    estimated probability stays >= suffix_decoding_min_token_prob, for at most
    suffix_decoding_max_spec_factor x the match's length (and num_speculative_tokens) drafts.
    draft_model (workers.speculative.draft_model): `model`, a folder of a smaller model with the target's
    tokenizer, drafts greedily; `quantization` "fp8" quantizes its linear layers, `dtype` runs it in
    another dtype than the target (a cheaper copy of the target itself is a draft too).
    disable_by_batch_size: no drafts in a step with more decoding sequences than this (vLLM's key;
    without it, workers.speculative.draft_budget already drafts less as the batch grows, down to none)."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 3
    disable_by_batch_size: int | None = None
    # suffix (vLLM's keys); the cached outputs are a Python index here, so fewer than vLLM's 10,000 by default.
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 1000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    # draft_model (vLLM's keys): the draft's folder, its quantization, its tensor-parallel size (only 1: the
    # draft runs whole beside the target's rank 0)
    draft_tensor_parallel_size: int | None = None
    model: str | None = None
    quantization: str | None = None
    dtype: str | None = None  # the draft's weights and activations (default: the target's); not a vLLM key

    def __post_init__(self) -> None:
        if self.method in SPECULATIVE_METHODS_LATER:
            raise ValueError(
                f"speculative_config.method {self.method!r} is not yet supported; "
                f"supported: {', '.join(SPECULATIVE_METHODS)}"
            )
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative_config.method must be one of {', '.join(SPECULATIVE_METHODS)}, got {self.method!r}"
            )
        for name in (
            "num_speculative_tokens",
            "prompt_lookup_min",
            "prompt_lookup_max",
            "suffix_decoding_max_tree_depth",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"speculative_config.{name} must be a positive integer, got {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"speculative_config.prompt_lookup_min ({self.prompt_lookup_min}) must not exceed "
                f"prompt_lookup_max ({self.prompt_lookup_max})"
            )
        if (
            not isinstance(self.suffix_decoding_max_cached_requests, int)
            or isinstance(self.suffix_decoding_max_cached_requests, bool)
            or self.suffix_decoding_max_cached_requests < 0
        ):
            raise ValueError(
                f"speculative_config.suffix_decoding_max_cached_requests must be an integer >= 0, "
                f"got {self.suffix_decoding_max_cached_requests!r}"
            )
        factor = self.suffix_decoding_max_spec_factor
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor < float("inf"):
            raise ValueError(f"speculative_config.suffix_decoding_max_spec_factor must be a number > 0, got {factor!r}")
        prob = self.suffix_decoding_min_token_prob
        if isinstance(prob, bool) or not isinstance(prob, (int, float)) or not 0 <= prob <= 1:
            raise ValueError(f"speculative_config.suffix_decoding_min_token_prob must be in [0, 1], got {prob!r}")
        if self.method == "draft_model" and not isinstance(self.model, str):
            raise ValueError("speculative_config.model must name the draft model's folder for method 'draft_model'")
        if self.method != "draft_model" and self.model is not None:
            raise ValueError(f"speculative_config.model is for method 'draft_model', not {self.method!r}")
        if self.dtype not in (None, *DTYPES):
            raise ValueError(f"speculative_config.dtype must be one of {', '.join(DTYPES)} or null, got {self.dtype!r}")
        if self.method != "draft_model" and (self.dtype, self.quantization) != (None, None):
            raise ValueError(
                f"speculative_config.dtype and quantization are for method 'draft_model', not {self.method!r}"
            )
        check_quantization(self.quantization, "speculative_config.quantization")
        if self.draft_tensor_parallel_size not in (None, 1):
            raise ValueError(
                f"speculative_config.draft_tensor_parallel_size {self.draft_tensor_parallel_size!r} is not "
                "yet supported: the draft runs whole on the decode worker (1)"
            )
        size = self.disable_by_batch_size
        if size is not None and (not isinstance(size, int) or isinstance(size, bool) or size < 1):
            raise ValueError(
                f"speculative_config.disable_by_batch_size must be a positive integer or null, got {size!r}"
            )

    @classmethod
    def from_json(cls, text: str) -> SpeculativeConfig:
        """Parse `--speculative-config`; ValueError naming the key for bad JSON, keys or values."""
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"speculative_config is not valid JSON ({exc}): {text!r}") from None
        if not isinstance(raw, dict):
            raise ValueError(f"speculative_config must be a JSON object of vLLM's keys, got {text!r}")
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"speculative_config has unknown key {unknown[0]!r}; known: {', '.join(sorted(known))}")
        for key in ("method", "num_speculative_tokens"):
            if key not in raw:
                raise ValueError(f"speculative_config needs the key {key!r}")
        return cls(**raw)


@dataclass
class EngineConfig:
    """Knobs named as in vLLM where the same knob exists."""

    block_size: int = field(default=16, metadata={"help": "tokens per KV block (a power of two)"})
    kv_cache_memory: int | None = field(
        default=None,
        metadata={
            "help": "KV cache per worker, in bytes or with a unit such as 512MiB or 2GB (default: 1GiB on the CPU; "
            "on a GPU, what --gpu-memory-utilization leaves)",
            "size": True,
            "example": "16GiB",
        },
    )
    gpu_memory_utilization: float = field(
        default=0.9,
        metadata={
            "help": "on a GPU without --kv-cache-memory: the fraction of the device's memory the worker uses; the KV "
            "cache gets it less the weights and the profiled activation peak (vLLM's flag)",
            "example": 0.8,
        },
    )
    num_kv_blocks: int | None = field(default=None, metadata={"internal": True})  # wins over kv_cache_memory
    max_num_seqs: int = field(default=64, metadata={"help": "sequences in one worker's batch at most"})
    # Serving wants prompts to finish one at a time so decoding starts sooner; offline benchmarks
    # that want whole batches of prompts per step pass a larger budget.
    max_num_batched_tokens: int = field(
        default=256, metadata={"help": "tokens per engine step, shared by decodes and prefill chunks (chunked prefill)"}
    )
    max_model_len: int | None = field(
        default=None,
        metadata={"help": "context length limit (default: the model's, capped by what the KV cache holds)"},
    )
    enable_prefix_caching: bool = field(
        default=True, metadata={"help": "reuse cached KV blocks of shared prompt prefixes"}
    )
    dtype: str = field(default="float32", metadata={"help": "weights and activations dtype", "choices": DTYPES})
    kv_cache_dtype: str = field(
        default="auto",
        metadata={
            "help": "KV cache dtype; auto: the model dtype; fp8: e4m3 with per-layer scales calibrated at start-up",
            "choices": KV_CACHE_DTYPES,
        },
    )
    quantization: str | None = field(
        default=None,
        metadata={
            "help": quantization_help(),
            "choices": QUANTIZATIONS,
        },
    )
    kernel_backend: str = field(
        default="auto",
        metadata={
            "help": "auto: Triton on CUDA, native C++ kernels on the CPU (PyTorch reference where an op has none or no "
            "compiler is found); triton on CPU tensors needs TRITON_INTERPRET=1",
            "choices": KERNEL_BACKENDS,
        },
    )
    packed_linear: bool = field(
        default=True,
        metadata={
            "help": "CPU linear layers on weights packed at load time (float32: the native small-M kernel, else oneDNN)"
        },
    )
    float32_prompt_matmul: str = field(
        default="bf16x3",
        metadata={
            "help": "a float32 model's projections of prompt tokens on CPUs with AMX-BF16: bf16x3 takes each product "
            "as three bfloat16 ones on the tile unit (about 16 significant bits, 2x faster), ieee in float32 "
            "as elsewhere; decode tokens always run in float32",
            "choices": FLOAT32_PROMPT_MATMULS,
        },
    )
    speculative_config: str | None = field(
        default=None,
        metadata={
            "help": "speculative decoding on the decode pool, as JSON with vLLM's keys: method (ngram, suffix or "
            "draft_model), num_speculative_tokens, prompt_lookup_min, prompt_lookup_max, suffix_decoding_*, model, "
            "disable_by_batch_size",
            "example": '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 5}',
        },
    )
    enable_expert_parallel: bool = field(
        default=False,
        metadata={
            "help": "mixture-of-experts models with --tensor-parallel-size N: each rank holds 1/N of the experts "
            "whole (vLLM's flag); without it every rank holds 1/N of every expert's intermediate channels"
        },
    )
    enforce_eager: bool = field(
        default=False,
        metadata={
            "help": "run every step layer by layer (vLLM's flag): no CUDA graphs for decode steps on a GPU, "
            "and on the CPU no float32 step's decoder layers in one native call"
        },
    )
    scheduling_policy: str = field(
        default="fcfs",
        metadata={
            "help": "fcfs: requests in arrival order; priority: by the request's `priority` (lower first), then its "
            "TTFT target, then arrival, preempting running requests of a lower priority (vLLM's flag)",
            "choices": SCHEDULING_POLICIES,
        },
    )
    tenant_weights: str | None = field(
        default=None,
        metadata={
            "help": "with --scheduling-policy priority, each tenant's weight in the fair share of a pool's tokens "
            "and the router's queues, as name=weight,... (a tenant not named weighs 1; a request's tenant is its "
            "x-llm-d-inference-fairness-id header)",
            "example": "interactive=4,batch=1",
        },
    )
    enable_lora: bool = field(
        default=False, metadata={"help": "serve LoRA adapters (vLLM's flag): requests pick one by its name as `model`"}
    )
    lora_modules: str | None = field(
        default=None,
        metadata={
            "help": "LoRA adapters served from the start, each name=path or JSON with name, path and base_model_name "
            "(vLLM's forms; a local folder in PEFT's format); implies --enable-lora",
            "nargs": True,
            "example": "sql=/adapters/sql",
        },
    )
    max_loras: int = field(default=1, metadata={"help": "LoRA adapters in one step's batch at most (device slots)"})
    max_lora_rank: int = field(default=16, metadata={"help": "the largest LoRA rank served"})
    max_cpu_loras: int | None = field(
        default=None,
        metadata={"help": "LoRA adapters kept loaded in host memory (default: --max-loras)", "example": 8},
    )
    device: str = field(default="cpu", metadata={"internal": True})
    num_threads: int | None = field(default=None, metadata={"internal": True})
    # A CPU decode worker may run a step on up to this many threads while the host's other cores
    # are idle (workers.shell.elastic_threads); None: always num_threads.
    max_threads: int | None = field(default=None, metadata={"internal": True})
    # One (k_scale, v_scale) per layer for an FP8 KV cache; calibrated at load time when None.
    kv_scales: tuple[tuple[float, float], ...] | None = field(default=None, metadata={"internal": True})
    # speculative_config parsed (set from it on construction; None: no speculative decoding).
    speculative: SpeculativeConfig | None = field(
        init=False, default=None, repr=False, compare=False, metadata={"internal": True}
    )

    def __post_init__(self) -> None:
        def positive(name: str) -> None:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            positive(name)
        for name in ("kv_cache_memory", "num_kv_blocks", "max_model_len", "num_threads", "max_threads"):
            if getattr(self, name) is not None:
                positive(name)
        if (
            isinstance(self.gpu_memory_utilization, bool)
            or not isinstance(self.gpu_memory_utilization, (int, float))
            or not 0 < self.gpu_memory_utilization <= 1
        ):
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        for name, allowed in (
            ("dtype", DTYPES),
            ("kv_cache_dtype", KV_CACHE_DTYPES),
            ("kernel_backend", KERNEL_BACKENDS),
            ("float32_prompt_matmul", FLOAT32_PROMPT_MATMULS),
            ("scheduling_policy", SCHEDULING_POLICIES),
        ):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        check_quantization(self.quantization)
        if not isinstance(self.enable_prefix_caching, bool) or not isinstance(self.packed_linear, bool):
            raise ValueError("enable_prefix_caching and packed_linear must be true or false")
        for name in ("enforce_eager", "enable_expert_parallel"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.speculative_config is not None and not isinstance(self.speculative_config, str):
            raise ValueError(f"speculative_config must be a JSON string, got {self.speculative_config!r}")
        self.speculative = (
            SpeculativeConfig.from_json(self.speculative_config) if self.speculative_config is not None else None
        )
        if self.tenant_weights is not None:
            if not isinstance(self.tenant_weights, str):
                raise ValueError(f"tenant_weights must be a string of name=weight entries, got {self.tenant_weights!r}")
            parse_tenant_weights(self.tenant_weights)
        if not isinstance(self.enable_lora, bool):
            raise ValueError(f"enable_lora must be true or false, got {self.enable_lora!r}")
        LoRALimits(self.max_loras, self.max_lora_rank, self.max_cpu_loras)  # checks them
        if self.lora_modules is not None:
            if not isinstance(self.lora_modules, str):
                raise ValueError(f"lora_modules must be a string of name=path entries, got {self.lora_modules!r}")
            parse_lora_modules(self.lora_modules)
        if self.kv_scales is not None:
            scales = tuple((float(k), float(v)) for k, v in self.kv_scales)
            if not all(k > 0 and v > 0 and k < float("inf") and v < float("inf") for k, v in scales):
                raise ValueError(f"kv_scales must be finite and > 0, got {self.kv_scales!r}")
            self.kv_scales = scales

    @property
    def lora_enabled(self) -> bool:
        return self.enable_lora or bool(self.lora_modules)

    @property
    def lora_limits(self) -> LoRALimits:
        return LoRALimits(self.max_loras, self.max_lora_rank, self.max_cpu_loras)

    @property
    def lora_specs(self) -> tuple[LoRAModuleSpec, ...]:
        return parse_lora_modules(self.lora_modules)


@dataclass(frozen=True)
class WorkerConfig:
    """One worker: its id, role and engine, the KV transport choice, and where it runs."""

    worker_id: str
    role: Role
    model: str | None = None  # None: the default model; resolved on the worker's own node
    engine: EngineConfig = field(default_factory=EngineConfig)
    # KV transport choice (common.transports.CHOICES): auto picks per pair of workers.
    transport: str = "auto"
    transfer_timeout_s: float = 30.0
    kv_load_failure_policy: str = "recompute"  # when pushed KV is unusable: recompute or fail (workers.shell.kv_load)
    # Where the worker runs, filled in by the Ray actor shell (workers.shell.actors) from Ray's own
    # view: the transport per pair compares node ids, and gloo/nccl rendezvous on `host`.
    node_id: str = "local"
    host: str = "127.0.0.1"
    # Tensor parallelism: the worker's ranks, and the rendezvous (tcp://HOST:PORT) its rank 0 picks
    # for the group before it starts the other ranks.
    tp_size: int = 1
    tp_init_method: str | None = None
    # A decode worker's prefill pool's tensor-parallel size, a prefill worker's decode pool's (None:
    # this worker's own): a rank that receives parts of its heads from finer prefill ranks has a
    # cache for each part (kvtransfer.resharding), which the memory for its KV cache also pays for.
    peer_tp_size: int | None = None

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {tuple(r.value for r in ROLES)}, got {self.role!r}")
        if not isinstance(self.tp_size, int) or isinstance(self.tp_size, bool) or self.tp_size < 1:
            raise ValueError(f"tp_size must be a positive integer, got {self.tp_size!r}")
        if self.peer_tp_size is not None and (not isinstance(self.peer_tp_size, int) or self.peer_tp_size < 1):
            raise ValueError(f"peer_tp_size must be a positive integer, got {self.peer_tp_size!r}")
