"""Block manager bookkeeping: reference counts, prefix hits, collision safety, LRU eviction."""

from __future__ import annotations

from common.protocol import KVEventKind
from common.sampling_params import SamplingParams
from workers.engine.block_manager import BlockManager
from workers.engine.sequence import Sequence


def seq(tokens, rid="r") -> Sequence:
    return Sequence(rid, list(tokens), SamplingParams())


def run_prefill(bm: BlockManager, s: Sequence) -> None:
    cached = bm.find_cached_prefix(s)
    assert bm.allocate_prefix_and_new(s, cached, s.num_tokens - len(cached) * bm.block_size)
    s.num_computed_tokens = s.num_tokens
    bm.cache_computed_blocks(s)


def test_shared_prefix_is_reused_with_ref_counts():
    bm = BlockManager(num_blocks=10, block_size=4)
    a = seq(range(10), "a")
    run_prefill(bm, a)
    b = seq(list(range(8)) + [50, 51, 52], "b")
    hits = bm.find_cached_prefix(b)
    assert hits == a.block_ids[:2]
    run_prefill(bm, b)
    assert bm.blocks[a.block_ids[0]].ref_count == 2
    assert b.num_computed_tokens == 11
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == 10
    bm.check_invariants()


def test_last_token_is_never_served_from_cache():
    bm = BlockManager(num_blocks=10, block_size=4)
    run_prefill(bm, seq(range(8), "a"))
    assert len(bm.find_cached_prefix(seq(range(8), "b"))) == 1  # 8 tokens: only block 0 may hit


def test_hash_collision_never_serves_other_tokens():
    bm = BlockManager(num_blocks=10, block_size=4)
    a = seq(range(9), "a")
    run_prefill(bm, a)
    # Forge a collision: b's first block hashes like a's but holds other tokens.
    b = seq([7, 7, 7, 7, 1, 2, 3, 4, 5], "b")
    bm._extend_hashes(b, 8)
    b.block_hashes[0] = a.block_hashes[0]
    assert bm.find_cached_prefix(b) == []


def test_lru_evicts_least_recently_freed_and_reports_it():
    bm = BlockManager(num_blocks=4, block_size=2)
    old, new = seq([1, 2, 3], "old"), seq([4, 5, 6], "new")
    run_prefill(bm, old)
    run_prefill(bm, new)
    bm.free(old)
    bm.free(new)
    bm.drain_events()
    grab = seq(range(20, 25), "grab")  # needs 3 blocks: 2 uncached first, then the oldest cached one
    assert bm.allocate_prefix_and_new(grab, [], 5)
    removed = [h for e in bm.drain_events() if e.kind is KVEventKind.REMOVED for h in e.block_hashes]
    assert removed == old.block_hashes[:1]
    assert bm.find_cached_prefix(seq([4, 5, 6, 7], "again")) != []  # the newer prefix survived


def test_allocation_refuses_without_room_and_changes_nothing():
    bm = BlockManager(num_blocks=2, block_size=4)
    s = seq(range(12))
    assert not bm.allocate_prefix_and_new(s, [], 12)
    assert bm.num_free_blocks == 2 and s.block_ids == []
