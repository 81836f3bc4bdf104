"""The router's prefix index: which worker holds which KV blocks, fed by the workers' KV events.

Workers publish `KVEvent`s (blocks stored in / removed from their prefix cache, or the whole cache
cleared) with the same chained block hashes the router computes from a prompt
(`common.block_hash.hash_prefix_blocks`). Because each hash covers every block before it, the
number of leading prompt hashes a worker holds is exactly the length of its cached prefix.

Memory is bounded: each worker keeps at most `max_blocks_per_worker` hashes; past that the oldest
stored hashes are dropped first (the worker's LRU evicts old blocks first too, so this mostly
forgets what the worker forgot). A dead or restarted worker is dropped with `remove_worker`.
Not thread-safe: the router touches it only from its event loop.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from common.protocol import KVEvent, KVEventKind

__all__ = ["PrefixIndex"]


class PrefixIndex:
    def __init__(self, max_blocks_per_worker: int = 100_000) -> None:
        if max_blocks_per_worker < 1:
            raise ValueError(f"max_blocks_per_worker must be >= 1, got {max_blocks_per_worker}")
        self.max_blocks_per_worker = max_blocks_per_worker
        self._by_hash: dict[int, set[str]] = {}  # block hash -> workers holding it
        self._by_worker: dict[str, OrderedDict[int, None]] = {}  # worker -> its hashes, oldest first

    # ---- updates -------------------------------------------------------------------------
    def apply(self, worker_id: str, events: Iterable[KVEvent]) -> None:
        """Apply a worker's events in the order it produced them."""
        for event in events:
            if event.kind is KVEventKind.STORED:
                self.add(worker_id, event.block_hashes)
            elif event.kind is KVEventKind.REMOVED:
                self._remove(worker_id, event.block_hashes)
            elif event.kind is KVEventKind.CLEARED:
                self.remove_worker(worker_id)

    def add(self, worker_id: str, block_hashes: Iterable[int]) -> None:
        mine = self._by_worker.setdefault(worker_id, OrderedDict())
        for h in block_hashes:
            if h in mine:
                mine.move_to_end(h)
                continue
            mine[h] = None
            self._by_hash.setdefault(h, set()).add(worker_id)
        while len(mine) > self.max_blocks_per_worker:
            old, _ = mine.popitem(last=False)
            self._unlink(old, worker_id)

    def _remove(self, worker_id: str, block_hashes: Iterable[int]) -> None:
        mine = self._by_worker.get(worker_id)
        if mine is None:
            return
        for h in block_hashes:
            if mine.pop(h, 0) is None:  # present (values are None; the default 0 means absent)
                self._unlink(h, worker_id)

    def _unlink(self, block_hash: int, worker_id: str) -> None:
        holders = self._by_hash.get(block_hash)
        if holders is not None:
            holders.discard(worker_id)
            if not holders:
                del self._by_hash[block_hash]

    def replace(self, worker_id: str, block_hashes: Iterable[int]) -> None:
        """Forget what we knew about the worker and take this full snapshot instead."""
        self.remove_worker(worker_id)
        self.add(worker_id, block_hashes)

    def remove_worker(self, worker_id: str) -> None:
        for h in self._by_worker.pop(worker_id, ()):
            self._unlink(h, worker_id)

    # ---- queries -------------------------------------------------------------------------
    def match(self, block_hashes: Sequence[int]) -> dict[str, int]:
        """For each worker holding the first block: how many leading blocks of the prompt it holds.

        Cost O(prompt blocks x holders): walk the chain while any worker still holds it.
        """
        if not block_hashes:
            return {}
        holders = self._by_hash.get(block_hashes[0])
        if not holders:
            return {}
        alive = set(holders)
        result = dict.fromkeys(alive, 1)
        for i in range(1, len(block_hashes)):
            holders = self._by_hash.get(block_hashes[i])
            if not holders:
                break
            alive &= holders
            if not alive:
                break
            for w in alive:
                result[w] = i + 1
        return result

    def num_blocks(self, worker_id: str | None = None) -> int:
        if worker_id is None:
            return sum(len(v) for v in self._by_worker.values())
        return len(self._by_worker.get(worker_id, ()))

    def workers(self) -> list[str]:
        return [w for w, hashes in self._by_worker.items() if hashes]
