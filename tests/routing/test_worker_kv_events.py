"""EngineWorker side of KV events: drained on the engine thread after each step into a bounded
buffer, handed over with the stats in one `heartbeat`, replaced by a snapshot after an overflow."""

from __future__ import annotations

from types import SimpleNamespace

from common.lora import LoRAStatus
from common.protocol import KVEvent, KVEventKind, SpecDecodeStats
from common.sampling_params import SamplingParams
from workers.engine.block_manager import BlockManager
from workers.engine.sequence import Sequence
from workers.shell.worker import EngineWorker, WorkerConfig


class _Engine:
    grammars = None  # no structured output here

    def __init__(self) -> None:
        self.block_manager = BlockManager(num_blocks=8, block_size=4)

    def has_schedulable_work(self) -> bool:
        return False

    def stats(self):
        bm = self.block_manager
        return SimpleNamespace(
            num_running=0,
            num_waiting=0,
            kv_usage=bm.usage,
            num_blocks=bm.num_blocks,
            num_free_blocks=bm.num_free_blocks,
            prefix_cache_queries=0,
            prefix_cache_hits=0,
            num_preemptions=0,
            spec_decode=SpecDecodeStats(),
            lora=LoRAStatus(),
        )


def cache_blocks(bm: BlockManager, tokens: list[int]) -> None:
    """Compute a prompt's blocks and free them: its full blocks stay in the prefix cache."""
    seq = Sequence("s", tokens, SamplingParams())
    assert bm.allocate_prefix_and_new(seq, [], len(tokens))
    seq.num_computed_tokens = len(tokens)
    bm.cache_computed_blocks(seq)
    bm.free(seq)


def make_worker() -> tuple[EngineWorker, BlockManager]:
    engine = _Engine()
    return EngineWorker(WorkerConfig("decode-0", "decode"), engine=engine), engine.block_manager


def test_heartbeat_carries_events_in_order_once():
    worker, bm = make_worker()
    try:
        worker._call(
            lambda: bm._events.extend([KVEvent(KVEventKind.STORED, (1, 2)), KVEvent(KVEventKind.REMOVED, (1,))])
        )
        beat = worker.heartbeat()
        assert beat.stats.worker_id == "decode-0" and beat.kv_events.block_size == 4
        assert [(e.kind, e.block_hashes) for e in beat.kv_events.events] == [
            (KVEventKind.STORED, (1, 2)),
            (KVEventKind.REMOVED, (1,)),
        ]
        assert beat.kv_events.snapshot is None
        assert worker.heartbeat().kv_events.events == []  # handed over once
    finally:
        worker.shutdown()


def test_overflow_sends_a_snapshot_of_the_cache_instead():
    worker, bm = make_worker()
    try:

        def flood():
            cache_blocks(bm, list(range(8)))  # what the cache holds now: two full blocks
            for i in range(worker.leases.max_kv_event_hashes + 10):
                bm._events.append(KVEvent(KVEventKind.STORED, (10_000 + i,)))

        worker._call(flood)
        worker._call(lambda: None)  # one more loop turn: the drain after the command ran
        assert worker.leases.pending_kv_hashes() == 0  # the buffer did not grow past its bound
        batch = worker.heartbeat().kv_events
        assert batch.events == [] and len(batch.snapshot) == 2
        assert sorted(batch.snapshot) == sorted(worker._call(bm.cached_hashes))
        assert worker.heartbeat().kv_events.snapshot is None  # back to plain events
    finally:
        worker.shutdown()
