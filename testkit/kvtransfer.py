"""A minimal worker that owns one transport and one cache: what tests and the benchmark run
as a Ray actor (or directly, in-process) on each side of a transfer. Not used in serving."""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Sequence

import torch

from common.protocol import KVEndpoint, KVLayout
from common.tp_split import kv_head_range
from kvtransfer import create_transport
from kvtransfer.base import TransferResult, TransferSide, TransferStatus
from kvtransfer.resharding import RankKV, heads_layout


def seeded_bytes(layout: KVLayout, num_blocks: int, seed: int) -> torch.Tensor:
    """Deterministic cache contents (flat uint8) that any process can recompute."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (layout.block_bytes * num_blocks,), generator=g, dtype=torch.uint8)


class KVWorker:
    """One side of a transfer. Methods take and return plain picklable values."""

    def __init__(self) -> None:
        self.transport = None
        self.cache: torch.Tensor | None = None
        self.handles: dict = {}

    def pid(self) -> int:
        return os.getpid()

    def setup(
        self, kind: str, layout: KVLayout, num_blocks: int, seed: int | None, options: dict | None = None
    ) -> KVEndpoint:
        self.close()
        self.transport = create_transport(kind, **(options or {}))
        self.cache = self.transport.allocate_cache(layout, num_blocks)
        if seed is not None:
            self.cache.view(torch.uint8).view(-1).copy_(seeded_bytes(layout, num_blocks, seed))
        return self.transport.endpoint()

    def connect(self, endpoint: KVEndpoint) -> str:
        return self.transport.connect(endpoint)

    def expect(self, transfer_id: str, dst: Sequence[int], timeout_s: float) -> None:
        self.handles[(TransferSide.RECV, transfer_id)] = self.transport.expect(transfer_id, dst, timeout_s)

    def send(self, peer_id: str, src: Sequence[int], dst: Sequence[int], transfer_id: str, timeout_s: float) -> None:
        self.handles[(TransferSide.SEND, transfer_id)] = self.transport.send(peer_id, src, dst, transfer_id, timeout_s)

    def poll(self, transfer_id: str, role: TransferSide) -> TransferStatus:
        return self.transport.poll(self.handles[(role, transfer_id)])

    def wait(self, transfer_id: str, role: TransferSide, timeout_s: float | None = None) -> TransferResult:
        return self.transport.wait(self.handles[(role, transfer_id)], timeout_s)

    def abort(self, transfer_id: str) -> None:
        self.transport.abort(transfer_id)

    def send_and_wait(
        self, peer_id: str, src: Sequence[int], dst: Sequence[int], transfer_id: str, timeout_s: float
    ) -> tuple[TransferResult, float]:
        """Benchmark helper: wall seconds from send() to a terminal result, in this process."""
        t0 = time.perf_counter()
        handle = self.transport.send(peer_id, src, dst, transfer_id, timeout_s)
        result = self.transport.wait(handle)
        return result, time.perf_counter() - t0

    def cache_bytes(self) -> torch.Tensor:
        """Copy of the cache as uint8 `[L, 2, num_blocks, bytes per block per layer/kv]`."""
        assert self.cache is not None
        c = self.cache.view(torch.uint8)
        return c.reshape(c.shape[0], 2, c.shape[2], -1).clone()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
        self.transport, self.cache, self.handles = None, None, {}


def rank_group(kind: str, model: KVLayout, tp_size: int, num_blocks: int, peer_tp_size: int | None = None) -> list:
    """The ranks of one tensor-parallel worker as `kvtransfer.resharding.RankKV`s in this process,
    each on its own `kind` transports and holding its heads of the whole model's layout `model`
    (`peer_tp_size`: the prefill group's size, for a decode worker's ranks)."""
    ranks = []
    for rank in range(tp_size):
        layout = dataclasses.replace(
            heads_layout(model, kv_head_range(model.num_kv_heads, tp_size, rank)), tp_size=tp_size
        )
        transport = create_transport(kind)
        cache = transport.allocate_cache(layout, num_blocks)
        ranks.append(
            RankKV(
                transport, cache, layout, rank, model.num_kv_heads, lambda part: create_transport(kind), peer_tp_size
            )
        )
    return ranks


def handoff(
    prefill: Sequence,
    decode: Sequence,
    src_ids: Sequence[int],
    dst_ids: Sequence[int],
    transfer_id: str,
    timeout_s: float = 30.0,
) -> tuple[list, list[TransferResult]]:
    """One request's handoff between two rank groups (rank_group), the ranks one after another:
    every link's result (kvtransfer.resharding.LinkResult), and each decode rank's."""
    peers = [rank.endpoint() for rank in decode]
    for rank in decode:
        rank.expect(transfer_id, dst_ids, timeout_s)
    sends = [(rank, rank.send(peers, src_ids, dst_ids, transfer_id, timeout_s)) for rank in prefill]
    links = [link for rank, started in sends for link in rank.wait_sent(started)]
    return links, [rank.wait_received(transfer_id) for rank in decode]
