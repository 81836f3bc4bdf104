"""`baton serve` configuration: command-line flags over an optional YAML file over defaults."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, fields
from pathlib import Path

import yaml

from workers.config import EngineConfig

TRANSPORTS = ("auto", "cpu", "shm", "gloo", "nccl")
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
          "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}


def parse_size(value: str | int) -> int:
    """'1073741824', '2GB', '1.5GiB', '512MiB' -> bytes."""
    if isinstance(value, int):
        return value
    match = _SIZE.match(str(value))
    unit = (match.group(2) or "").lower() if match else None
    if not match or unit not in _UNITS:
        raise ValueError(f"cannot read {value!r} as a size; use bytes or a unit such as 512MiB or 2GB")
    return int(float(match.group(1)) * _UNITS[unit])


@dataclass
class ServeConfig:
    model: str | None = None
    served_model_name: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    prefill_workers: int = 1
    decode_workers: int = 1
    block_size: int = 16
    kv_cache_memory: int = 1 << 30
    max_num_seqs: int = 64
    # Smaller than the engine's offline default (1024): a prefill worker then finishes one 256-token
    # prompt per step instead of four together, so decoding starts sooner. On the CPU a 256-row
    # matmul already runs at full speed. bench/compare_vllm.py workload 1, bfloat16, 1P+1D:
    # 215 / 234 / 248 / 250 output tok/s at 1024 / 512 / 256 / 128 (TTFT p50 3.5 / 1.4 / 0.9 / 0.4 s).
    max_num_batched_tokens: int = 256
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    dtype: str = "float32"
    kv_cache_dtype: str = "auto"
    quantization: str | None = None
    transport: str = "auto"
    address: str | None = None
    threads_per_worker: int | None = None
    log_level: str = "info"
    # Routing (router.routing): policy name, conditional disaggregation and the kv-aware cost.
    routing_policy: str = "kv-aware"
    local_prefill_threshold: int = 64
    prefill_queue_threshold: int = 8192
    routing_temperature: float = 0.1
    routing_weights: dict | None = None  # {uncached, queue, kv, running}: see router.routing

    def __post_init__(self) -> None:
        self.kv_cache_memory = parse_size(self.kv_cache_memory)
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {self.transport!r}")
        if self.prefill_workers < 0:
            raise ValueError(f"prefill_workers must be >= 0, got {self.prefill_workers}")
        if self.decode_workers < 1:
            raise ValueError(f"decode_workers must be >= 1, got {self.decode_workers}")
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port}")
        self.engine_config()  # validates the engine knobs now, with their names
        self.routing_config()  # and the routing knobs

    @classmethod
    def load(cls, config_file: str | None, overrides: dict) -> "ServeConfig":
        values: dict = {}
        if config_file:
            path = Path(config_file)
            if not path.is_file():
                raise ValueError(f"config file {config_file!r} does not exist")
            loaded = yaml.safe_load(path.read_text()) or {}
            if not isinstance(loaded, dict):
                raise ValueError(f"config file {config_file!r} must hold a mapping of option: value")
            values.update({k.replace("-", "_"): v for k, v in loaded.items()})
        values.update({k: v for k, v in overrides.items() if v is not None})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown option(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return cls(**values)

    @property
    def transport_kind(self) -> str:
        return "shm" if self.transport == "cpu" else self.transport

    def worker_threads(self) -> int:
        if self.threads_per_worker:
            return self.threads_per_worker
        return max(1, (os.cpu_count() or 1) // (self.prefill_workers + self.decode_workers))

    def routing_config(self):
        from router.routing import RoutingConfig

        if not isinstance(self.routing_weights or {}, dict):
            raise ValueError(f"routing_weights must be a mapping such as {{uncached: 1.0, kv: 512}}, got {self.routing_weights!r}")
        weights = dict(self.routing_weights or {})
        known = ("uncached", "queue", "kv", "running")
        unknown = sorted(set(weights) - set(known))
        if unknown:
            raise ValueError(f"unknown routing weight(s) {', '.join(unknown)}; known: {', '.join(known)}")
        return RoutingConfig(
            policy=self.routing_policy, temperature=self.routing_temperature,
            local_prefill_threshold=self.local_prefill_threshold, prefill_queue_threshold=self.prefill_queue_threshold,
            **{f"w_{k}": v for k, v in weights.items()},
        )

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            block_size=self.block_size, kv_cache_memory=self.kv_cache_memory, max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens, max_model_len=self.max_model_len,
            enable_prefix_caching=self.enable_prefix_caching, dtype=self.dtype, kv_cache_dtype=self.kv_cache_dtype,
            quantization=self.quantization,
            num_threads=self.worker_threads(),
        )
