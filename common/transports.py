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

__all__ = ["BACKENDS", "CHOICES", "FIXED_CHOICES"]

CHOICES = ("auto", "cpu", "shm", "gloo", "nccl")
# The choices that name one backend for every pair (the others choose per pair).
FIXED_CHOICES = ("shm", "gloo", "nccl")
BACKENDS = ("inprocess", "shm", "gloo", "nccl", "pairwise")
