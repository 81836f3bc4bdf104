"""The shared-memory segment behind the shm transport: its layout (header, slot table, seal
table, then the cache), mapping it, and sweeping segments whose owner died (see kvtransfer.shm)."""

from __future__ import annotations

import fcntl
import mmap
import os
import struct
import tempfile
import threading
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from common.protocol import KVLayout

from ._common import block_rows, byte_view
from .base import torch_dtype

MAGIC = 0x4B56_4241_544F_4E31  # "KVBATON1"
HEADER_INTS = 8
SLOT_COLS = 9  # kvtransfer.shm names the columns; the first holds the transfer key
KEY_COL = 0
PAGE = 4096


def shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def process_start(pid: int) -> Optional[int]:
    """Start time (clock ticks since boot) of a live process, None if it does not exist;
    with the pid it identifies a process even after pid reuse."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


def sweep_stale_segments(directory: Optional[str] = None) -> list[str]:
    """Unlink this user's Baton KV segments whose owning process is gone; returns them."""
    directory = directory or shm_dir()
    removed: list[str] = []
    if not os.path.isdir("/proc"):
        return removed  # liveness cannot be told here
    for name in os.listdir(directory):
        if not name.startswith("baton_kv_"):
            continue
        path = os.path.join(directory, name)
        try:
            if os.stat(path).st_uid != os.getuid():
                continue
            with open(path, "rb") as f:
                head = f.read(7 * 8)
        except OSError:
            continue
        if len(head) < 7 * 8:
            continue
        magic, _, _, _, _, pid, start = struct.unpack("<7q", head)
        if magic != MAGIC or pid <= 0:
            continue  # header not written yet: being created
        if process_start(pid) == start:
            continue
        try:
            os.unlink(path)
            removed.append(path)
        except FileNotFoundError:
            pass
    return removed


@dataclass
class Segment:
    """A mapped segment: slot table + cache bytes."""

    path: str
    fd: int
    mm: mmap.mmap
    slots: np.ndarray
    seals: np.ndarray  # uint64 [num_blocks]: the seal of the block last sent into each block id
    cache_bytes: torch.Tensor  # uint8 [L, 2, N, bs, Hk, D * itemsize]
    rows: np.ndarray  # block_rows(cache_bytes), made once: the send path copies through it
    owner: bool
    thread_lock: threading.Lock

    def locked(self) -> "Segment":
        """`with seg.locked():` holds the segment lock (a plain context manager, not a
        generator one: this is on every transfer's path)."""
        return self

    def __enter__(self) -> "Segment":
        # flock excludes other processes (and other open()s); the thread lock excludes
        # threads sharing this fd, which flock does not.
        self.thread_lock.acquire()
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX)
        except BaseException:
            self.thread_lock.release()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
        finally:
            self.thread_lock.release()

    def find(self, key: int) -> int:
        """Slot holding `key`, or -1. Looks at the key's home slot first (where expect()
        puts it unless taken): a scan of the whole table is slow in a process that was
        just woken up."""
        home = key % len(self.slots)
        if self.slots[home, KEY_COL] == key:
            return home
        found = np.flatnonzero(self.slots[:, KEY_COL] == key)
        return int(found[0]) if len(found) else -1


def layout_bytes(layout: KVLayout, num_blocks: int, num_slots: int) -> tuple[int, int]:
    table = HEADER_INTS * 8 + num_slots * SLOT_COLS * 8 + num_blocks * 8
    offset = (table + PAGE - 1) // PAGE * PAGE
    return offset, num_blocks * layout.block_bytes


def map_segment(path: str, fd: int, size: int, layout: KVLayout, num_blocks: int, num_slots: int,
         owner: bool) -> Segment:
    # MAP_POPULATE: build the page tables now. Otherwise the first copy into each page of a
    # peer's cache pays a page fault.
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
    mm = mmap.mmap(fd, size, flags=flags)
    offset, nbytes = layout_bytes(layout, num_blocks, num_slots)
    raw = torch.frombuffer(mm, dtype=torch.uint8)
    shape = layout.cache_shape(num_blocks)
    cache = raw[offset:offset + nbytes].view(torch_dtype(layout)).view(shape)
    slots = np.ndarray((num_slots, SLOT_COLS), dtype=np.int64, buffer=mm, offset=HEADER_INTS * 8)
    seals = np.ndarray((num_blocks,), dtype=np.uint64, buffer=mm,
                       offset=HEADER_INTS * 8 + num_slots * SLOT_COLS * 8)
    cache_bytes = byte_view(cache)
    return Segment(path, fd, mm, slots, seals, cache_bytes, block_rows(cache_bytes), owner,
                    threading.Lock())
