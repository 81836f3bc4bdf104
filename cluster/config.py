"""The one configuration tree of `baton serve`, and everything generated from it.

`BatonConfig` is made of sections, each a dataclass defined once with its defaults, types,
allowed values and help text (in the fields' metadata): the server (`router.config.ServerConfig`: HTTP, request limits,
admission control, deadlines, API keys), the engine
(`workers.config.EngineConfig`), the routing (`router.routing.RoutingConfig`), the KV transport,
the placement of the pools (healing and scaling included) and the admin endpoint
(`router.config.AdminConfig`). From the tree come:

- the `baton serve` flags: one per field, `--<flag>` where the flag is the field's metadata
  `flag` or else its name (names are unique across sections);
- the YAML `--config` reader: the same tree, nested by section (`engine: {dtype: bfloat16}`);
  an unknown key is an error naming it and the nearest known key;
- the JSON Schema that `baton config schema` prints (the Helm chart embeds it).

Precedence: defaults, then the YAML file, then flags.

This module holds the tree (`BatonConfig`) and the sections that are cluster's own (the KV
transport, the placement); how a field becomes an option, a flag, a YAML key and a schema entry is
cluster/option_tree.py's.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
from dataclasses import dataclass, field
from typing import Any

from cluster.autoscaler_config import AutoscalerConfig
from cluster.option_tree import SIZE_PATTERN, Option, OptionTree, parse_size
from common import transports
from common.roles import Role
from router.config import AdminConfig, ServerConfig
from router.routing import RoutingConfig
from workers.config import EngineConfig

__all__ = [
    "OPTIONS",
    "SECTIONS",
    "SIZE_PATTERN",
    "TREE",
    "BatonConfig",
    "Option",
    "PlacementConfig",
    "TransportConfig",
    "add_flags",
    "build",
    "json_schema",
    "parse_labels",
    "parse_size",
    "read_yaml",
]


@dataclass
class TransportConfig:
    """How prefill workers hand KV blocks to decode workers."""

    kind: str = field(
        default="auto",
        metadata={
            "flag": "transport",
            "choices": transports.CHOICES,
            "help": "KV transport between prefill and decode workers; auto and cpu choose per pair of workers: "
            "shared memory on one node, gloo between nodes (auto: nccl on GPUs); shm, gloo or nccl: "
            "that one for every pair",
        },
    )
    transfer_timeout_s: float = field(
        default=30.0, metadata={"flag": "kv_transfer_timeout", "help": "seconds a KV transfer may take before it fails"}
    )
    kv_load_failure_policy: str = field(
        default="recompute",
        metadata={
            "choices": transports.KV_LOAD_FAILURE_POLICIES,
            "help": "when the KV a decode worker received failed its checksum, came short or late: recompute "
            "(the decode worker prefills the prompt itself; counted in baton:kv_transfer_failures_total) "
            "or fail (the request ends with a retryable 503)",
        },
    )

    def __post_init__(self) -> None:
        if not self.transfer_timeout_s > 0:
            raise ValueError(f"kv_transfer_timeout must be > 0 seconds, got {self.transfer_timeout_s}")


@dataclass
class PlacementConfig:
    """Where the pools run: the Ray cluster, pool sizes and resources per worker."""

    address: str | None = field(
        default=None,
        metadata={
            "help": "join this Ray cluster (auto or HOST:PORT) instead of starting a private one on 127.0.0.1",
            "example": "auto",
        },
    )
    prefill_workers: int = field(default=1, metadata={"help": "prefill pool size (0: decode workers prefill)"})
    decode_workers: int = field(default=1, metadata={"help": "decode pool size"})
    threads_per_worker: int | None = field(
        default=None,
        metadata={
            "help": "CPU threads per worker, also the CPUs each worker asks Ray for "
            "(default: this machine's cores shared among the workers, and no CPUs asked from Ray; with one "
            "prefill worker, it takes every core for prompts of 1,024+ tokens and decode workers run at idle "
            "priority)"
        },
    )
    gpus_per_worker: float | None = field(
        default=None,
        metadata={
            "help": "GPUs each rank of a worker asks Ray for (a worker of tensor-parallel size N asks N times as many; "
            "default: 1 when the Ray cluster has GPUs, else 0)"
        },
    )
    tensor_parallel_size: int = field(
        default=1,
        metadata={
            "alias": "-tp",
            "example": 2,
            "help": "ranks of a worker (both pools): each holds a shard of every layer and its KV heads, "
            "all on one node "
            "(a STRICT_PACK placement group); vLLM's flag",
        },
    )
    prefill_tensor_parallel_size: int | None = field(
        default=None,
        metadata={
            "example": 1,
            "help": "tensor-parallel size of a prefill worker (default: --tensor-parallel-size); it and the "
            "decode size may differ when one is a multiple of the other",
        },
    )
    decode_tensor_parallel_size: int | None = field(
        default=None,
        metadata={"example": 1, "help": "tensor-parallel size of a decode worker (default: --tensor-parallel-size)"},
    )
    prefill_resource: str | None = field(
        default="baton_prefill",
        metadata={"help": "Ray custom resource a prefill worker needs, used when the cluster's nodes offer it"},
    )
    decode_resource: str | None = field(
        default="baton_decode",
        metadata={"help": "Ray custom resource a decode worker needs, used when the cluster's nodes offer it"},
    )
    prefill_node_labels: str | None = field(
        default=None,
        metadata={
            "help": "Ray node labels a prefill worker's node must carry, as key=value[,key=value] "
            "(a Ray label selector; values may use Ray's !value and in(a,b) forms)",
            "example": "baton-pool=prefill",
        },
    )
    decode_node_labels: str | None = field(
        default=None,
        metadata={
            "help": "Ray node labels a decode worker's node must carry, as key=value[,key=value]",
            "example": "baton-pool=decode",
        },
    )
    placement_timeout_s: float = field(
        default=120.0,
        metadata={
            "flag": "placement_timeout",
            "help": "seconds start-up waits for Ray to place each worker before it fails naming the resource "
            "no node offers; raise it when an autoscaler launches nodes on demand",
        },
    )
    # -- healing and scaling (cluster.pool_manager, router.ray_backend)
    max_restarts: int = field(
        default=3,
        metadata={
            "help": "times Ray restarts a worker whose process died "
            "(it reloads the model and rejoins once it answers); "
            "-1: without limit. A worker with no restart left is replaced by a new one"
        },
    )
    max_migrations: int = field(
        default=3,
        metadata={
            "help": "times a request whose decode worker died moves to another decode worker (which re-prefills the "
            "prompt and the tokens already streamed, and continues) before its stream ends with an error"
        },
    )
    migration_wait_s: float = field(
        default=30.0,
        metadata={
            "flag": "migration_wait",
            "help": "seconds a request whose decode worker died waits for a live decode worker to continue on "
            "(a restarting one counts) before its stream ends with an error",
        },
    )
    drain_timeout_s: float = field(
        default=60.0,
        metadata={
            "flag": "drain_timeout",
            "help": "seconds a worker being removed (baton scale) lets its requests finish before they move to "
            "other workers",
        },
    )
    # -- router processes (cluster.router_procs, workers.shell.router_leases)
    api_server_count: int = field(
        default=1,
        metadata={
            "example": 2,
            "help": "router processes sharing the HTTP port (SO_REUSEPORT, as vLLM's flag); each has its own prefix "
            "index fed by every worker's KV events and its share of the admission limits, and a dead one is "
            "restarted while the others serve on",
        },
    )
    router_lease_s: float = field(
        default=5.0,
        metadata={
            "flag": "router_lease",
            "help": "seconds a worker keeps a router's requests after its last call (its long-polls renew the lease "
            "all the time); past it the router is taken for dead and its requests end, freeing their KV "
            "blocks in both pools",
        },
    )

    def __post_init__(self) -> None:
        if self.max_restarts < -1:
            raise ValueError(f"max_restarts must be >= -1 (-1: without limit), got {self.max_restarts}")
        if self.max_migrations < 0:
            raise ValueError(f"max_migrations must be >= 0, got {self.max_migrations}")
        for name, flag in (("migration_wait_s", "migration_wait"), ("drain_timeout_s", "drain_timeout")):
            if not 0 <= getattr(self, name) < float("inf"):
                raise ValueError(f"{flag} must be >= 0 seconds, got {getattr(self, name)}")
        if self.api_server_count < 1:
            raise ValueError(f"api_server_count must be >= 1, got {self.api_server_count}")
        if not 0 < self.router_lease_s < float("inf"):
            raise ValueError(f"router_lease must be > 0 seconds, got {self.router_lease_s}")
        if self.prefill_workers < 0:
            raise ValueError(f"prefill_workers must be >= 0, got {self.prefill_workers}")
        if self.decode_workers < 1:
            raise ValueError(f"decode_workers must be >= 1, got {self.decode_workers}")
        if self.threads_per_worker is not None and self.threads_per_worker < 1:
            raise ValueError(f"threads_per_worker must be >= 1, got {self.threads_per_worker}")
        if self.gpus_per_worker is not None and not self.gpus_per_worker >= 0:
            raise ValueError(f"gpus_per_worker must be >= 0, got {self.gpus_per_worker}")
        for name in ("tensor_parallel_size", "prefill_tensor_parallel_size", "decode_tensor_parallel_size"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        prefill_tp, decode_tp = self.tp_size(Role.PREFILL), self.tp_size(Role.DECODE)
        if self.prefill_workers and max(prefill_tp, decode_tp) % min(prefill_tp, decode_tp):
            raise ValueError(
                f"prefill_tensor_parallel_size {prefill_tp} and decode_tensor_parallel_size {decode_tp}: "
                f"one must be a multiple of the other, so that each decode rank's KV heads come whole "
                f"from prefill ranks (kvtransfer.resharding)"
            )
        for name in ("prefill_node_labels", "decode_node_labels"):
            parse_labels(getattr(self, name), name)  # raises ValueError naming the field
        if not 0 < self.placement_timeout_s < float("inf"):
            raise ValueError(f"placement_timeout must be > 0 seconds, got {self.placement_timeout_s}")

    def node_labels(self, role: Role) -> dict[str, str]:
        """The label selector of a pool (`role` prefill or decode) as Ray takes it."""
        return parse_labels(
            self.prefill_node_labels if role == Role.PREFILL else self.decode_node_labels, f"{role}_node_labels"
        )

    def tp_size(self, role: Role) -> int:
        """The tensor-parallel size of a pool's workers (`role` prefill or decode)."""
        size = self.prefill_tensor_parallel_size if role == Role.PREFILL else self.decode_tensor_parallel_size
        return size or self.tensor_parallel_size

    def resource(self, role: Role) -> str | None:
        """The custom resource a pool's workers need, if the cluster offers it."""
        return self.prefill_resource if role == Role.PREFILL else self.decode_resource


_LABEL_KEY = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._/-]*[A-Za-z0-9])?$")


def parse_labels(text: str | None, name: str = "node_labels") -> dict[str, str]:
    """'key=value,key2=value2' -> {'key': 'value', 'key2': 'value2'}; ValueError naming `name`."""
    if text is None or not text.strip():
        return {}
    labels: dict[str, str] = {}
    # Split on commas outside parentheses: in(a,b) is one value.
    for item in re.split(r",(?![^()]*\))", text):
        key, sep, value = (part.strip() for part in item.partition("="))
        if not sep or not _LABEL_KEY.match(key) or not value:
            raise ValueError(f"{name}: cannot read {item.strip()!r} as key=value (in {text!r})")
        if key in labels:
            raise ValueError(f"{name}: label {key!r} given twice (in {text!r})")
        labels[key] = value
    return labels


@dataclass
class BatonConfig:
    """Everything `baton serve` needs: the model and one section per concern."""

    model: str | None = field(
        default=None,
        metadata={
            "help": "Hugging Face model folder or .gguf file (default: SmolLM2-135M-Instruct)",
            "example": "/models/llama",
        },
    )
    served_model_name: str | None = field(
        default=None, metadata={"help": "model name in the API (default: the folder's name)"}
    )
    server: ServerConfig = field(default_factory=ServerConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    transport: TransportConfig = field(default_factory=TransportConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    admin: AdminConfig = field(default_factory=AdminConfig)
    autoscaler: AutoscalerConfig = field(default_factory=AutoscalerConfig)

    @classmethod
    def load(cls, config_file: str | os.PathLike | None = None, options: dict[str, Any] | None = None) -> BatonConfig:
        """Defaults, then the YAML file, then `options` (flat option names, as the flags: port=8001)."""
        values: dict[tuple[str, ...], Any] = {}
        if config_file is not None:
            values.update(TREE.read_yaml(config_file))
        values.update(TREE.read_options(options or {}))
        return TREE.build(values)

    @classmethod
    def from_options(cls, **options: Any) -> BatonConfig:
        """`BatonConfig.from_options(port=8001, kv_cache_memory="64MiB")`: defaults plus options."""
        return cls.load(None, options)

    def worker_threads(self) -> int:
        """CPU threads of each rank: threads_per_worker, else the machine's cores split between every
        rank of every worker."""
        placement = self.placement
        if placement.threads_per_worker:
            return placement.threads_per_worker
        ranks = placement.prefill_workers * placement.tp_size(
            Role.PREFILL
        ) + placement.decode_workers * placement.tp_size(Role.DECODE)
        return max(1, (os.cpu_count() or 1) // ranks)

    def worker_engine_config(self) -> EngineConfig:
        """The engine configuration every worker runs with (threads filled in from the placement).
        With the cores split automatically, a CPU decode worker also borrows the cores the others
        leave idle (workers.shell.elastic_threads); threads_per_worker, the user's own choice, is kept."""
        threads = self.worker_threads()
        borrow = None if self.placement.threads_per_worker else max(threads, os.cpu_count() or 1)
        return dataclasses.replace(self.engine, num_threads=threads, max_threads=borrow)

    def to_dict(self) -> dict[str, Any]:
        """The effective configuration as the YAML file would spell it."""
        return TREE.to_dict(self)


# ---------------------------------------------------------------------------- the option tree
# The flags, the YAML reader and the JSON Schema, all from the tree (cluster/option_tree.py).

TREE = OptionTree.of(BatonConfig)
SECTIONS: dict[str, type] = TREE.sections
OPTIONS: list[Option] = TREE.options


def build(values: dict[tuple[str, ...], Any]) -> BatonConfig:
    """A BatonConfig from checked values by path; each section validates itself."""
    return TREE.build(values)


def read_yaml(config_file: str | os.PathLike) -> dict[tuple[str, ...], Any]:
    """Checked values by path from a YAML file nested as the tree is."""
    return TREE.read_yaml(config_file)


def add_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per option; only flags given on the command line appear in the parsed namespace."""
    TREE.add_flags(parser)


def json_schema() -> dict[str, Any]:
    """A self-contained JSON Schema (draft-07) of the YAML file, every default and help text included."""
    return TREE.json_schema("Baton configuration", "Baton configuration (`baton serve --config FILE`)")
