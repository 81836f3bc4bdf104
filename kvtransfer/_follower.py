"""The shm receiver's verifier thread: it follows the receives a sender is copying into our
segment and sums each chunk of blocks as the sender counts it as landed, so that verifying a
handoff overlaps its copy instead of re-reading it afterwards (which would cost the receiver
about the copy's time again); it also lands the receives that end.

The sender's native copy publishes in the slot, every `verify_chunk_bytes` of whole blocks, how
many blocks have landed (LANDED). Once a copy is under way, one look (the transport's step,
kvtransfer.shm) follows it to its end in one native call (kernels.block_checksum.BlockSummer.follow)
that waits between chunks on its core instead of sleeping: on a loaded machine each wake-up can
take longer than the copy has left (with a Python look and a sleep per chunk, a 16 MiB handoff's
check ended 0.3-1.4 ms after its copy on the busy development VM; in one call, 0.1 ms when the
thread has a core: bench/results/kv_transfer_checksum*.json, docs/performance.md). The comparison
still happens only at SUCCESS, over
every block (those not summed yet are summed then), so nothing is SUCCESS on the receiver before
all its blocks were read and matched. This relies on a sender writing each destination block
once, before counting it as landed (the ids are unique; the copy is one pass). Injected faults
spoil blocks before they count as landed (a fault in transit); the fallback copies (no native
kernels) publish no count.

The thread sleeps on the segment's FIFO (kvtransfer._segment.wake_path) while nothing is being
copied; a sender writes a byte into it when it calls send() and again when its copy starts.
"""

from __future__ import annotations

import enum
import os
import select
import threading
import time
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

# Between looks at a copy in progress that had nothing new; how long without news before looking
# less often (a sender that died mid-copy is not polled at full speed); the longest sleep with
# nothing being copied (the thread then drops what ended meanwhile and notices expiries).
FOLLOW_POLL_S = 2e-5
STALLED_S = 0.002
MAX_STALLED_POLL_S = 0.005
IDLE_POLL_S = 0.05
# How long one native follow of a copy waits, on its core, for the next chunk before it hands back
# to the loop (which then sleeps, backing off): several chunks' copy time, so that a sender that
# lost its core for a moment costs no sleep and wake-up.
FOLLOW_WAIT_S = 0.001


class Progress(enum.Enum):
    """What one look at a followed receive found."""

    ENDED = "ended"  # terminal: stop following it
    WAITING = "waiting"  # its sender has not started copying
    COPYING = "copying"  # being copied, nothing new landed since the last look
    SUMMED = "summed"  # being copied, and the thread summed newly landed blocks


def wake(fd: int | None) -> None:
    """Write a byte into a FIFO (our write end of a peer's, or our own), ignoring a full one
    (its reader is awake anyway) and a reader that is gone."""
    if fd is not None:
        try:
            os.write(fd, b"\x01")
        except OSError:
            pass


Item = TypeVar("Item", bound=Hashable)  # what the transport follows a receive by (its record)


class Follower(Generic[Item]):
    """One thread per receiving transport, started with its first receive. `look(item)` is the
    transport's step for one followed receive; `closed()` says when the thread should end."""

    def __init__(self, wake_fd: int | None, look: Callable[[Item], Progress], closed: Callable[[], bool]) -> None:
        self._wake_fd, self._look, self._closed = wake_fd, look, closed
        self._lock = threading.Lock()
        self._items: set[Item] = set()
        self._thread: threading.Thread | None = None

    def follow(self, item: Item) -> None:
        with self._lock:
            self._items.add(item)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True, name="kv-shm-verify")
                self._thread.start()

    def stop(self) -> None:
        """After `closed()` turned true: wake the thread and wait for it to end."""
        wake(self._wake_fd)
        if self._thread is not None:
            self._thread.join(timeout=2.0)
        with self._lock:
            self._items.clear()

    def _run(self) -> None:
        pause, quiet_since, woken = FOLLOW_POLL_S, time.monotonic(), False
        while not self._closed():
            with self._lock:
                items = list(self._items)
            copying = summed = False
            for item in items:
                try:
                    progress = self._look(item)
                except Exception:
                    if self._closed():  # the segment went away under us
                        return
                    raise
                if progress == Progress.ENDED:
                    with self._lock:
                        self._items.discard(item)
                copying = copying or progress in (Progress.COPYING, Progress.SUMMED)
                summed = summed or progress == Progress.SUMMED
            now = time.monotonic()
            if summed or woken:
                pause, quiet_since = FOLLOW_POLL_S, now
            if summed:
                continue  # more may have landed meanwhile
            if items and (copying or now - quiet_since < STALLED_S):
                woken = self._sleep(pause)
                if now - quiet_since > STALLED_S:
                    pause = min(pause * 2, MAX_STALLED_POLL_S)
            else:
                pause = FOLLOW_POLL_S
                woken = self._sleep(IDLE_POLL_S)

    def _sleep(self, timeout: float) -> bool:
        """Until a byte arrives in our FIFO or `timeout` passes; True when woken. Without a FIFO,
        a plain sleep."""
        fd = self._wake_fd
        if fd is None:
            time.sleep(timeout)
            return False
        ready, _, _ = select.select([fd], [], [], timeout)
        if not ready:
            return False
        try:
            while os.read(fd, 4096):
                pass
        except OSError:  # drained (EAGAIN)
            pass
        return True
