"""PrefixIndex: events in, longest cached prefix per worker out; bounded; workers dropped whole."""

from __future__ import annotations

import pytest

from common.block_hash import hash_prefix_blocks
from common.protocol import KVEvent, KVEventKind
from router.prefix_index import PrefixIndex

BS = 4


def stored(hashes) -> KVEvent:
    return KVEvent(KVEventKind.STORED, tuple(hashes))


def test_match_counts_leading_blocks_per_worker():
    a = list(range(100, 120))  # 5 blocks
    h = hash_prefix_blocks(a, BS)
    index = PrefixIndex()
    index.apply("w1", [stored(h[:3])])
    index.apply("w2", [stored(h)])
    index.apply("w3", [stored(h[1:])])  # no first block: no prefix at all
    assert index.match(h) == {"w1": 3, "w2": 5}
    # A prompt that diverges after two blocks matches two blocks at most.
    b = a[:8] + [7, 7, 7, 7, 7, 7, 7, 7]
    assert index.match(hash_prefix_blocks(b, BS)) == {"w1": 2, "w2": 2}
    assert index.match([]) == {}


def test_removed_and_cleared_events_and_remove_worker():
    h = hash_prefix_blocks(list(range(16)), BS)
    index = PrefixIndex()
    index.apply("w1", [stored(h)])
    index.apply("w2", [stored(h)])
    index.apply("w1", [KVEvent(KVEventKind.REMOVED, (h[2],))])
    assert index.match(h) == {"w1": 2, "w2": 4}
    index.apply("w2", [KVEvent(KVEventKind.CLEARED)])
    assert index.match(h) == {"w1": 2}
    index.remove_worker("w1")
    assert index.match(h) == {} and index.num_blocks() == 0 and index.workers() == []
    assert index._by_hash == {}  # nothing left behind for a gone worker


def test_memory_is_bounded_per_worker_oldest_first():
    index = PrefixIndex(max_blocks_per_worker=10)
    hashes = list(range(1, 26))
    index.add("w", hashes)
    assert index.num_blocks("w") == 10
    assert index.match([15]) == {} and index.match([16]) == {"w": 1} and index.match([25]) == {"w": 1}
    assert len(index._by_hash) == 10


def test_snapshot_replaces_what_we_knew():
    index = PrefixIndex()
    index.add("w", [1, 2, 3])
    index.replace("w", [9])
    assert index.match([1]) == {} and index.match([9]) == {"w": 1}


def test_bad_bound_is_rejected():
    with pytest.raises(ValueError, match="max_blocks_per_worker"):
        PrefixIndex(max_blocks_per_worker=0)
