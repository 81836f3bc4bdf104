"""Engine configuration: one dataclass, checked on construction."""

from __future__ import annotations

from dataclasses import dataclass

DTYPES = ("float32", "float16", "bfloat16")
KV_CACHE_DTYPES = ("auto", "fp8")
QUANTIZATIONS = (None, "fp8")
KERNEL_BACKENDS = ("auto", "triton", "native", "reference")


@dataclass
class EngineConfig:
    """Knobs named as in vLLM where the same knob exists.

    kv_cache_memory: bytes for the paged KV cache; num_kv_blocks, when set, wins over it.
    max_num_batched_tokens: per-step token budget shared by decodes and prefill chunks.
    quantization: "fp8" quantizes every linear layer of a float checkpoint to FP8 (e4m3, one
    scale per output channel) at load time; FP8 checkpoints load as FP8 whatever this says.
    kv_cache_dtype: "fp8" stores K/V as float8_e4m3fn with per-layer scales: kv_scales when given
    (one (k_scale, v_scale) per layer), else calibrated at load time (workers.quantization).
    """

    block_size: int = 16
    kv_cache_memory: int = 1 << 30
    num_kv_blocks: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    dtype: str = "float32"
    kv_cache_dtype: str = "auto"
    device: str = "cpu"
    num_threads: int | None = None
    quantization: str | None = None
    kv_scales: tuple[tuple[float, float], ...] | None = None
    # auto: Triton on CUDA, the native C++ kernels on the CPU (PyTorch reference where an op has
    # none or no compiler is found); triton on CPU tensors needs TRITON_INTERPRET=1.
    kernel_backend: str = "auto"
    packed_linear: bool = True  # CPU linear layers on oneDNN-prepacked weights

    def __post_init__(self) -> None:
        def positive(name: str) -> None:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

        for name in ("block_size", "kv_cache_memory", "max_num_seqs", "max_num_batched_tokens"):
            positive(name)
        for name in ("num_kv_blocks", "max_model_len", "num_threads"):
            if getattr(self, name) is not None:
                positive(name)
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}")
        if self.kernel_backend not in KERNEL_BACKENDS:
            raise ValueError(f"kernel_backend must be one of {KERNEL_BACKENDS}, got {self.kernel_backend!r}")
        if self.kv_scales is not None:
            scales = tuple((float(k), float(v)) for k, v in self.kv_scales)
            if not all(k > 0 and v > 0 and k < float("inf") and v < float("inf") for k, v in scales):
                raise ValueError(f"kv_scales must be finite and > 0, got {self.kv_scales!r}")
            self.kv_scales = scales
