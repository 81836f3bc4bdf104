"""WorkerPools serves from one event loop. A caller on another thread's loop (a test harness, an
operator's tool) may read the pools, but must not start a second output pump per decode worker:
two long-polls would split the worker's outputs between them, and a stream could get its tokens
out of order (seen in tests/cluster/test_healing_node.py, whose harness reads the pools from its
own loop while the server's runs)."""

from __future__ import annotations

import asyncio
import threading
import time

from router.pools import WorkerPools
from tests.routing.fake_actors import FakeActor


class PollRecordingActor(FakeActor):
    """A decode actor whose long-polls say from which event loop they came and how many overlap."""

    def __init__(self, worker_id: str, role: str) -> None:
        super().__init__(worker_id, role)
        self.poll_loops: set[asyncio.AbstractEventLoop] = set()
        self.in_flight = self.most_in_flight = 0
        self._lock = threading.Lock()

    async def _poll_outputs(self, timeout_s, router=None):
        with self._lock:
            self.poll_loops.add(asyncio.get_running_loop())
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            await asyncio.sleep(timeout_s)
            return []
        finally:
            with self._lock:
                self.in_flight -= 1


async def _start(pools: WorkerPools) -> None:
    pools.ensure_started()


def test_reading_the_pools_from_another_event_loop_starts_no_second_output_pump():
    decode = PollRecordingActor("decode-0", "decode")
    pools = WorkerPools([FakeActor("prefill-0", "prefill"), decode], health_interval_s=0.05, poll_timeout_s=0.02)
    serving = asyncio.new_event_loop()
    thread = threading.Thread(target=serving.run_forever, daemon=True)
    thread.start()
    try:
        asyncio.run_coroutine_threadsafe(_start(pools), serving).result(5)

        async def read_from_another_loop():
            infos = pools.workers()
            await asyncio.sleep(0.3)  # long enough for several polls, had it started pumps here
            return infos

        infos = asyncio.run(read_from_another_loop())
        assert sorted(w.worker_id for w in infos) == ["decode-0", "prefill-0"]
        # The serving loop asks again after that loop has ended: its one pump goes on alone.
        asyncio.run_coroutine_threadsafe(_start(pools), serving).result(5)
        time.sleep(0.3)
        assert decode.poll_loops == {serving}
        assert decode.most_in_flight == 1
    finally:
        asyncio.run_coroutine_threadsafe(pools.close(), serving).result(5)
        serving.call_soon_threadsafe(serving.stop)
        thread.join(5)
        serving.close()


def test_a_new_loop_takes_over_the_pools_once_the_first_has_stopped():
    """A second router app over the same workers, after the first one's server stopped, serves them."""
    decode = PollRecordingActor("decode-0", "decode")
    pools = WorkerPools([FakeActor("prefill-0", "prefill"), decode], health_interval_s=0.05, poll_timeout_s=0.02)

    async def serve_a_while():
        pools.ensure_started()
        await asyncio.sleep(0.2)
        return asyncio.get_running_loop()

    first = asyncio.run(serve_a_while())
    second = asyncio.run(serve_a_while())
    assert decode.poll_loops == {first, second}
    assert decode.most_in_flight == 1
