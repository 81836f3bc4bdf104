"""The autoscaler in a running deployment: the driver loop that feeds `cluster.autoscaler.Autoscaler`
the router's signals and hands its sizes to the pool manager, and its installation into the router's
app (it runs on the app's event loop from start-up).

`RouterSignals` reads the running router's request traces and worker snapshot; `AutoscalerLoop`
asks it every `interval_s`, decides, and calls `cluster.pool_manager.PoolManager.scale`;
`install_autoscaler` wires both into the FastAPI app. The decisions themselves live in
cluster/autoscaler.py, which imports none of this.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable

from cluster.autoscaler import Autoscaler, Signals, SignalSource, p90
from cluster.autoscaler_config import AutoscalerConfig
from common.roles import Role
from router.app import run_during_lifespan

__all__ = ["AutoscalerLoop", "RouterSignals", "install_autoscaler"]

log = logging.getLogger("baton.autoscaler")


class AutoscalerLoop:
    """The driver-side loop: every interval, signals from the router, sizes to the pool manager.

    `signals` reads the router (queue and trace data of the running app); `scale(prefill, decode)`
    is `PoolManager.scale`. Runs on the router's event loop until `stop()`.
    """

    def __init__(
        self, config: AutoscalerConfig, signals: SignalSource, scale: Callable[[int, int], Awaitable[object]]
    ) -> None:
        self.config = config
        self.autoscaler = Autoscaler(config)
        self._signals = signals
        self._scale = scale
        self._task: asyncio.Task | None = None
        self.actions: list[dict] = []

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.config.interval_s)
            try:
                s = self._signals()
                d = self.autoscaler.decide(s)
                if d.changes(s):
                    log.info(
                        "autoscaler: prefill %d -> %d, decode %d -> %d (%s)",
                        s.prefill_workers,
                        d.prefill_workers,
                        s.decode_workers,
                        d.decode_workers,
                        d.reason,
                    )
                    self.actions.append(
                        {
                            "t": s.now,
                            "from": [s.prefill_workers, s.decode_workers],
                            "to": [d.prefill_workers, d.decode_workers],
                            "reason": d.reason,
                        }
                    )
                    await self._scale(d.prefill_workers, d.decode_workers)
            except Exception:  # a failed scaling must not end the loop; the next interval retries
                log.exception("autoscaler step failed")

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self.run())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()


class RouterSignals:
    """The running router's signals: finished requests' traces (RouterMetrics.recent) for TTFT,
    TPOT and queue time, and the backend's worker snapshot for queues and the prefill pool's busy
    fraction (sampled at every call, averaged over the window)."""

    def __init__(self, metrics, backend, targets: Callable[[], tuple[int, int]], window_s: float) -> None:
        self.metrics = metrics
        self.backend = backend
        self.targets = targets
        self.window_s = window_s
        self._busy: deque[tuple[float, int, int]] = deque()

    def __call__(self) -> Signals:
        now = time.time()
        since = now - self.window_s
        traces = [tr for t, tr in list(self.metrics.recent) if t >= since and tr.error is None]
        ttft = [tr.ttft_s for tr in traces if tr.ttft_s is not None]
        tpot = [
            (tr.e2e_s - tr.ttft_s) / (tr.output_tokens - 1)
            for tr in traces
            if tr.e2e_s is not None and tr.ttft_s is not None and tr.output_tokens > 1
        ]
        queue = [tr.queue_s for tr in traces]
        workers = [w for w in self.backend.workers() if w.alive]
        prefill = [w for w in workers if w.role == Role.PREFILL]
        decode = [w for w in workers if w.role == Role.DECODE]
        self._busy.append((now, sum(1 for w in prefill if w.running or w.waiting), len(prefill)))
        while self._busy and self._busy[0][0] < since:
            self._busy.popleft()
        busy = sum(b for _, b, _ in self._busy) / max(1, sum(n for _, _, n in self._busy))
        p, d = self.targets()
        return Signals(
            now,
            p,
            d,
            p90(ttft),
            p90(tpot),
            sum(w.queued_prefill_tokens for w in workers),
            p90(queue),
            0.0,
            sum(w.running for w in decode),
            sum(w.waiting for w in decode),
            busy,
        )


def install_autoscaler(app, pools, backend, config: AutoscalerConfig) -> AutoscalerLoop:
    """Run the autoscaler on the router's event loop from start-up: signals from the app's metrics
    and the backend, sizes to the pool manager (`cluster.pool_manager.PoolManager.scale`)."""
    signals = RouterSignals(
        app.state.baton.metrics, backend, lambda: (pools.targets.prefill, pools.targets.decode), config.window_s
    )
    loop = AutoscalerLoop(config, signals, lambda p, d: pools.scale(prefill=p, decode=d))
    run_during_lifespan(app, loop.start, lambda _: loop.stop())
    app.state.autoscaler = loop
    return loop
