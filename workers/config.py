"""Engine configuration: one dataclass, checked on construction.

Each user-facing field carries its help text (and allowed values) in its dataclass metadata;
`cluster.config` builds the `baton serve` flags, the YAML reader and the JSON Schema from them.
Fields marked `internal` are set by code (the launcher, calibration), never by users.
"""

from __future__ import annotations

from dataclasses import dataclass, field

DTYPES = ("float32", "float16", "bfloat16")
KV_CACHE_DTYPES = ("auto", "fp8")
QUANTIZATIONS = (None, "fp8")
KERNEL_BACKENDS = ("auto", "triton", "native", "reference")
CPU_KV_CACHE_MEMORY = 1 << 30  # kv_cache_memory's default on the CPU


@dataclass
class EngineConfig:
    """Knobs named as in vLLM where the same knob exists."""

    block_size: int = field(default=16, metadata={"help": "tokens per KV block (a power of two)"})
    kv_cache_memory: int | None = field(default=None, metadata={
        "help": "KV cache per worker, in bytes or with a unit such as 512MiB or 2GB (default: 1GiB on the CPU; "
                "on a GPU, what --gpu-memory-utilization leaves)", "size": True, "example": "16GiB"})
    gpu_memory_utilization: float = field(default=0.9, metadata={
        "help": "on a GPU without --kv-cache-memory: the fraction of the device's memory the worker uses; the KV "
                "cache gets it less the weights and the profiled activation peak (vLLM's flag)", "example": 0.8})
    num_kv_blocks: int | None = field(default=None, metadata={"internal": True})  # wins over kv_cache_memory
    max_num_seqs: int = field(default=64, metadata={"help": "sequences in one worker's batch at most"})
    # Serving wants prompts to finish one at a time so decoding starts sooner; offline benchmarks
    # that want whole batches of prompts per step pass a larger budget.
    max_num_batched_tokens: int = field(default=256, metadata={
        "help": "tokens per engine step, shared by decodes and prefill chunks (chunked prefill)"})
    max_model_len: int | None = field(default=None, metadata={
        "help": "context length limit (default: the model's, capped by what the KV cache holds)"})
    enable_prefix_caching: bool = field(default=True, metadata={"help": "reuse cached KV blocks of shared prompt prefixes"})
    dtype: str = field(default="float32", metadata={"help": "weights and activations dtype", "choices": DTYPES})
    kv_cache_dtype: str = field(default="auto", metadata={
        "help": "KV cache dtype; auto: the model dtype; fp8: e4m3 with per-layer scales calibrated at start-up",
        "choices": KV_CACHE_DTYPES})
    quantization: str | None = field(default=None, metadata={
        "help": "fp8: quantize every linear layer to FP8 (e4m3, per-channel scales) at load time; "
                "FP8 checkpoints load as FP8 without it", "choices": QUANTIZATIONS})
    kernel_backend: str = field(default="auto", metadata={
        "help": "auto: Triton on CUDA, native C++ kernels on the CPU (PyTorch reference where an op has none or no "
                "compiler is found); triton on CPU tensors needs TRITON_INTERPRET=1", "choices": KERNEL_BACKENDS})
    packed_linear: bool = field(default=True, metadata={"help": "CPU linear layers on oneDNN-prepacked weights"})
    enforce_eager: bool = field(default=False, metadata={
        "help": "run every step eagerly: no CUDA graphs for decode steps on a GPU (vLLM's flag; "
                "the CPU always runs eagerly)"})
    device: str = field(default="cpu", metadata={"internal": True})
    num_threads: int | None = field(default=None, metadata={"internal": True})
    # One (k_scale, v_scale) per layer for an FP8 KV cache; calibrated at load time when None.
    kv_scales: tuple[tuple[float, float], ...] | None = field(default=None, metadata={"internal": True})

    def __post_init__(self) -> None:
        def positive(name: str) -> None:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            positive(name)
        for name in ("kv_cache_memory", "num_kv_blocks", "max_model_len", "num_threads"):
            if getattr(self, name) is not None:
                positive(name)
        if isinstance(self.gpu_memory_utilization, bool) or not isinstance(self.gpu_memory_utilization, (int, float)) \
                or not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        for name, allowed in (("dtype", DTYPES), ("kv_cache_dtype", KV_CACHE_DTYPES), ("quantization", QUANTIZATIONS),
                              ("kernel_backend", KERNEL_BACKENDS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if not isinstance(self.enable_prefix_caching, bool) or not isinstance(self.packed_linear, bool):
            raise ValueError("enable_prefix_caching and packed_linear must be true or false")
        if not isinstance(self.enforce_eager, bool):
            raise ValueError(f"enforce_eager must be true or false, got {self.enforce_eager!r}")
        if self.kv_scales is not None:
            scales = tuple((float(k), float(v)) for k, v in self.kv_scales)
            if not all(k > 0 and v > 0 and k < float("inf") and v < float("inf") for k, v in scales):
                raise ValueError(f"kv_scales must be finite and > 0, got {self.kv_scales!r}")
            self.kv_scales = scales
