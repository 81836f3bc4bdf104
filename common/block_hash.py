"""Chained hashes of full KV blocks, identical in every process (router and workers alike).

A block's hash covers its token ids and the hash of the block before it, so equal hashes mean
equal prefixes. xxh3 with a fixed seed (not Python's randomized `hash`) keeps the values stable
across processes and restarts. Torch-free: the router computes the same hashes.

What a block's KV holds depends on more than its tokens when a request runs under a LoRA adapter
(`common.request.RequestContext.kv_namespace`): the chain of such a request starts from its
namespace's `root_hash` instead of ROOT_PARENT_HASH, so no prefix index or cache ever matches one
adapter's blocks for another's request.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import xxhash

HASH_SEED = 0x6261746F6E  # "baton"
ROOT_PARENT_HASH = 0


def root_hash(namespace: str | None) -> int:
    """The parent hash of a chain's first block: ROOT_PARENT_HASH without a namespace."""
    if namespace is None:
        return ROOT_PARENT_HASH
    return xxhash.xxh3_64_intdigest(b"namespace:" + namespace.encode("utf-8"), seed=HASH_SEED)


def hash_block(parent_hash: int, token_ids: Sequence[int]) -> int:
    """Hash of one full block given the hash of the block before it (ROOT_PARENT_HASH for the first)."""
    payload = struct.pack(f"<Q{len(token_ids)}I", parent_hash, *token_ids)
    return xxhash.xxh3_64_intdigest(payload, seed=HASH_SEED)


def hash_prefix_blocks(token_ids: Sequence[int], block_size: int, parent_hash: int = ROOT_PARENT_HASH) -> list[int]:
    """Chained hashes of every full block of `token_ids`; a trailing partial block gets none."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    hashes = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent_hash = hash_block(parent_hash, token_ids[start : start + block_size])
        hashes.append(parent_hash)
    return hashes
