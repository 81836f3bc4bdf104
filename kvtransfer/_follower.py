"""The shm receiver's verifier thread: it follows the receives a sender is copying into our
segment and, through a callback of the transport (kvtransfer.shm), sums each chunk of blocks as
the sender counts it as landed, so that verifying a handoff overlaps its copy instead of
re-reading it afterwards; it also lands the receives that end.

It sleeps on the segment's FIFO (kvtransfer._segment.wake_path) while nothing is being copied; a
sender writes a byte into it when it calls send() and again when its copy starts.
"""

from __future__ import annotations

import enum
import os
import select
import threading
import time
from typing import Callable, Hashable, Optional

# Between looks at a copy in progress that had nothing new; how long without news before looking
# less often (a sender that died mid-copy is not polled at full speed); the longest sleep with
# nothing being copied (the thread then drops what ended meanwhile and notices expiries).
FOLLOW_POLL_S = 2e-5
STALLED_S = 0.002
MAX_STALLED_POLL_S = 0.005
IDLE_POLL_S = 0.05


class Progress(enum.Enum):
    """What one look at a followed receive found."""

    ENDED = "ended"  # terminal: stop following it
    WAITING = "waiting"  # its sender has not started copying
    COPYING = "copying"  # being copied, nothing new landed since the last look
    SUMMED = "summed"  # being copied, and the thread summed newly landed blocks


def wake(fd: Optional[int]) -> None:
    """Write a byte into a FIFO (our write end of a peer's, or our own), ignoring a full one
    (its reader is awake anyway) and a reader that is gone."""
    if fd is not None:
        try:
            os.write(fd, b"\x01")
        except OSError:
            pass


class Follower:
    """One thread per receiving transport, started with its first receive. `look(item)` is the
    transport's step for one followed receive; `closed()` says when the thread should end."""

    def __init__(self, wake_fd: Optional[int], look: Callable[[Hashable], Progress],
                 closed: Callable[[], bool]) -> None:
        self._wake_fd, self._look, self._closed = wake_fd, look, closed
        self._lock = threading.Lock()
        self._items: set = set()
        self._thread: Optional[threading.Thread] = None

    def follow(self, item: Hashable) -> None:
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
