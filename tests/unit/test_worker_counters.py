"""The worker's counters are added to from Ray call threads and the engine thread at once."""

from __future__ import annotations

import sys
import threading

import pytest

from workers.shell.worker import Counters


@pytest.fixture
def tiny_switch_interval():
    """Switch threads every few bytecodes, so an unlocked read-modify-write would lose updates."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(old)


def test_counters_lose_nothing_under_many_threads(tiny_switch_interval):
    counters = Counters("prompt_tokens", "kv_blocks_sent", "kv_bytes_sent")
    threads, adds = 8, 5000
    start = threading.Barrier(threads + 1)
    seen_torn: list[dict[str, int]] = []

    def hammer(i: int) -> None:
        start.wait()
        for _ in range(adds):
            counters.add(prompt_tokens=1)
            counters.add(kv_blocks_sent=1, kv_bytes_sent=4096)

    def read() -> None:
        start.wait()
        for _ in range(adds):
            snap = counters.snapshot()
            if snap["kv_bytes_sent"] != 4096 * snap["kv_blocks_sent"]:
                seen_torn.append(snap)

    workers = [threading.Thread(target=hammer, args=(i,)) for i in range(threads)] + [threading.Thread(target=read)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    assert counters.snapshot() == {
        "prompt_tokens": threads * adds,
        "kv_blocks_sent": threads * adds,
        "kv_bytes_sent": threads * adds * 4096,
    }
    assert seen_torn == []  # one add of several counters is seen whole or not at all


def test_unknown_counter_is_refused_by_name():
    counters = Counters("prompt_tokens")
    with pytest.raises(KeyError, match="unknown counter 'prompt_token'"):
        counters.add(prompt_token=1)
    assert counters.snapshot() == {"prompt_tokens": 0}
