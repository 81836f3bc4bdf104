"""KV transport names, declared once (torch-free, so the configuration tree reads them without
loading kvtransfer).

Two lists, and "auto" is only in one of them:

- `CHOICES`: what a deployment configures (`transport.kind`, `baton serve --transport`). Serving
  workers hold a pairwise transport that picks a backend per pair of workers: `auto` means shared
  memory (shm) inside a node and gloo between nodes on the CPU, nccl on GPUs; `cpu` is the same
  choice restricted to the CPU backends; `shm`, `gloo` or `nccl` force that backend for every pair.
- `BACKENDS`: the transports `kvtransfer.create_transport` builds, each one `KVTransport.kind`: the
  kinds registered in `kvtransfer/__init__.py` (kvtransfer.registry), named here without torch.

`Place` (where a worker's KV cache lives) and `offered_kinds` (the backends a choice needs there)
live here too, so placement checks a choice against a pool's device without loading kvtransfer.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "BACKENDS",
    "CHOICES",
    "DEVICES",
    "FIXED_CHOICES",
    "KV_LOAD_FAILURE_POLICIES",
    "KVLoadFailed",
    "PeerLink",
    "Place",
    "offered_kinds",
]

CHOICES = ("auto", "cpu", "shm", "gloo", "nccl")
# The choices that name one backend for every pair (the others choose per pair).
FIXED_CHOICES = ("shm", "gloo", "nccl")
BACKENDS = ("inprocess", "shm", "gloo", "nccl", "pairwise")
# What a decode worker does when the KV pushed to it failed or is invalid (vLLM's
# --kv-load-failure-policy): recompute prefills the prompt itself (counted and logged); fail
# ends the request with a retryable error.
KV_LOAD_FAILURE_POLICIES = ("recompute", "fail")


class KVLoadFailed(RuntimeError):
    """A decode worker under the `fail` policy could not use the KV pushed to it (`reason`: a
    kvtransfer.integrity.FailureReason value). Retryable: the router answers 503."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason

    def __reduce__(self) -> tuple[type[KVLoadFailed], tuple[str, str]]:  # keeps `reason` across Ray's pickling
        return type(self), (str(self), self.reason)


DEVICES = ("cpu", "cuda")


@dataclass(frozen=True)
class Place:
    """Where a worker's KV cache lives, as far as choosing a transport goes."""

    node_id: str = "local"  # the Ray node id ("local" outside Ray: one node)
    host: str = "127.0.0.1"  # the node's IP as Ray reports it: gloo/nccl bind and rendezvous here
    device: str = "cpu"

    def __post_init__(self) -> None:
        if not self.node_id or not self.host:
            raise ValueError(f"a Place needs a node id and a host, got {self!r}")
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {self.device!r}")

    def short(self) -> str:
        return f"node {self.node_id[:12]} ({self.host}, {self.device})"


def offered_kinds(choice: str, place: Place) -> tuple[str, ...]:
    """The backends a worker at `place` needs for any peer, receiving backend first."""
    if choice not in CHOICES:
        raise ValueError(f"unknown KV transport choice {choice!r}; expected one of {CHOICES}")
    if choice in FIXED_CHOICES:
        return (choice,)
    if place.device == "cuda":
        if choice == "cpu":
            raise ValueError(
                "transport 'cpu' (shm/gloo) needs the workers' KV caches on the CPU; "
                "GPU workers use nccl (transport auto or nccl)"
            )
        return ("nccl",)
    return ("shm", "gloo")


@dataclass(frozen=True)
class PeerLink:
    """A connected receiver, as the sender sees it: which backend serves the pair, and what
    went over it (successful transfers only). Torch-free: a worker's `kv_links()` answer."""

    peer: str  # the receiver's name (its worker id in serving)
    peer_node_id: str
    kind: str
    blocks_sent: int = 0
    bytes_sent: int = 0
