"""Paged KV block accounting: allocation, reference counts, prefix cache and LRU eviction.

Every block is in exactly one of two states:
- referenced (ref_count > 0): owned by one or more running sequences;
- free (ref_count == 0): in `_free`, an LRU-ordered dict. A free block may still hold a cached
  prefix (its hash is in `_cached`); it is reused, and its hash dropped, only when it reaches
  the front of the LRU order and a new block is needed.

Prefix caching covers full blocks only. A cached block is looked up by its chained hash and then
its token ids are compared, so a hash collision can never serve the wrong KV.

Sliding windows (`window`: set when every layer of the model is windowed, the largest window):
once a sequence's next query can no longer see a block, release_out_of_window drops the
sequence's reference to it and leaves FREED_BLOCK in its place in block_ids (the attention
kernels never read blocks before a window), so a long request holds only the blocks its window
needs. A model with any global layer keeps every block. Prefix caching stays exact: a block's KV
depends only on the tokens up to it, and a hit is a run of cached blocks from the first one that
are all still intact (a released block keeps its hash until it is reused, which drops the hash),
so a hit holds every block the window of its first new token needs.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass

from common.block_hash import hash_block, root_hash
from common.protocol import KVEvent, KVEventKind
from workers.engine.sequence import Sequence

FREED_BLOCK = -1  # block_ids entry of a block released because it fell out of the sliding window


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None
    token_ids: tuple[int, ...] | None = None


class BlockManager:
    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, window: int | None = None
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        if window is not None and window < 1:
            raise ValueError(f"window must be None or >= 1, got {window}")
        self.window = window  # tokens every layer's queries see; None: some layer attends to everything
        # Built as blocks are first handed out (in id order), so a cache of many blocks costs
        # nothing until used (the simulator builds thousands of workers). The free list in LRU
        # order is: the first `_free_ahead` entries of `_free` (uncached blocks given back), the
        # never-used ids len(blocks)..num_blocks-1, then the rest of `_free`.
        self.blocks: list[Block] = []
        self._free: OrderedDict[int, None] = OrderedDict()  # free blocks handed out before
        self._free_ahead = 0
        self._cached: dict[int, int] = {}  # block hash -> block id
        self._events: list[KVEvent] = []
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0  # of which found cached

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free) + self.num_blocks - len(self.blocks)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by sequences (cached-but-free blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        total = seq.num_computed_tokens + num_new_tokens
        return max(0, -(-total // self.block_size) - len(seq.block_ids))

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.blocks_needed(seq, num_new_tokens) <= len(self._free) + self.num_blocks - len(self.blocks)

    def cached_hashes(self) -> tuple[int, ...]:
        """Hashes of every block in the prefix cache now (a KV-event snapshot)."""
        return tuple(self._cached)

    def drain_events(self) -> list[KVEvent]:
        events, self._events = self._events, []
        return events

    # ---- prefix cache --------------------------------------------------------------------
    def _extend_hashes(self, seq: Sequence, num_tokens: int) -> None:
        """Hash seq's full blocks within its first num_tokens tokens (each block hashed once)."""
        bs = self.block_size
        while (len(seq.block_hashes) + 1) * bs <= num_tokens:
            i = len(seq.block_hashes)
            parent = seq.block_hashes[-1] if seq.block_hashes else root_hash(seq.kv_namespace)
            seq.block_hashes.append(hash_block(parent, seq.token_ids[i * bs : (i + 1) * bs]))

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Block ids caching seq's longest prefix; leaves at least one token to compute."""
        if not self.enable_prefix_caching:
            return []
        # The last token must be computed to produce logits, so it never comes from the cache.
        max_blocks = (seq.num_tokens - 1) // self.block_size
        self._extend_hashes(seq, max_blocks * self.block_size)
        hits = []
        for i in range(max_blocks):
            block_id = self._cached.get(seq.block_hashes[i])
            if block_id is None:
                break
            tokens = tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
            if self.blocks[block_id].token_ids != tokens:
                break  # hash collision: never serve another prefix's KV
            hits.append(block_id)
        return hits

    def allocate_prefix_and_new(self, seq: Sequence, cached_block_ids: list[int], num_new_tokens: int) -> bool:
        """Admit a sequence that has no blocks yet: take its cached prefix, then fresh blocks.

        Returns False, changing nothing, when there is not enough room.
        """
        assert not seq.block_ids and seq.num_computed_tokens == 0
        num_cached_tokens = len(cached_block_ids) * self.block_size
        total = num_cached_tokens + num_new_tokens
        new_needed = -(-total // self.block_size) - len(cached_block_ids)
        # Cached blocks sitting in the free list stop being free once referenced.
        reusable_free = sum(1 for b in cached_block_ids if self.blocks[b].ref_count == 0)
        if new_needed > self.num_free_blocks - reusable_free:
            return False
        for block_id in cached_block_ids:
            self._ref(block_id)
        seq.block_ids = list(cached_block_ids)
        seq.num_registered_blocks = 0
        seq.num_computed_tokens = num_cached_tokens
        self.allocate(seq, num_new_tokens)
        if self.enable_prefix_caching:
            self.prefix_queries += seq.num_tokens
            self.prefix_hits += num_cached_tokens
        return True

    def _ref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            # A free block is referenced only as a cache hit: cached when freed, so never one of
            # the `_free_ahead` entries.
            assert block.block_hash is not None, block
            del self._free[block_id]
        block.ref_count += 1

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Give seq enough blocks to hold num_new_tokens more tokens. Caller checked can_allocate."""
        needed = self.blocks_needed(seq, num_new_tokens)
        assert needed <= len(self._free) + self.num_blocks - len(self.blocks), "caller must check can_allocate first"
        for _ in range(needed):
            block = self._take_free()
            if block.block_hash is not None:
                self._evict(block)
            block.ref_count = 1
            seq.block_ids.append(block.block_id)

    def _take_free(self) -> Block:
        """The block at the front of the free list (see __init__), out of it."""
        if self._free_ahead or len(self.blocks) == self.num_blocks:
            block_id, _ = self._free.popitem(last=False)
            self._free_ahead = max(0, self._free_ahead - 1)
            return self.blocks[block_id]
        block = Block(len(self.blocks))
        self.blocks.append(block)
        return block

    def _evict(self, block: Block) -> None:
        assert block.block_hash is not None
        if self._cached.get(block.block_hash) == block.block_id:
            del self._cached[block.block_hash]
            self._events.append(KVEvent(KVEventKind.REMOVED, (block.block_hash,)))
        block.block_hash = None
        block.token_ids = None

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Register the hashes of seq's blocks that became full and computed."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        num_full = seq.num_computed_tokens // bs
        self._extend_hashes(seq, num_full * bs)
        stored = []
        for i in range(seq.num_registered_blocks, num_full):
            block = self.blocks[seq.block_ids[i]]
            if block.block_hash is not None:
                continue
            block_hash = seq.block_hashes[i]
            if block_hash in self._cached:
                continue  # another sequence computed the same block first; keep theirs
            block.block_hash = block_hash
            block.token_ids = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            self._cached[block_hash] = block.block_id
            stored.append(block_hash)
        seq.num_registered_blocks = max(seq.num_registered_blocks, num_full)
        if stored:
            self._events.append(KVEvent(KVEventKind.STORED, tuple(stored)))

    def free(self, seq: Sequence) -> None:
        """Drop seq's references. Its cached blocks stay reusable until evicted."""
        # Tail first, so under LRU a prefix outlives the blocks that extend it.
        for block_id in reversed(seq.block_ids):
            if block_id != FREED_BLOCK:
                self._unref(block_id)
        seq.block_ids = []
        seq.num_registered_blocks = 0
        seq.num_computed_tokens = 0

    def _unref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        assert block.ref_count > 0
        block.ref_count -= 1
        if block.ref_count == 0:
            self._free[block_id] = None
            if block.block_hash is None:
                # Uncached blocks go first in line for reuse: they hold nothing worth keeping.
                self._free.move_to_end(block_id, last=False)
                self._free_ahead += 1

    def release_tail(self, seq: Sequence) -> int:
        """Release seq's trailing blocks that hold none of its computed tokens (the slots of drafts
        speculative decoding rejected); returns how many. They were allocated this step, so they are
        seq's alone and never cached: they go back first in line for reuse."""
        keep = -(-seq.num_computed_tokens // self.block_size)
        released = 0
        while len(seq.block_ids) > keep:
            block_id = seq.block_ids.pop()
            block = self.blocks[block_id]
            assert block.ref_count == 1 and block.block_hash is None, block
            self._unref(block_id)
            released += 1
        return released

    def release_out_of_window(self, seq: Sequence) -> int:
        """Release seq's blocks that no query from its next token on can see (FREED_BLOCK takes
        their place in seq.block_ids); returns how many. Nothing without a window. Call after the
        step's cache_computed_blocks, so a released full block stays in the prefix cache."""
        if self.window is None:
            return 0
        # The next query, at position num_computed_tokens, sees keys from num_computed_tokens - window + 1 on.
        first_needed = max(0, seq.num_computed_tokens - self.window + 1) // self.block_size
        released = 0
        i = min(first_needed, len(seq.block_ids)) - 1
        while i >= 0 and seq.block_ids[i] != FREED_BLOCK:  # released blocks are always a leading run
            self._unref(seq.block_ids[i])
            seq.block_ids[i] = FREED_BLOCK
            released += 1
            i -= 1
        return released

    def reset_prefix_cache(self) -> None:
        """Forget every cached-but-free block (used on restart and in tests)."""
        for block_id in self._free:
            block = self.blocks[block_id]
            if block.block_hash is not None:
                self._evict(block)
        self._events.append(KVEvent(KVEventKind.CLEARED))

    def check_invariants(self, refs: Mapping[int, int] | None = None) -> None:
        """Assert the bookkeeping is consistent (tests call this after stress runs). With refs
        (block id -> references the caller's sequences hold), also that ref counts equal them."""
        for block in self.blocks:
            assert (block.ref_count == 0) == (block.block_id in self._free), block
            if refs is not None:
                assert block.ref_count == refs.get(block.block_id, 0), (block, refs.get(block.block_id, 0))
            if block.block_hash is not None:
                assert block.token_ids is not None
        for block_hash, block_id in self._cached.items():
            assert self.blocks[block_id].block_hash == block_hash
