"""KV transport names, declared once (torch-free, so the configuration tree reads them without
loading kvtransfer).

Two lists, and "auto" is only in one of them:

- `CHOICES`: what a deployment configures (`transport.kind`, `baton serve --transport`). Serving
  workers hold a pairwise transport that picks a backend per pair of workers: `auto` means shared
  memory (shm) inside a node and gloo between nodes on the CPU, nccl on GPUs; `cpu` is the same
  choice restricted to the CPU backends; `shm`, `gloo` or `nccl` force that backend for every pair.
- `BACKENDS`: the transports `kvtransfer.create_transport` builds, each one `KVTransport.kind`.
"""

from __future__ import annotations

__all__ = ["BACKENDS", "CHOICES", "FIXED_CHOICES", "KV_LOAD_FAILURE_POLICIES", "KVLoadFailed"]

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

    def __reduce__(self):  # keeps `reason` across Ray's pickling
        return type(self), (str(self), self.reason)
