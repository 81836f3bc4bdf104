"""The shared-memory segment behind the shm transport: its layout (header, slot table, seal
table, then the cache), mapping it, its wake-up FIFO, and sweeping segments whose owner died (see
kvtransfer.shm)."""

from __future__ import annotations

import fcntl
import mmap
import os
import struct
import tempfile
import threading
from dataclasses import dataclass

import numpy as np
import torch

from common.protocol import KVLayout

from ._common import block_rows, byte_view
from .base import KVTransferError, TransferStatus, torch_dtype
from .integrity import FailureReason

MAGIC = 0x4B56_4241_544F_4E31  # "KVBATON1"
HEADER_INTS = 8
# The slot table's columns: key, state, dst-id fingerprint, num_blocks, reason, receiver deadline
# (CLOCK_MONOTONIC ns, which is system-wide, so both processes on the node can compare it), and the
# sender's manifest: the key and layout tag it sealed with and how many blocks it vouches for
# (UNSEALED: not sealed), and how many blocks (in transfer order) a sealing sender's copy has landed.
SLOT_COLS = 10
KEY, STATE, HASH, NBLOCKS, REASON, DEADLINE, SENT_KEY, SENT_TAG, SENT_BLOCKS, LANDED = range(SLOT_COLS)
UNSEALED = -1
REASONS = {  # the slot's reason codes
    0: "",
    1: "sender's dst_block_ids differ from the receiver's",
    2: "aborted by the sender",
    3: "aborted by the receiver",
    4: "receiver deadline passed",
}
# The FailureReason behind each reason code.
REASON_KINDS = {
    1: FailureReason.IDS_MISMATCH,
    2: FailureReason.ABORTED,
    3: FailureReason.ABORTED,
    4: FailureReason.DEADLINE,
}
# The slot states as plain ints, which the send path compares against (an IntEnum round trip per
# field read is measurable at this scale).
PENDING, TRANSFERRING, SUCCESS, FAILED, ABORTED = (
    int(TransferStatus.PENDING),
    int(TransferStatus.TRANSFERRING),
    int(TransferStatus.SUCCESS),
    int(TransferStatus.FAILED),
    int(TransferStatus.ABORTED),
)
PAGE = 4096
FAULT_IN_PAGES = 1024  # pages touched per call by fault_in_background (4 MiB)


def shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


WAKE_SUFFIX = ".wake"


def wake_path(segment_path: str) -> str:
    """The FIFO beside a segment: a sender writes a byte into it when it starts a sealed copy, which
    wakes the owner's verifier thread at once (kvtransfer.shm) instead of it polling the slots."""
    return segment_path + WAKE_SUFFIX


def make_wake_fifo(segment_path: str) -> int | None:
    """Create the owner's FIFO and open it for reading without blocking (O_RDWR: opening does not
    wait for a writer, and writers never get EPIPE while the owner lives); None where FIFOs are
    not available (the verifier thread then polls)."""
    path = wake_path(segment_path)
    try:
        os.mkfifo(path, 0o600)
        return os.open(path, os.O_RDWR | os.O_NONBLOCK)
    except (AttributeError, OSError):
        return None


def open_waker(segment_path: str) -> int | None:
    """A sender's write end of a peer's FIFO, or None (no FIFO, or nobody reading it)."""
    try:
        return os.open(wake_path(segment_path), os.O_WRONLY | os.O_NONBLOCK)
    except OSError:
        return None


def process_start(pid: int) -> int | None:
    """Start time (clock ticks since boot) of a live process, None if it does not exist;
    with the pid it identifies a process even after pid reuse."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


def owner_running(pid: int, start: int) -> bool:
    """Whether a segment header's owner (pid and start time) still runs; True while the header is
    not written yet (pid 0) and where liveness cannot be told (no /proc)."""
    return pid <= 0 or not os.path.isdir("/proc") or process_start(pid) == start


def sweep_stale_segments(directory: str | None = None) -> list[str]:
    """Unlink this user's Baton KV segments whose owning process is gone; returns them."""
    directory = directory or shm_dir()
    removed: list[str] = []
    if not os.path.isdir("/proc"):
        return removed  # liveness cannot be told here
    names = os.listdir(directory)
    for name in names:
        if not name.startswith("baton_kv_"):
            continue
        path = os.path.join(directory, name)
        if name.endswith(WAKE_SUFFIX):
            # Never open a FIFO here (reading one without a writer blocks): it goes with its segment.
            if name[: -len(WAKE_SUFFIX)] not in names:
                try:
                    os.unlink(path)
                except OSError:  # gone already, or another user's
                    pass
            continue
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
        if magic != MAGIC or owner_running(pid, start):
            continue  # header not written yet (being created), or its owner lives
        try:
            os.unlink(path)
            removed.append(path)
        except FileNotFoundError:
            pass
        try:
            os.unlink(wake_path(path))
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

    def locked(self) -> Segment:
        """`with seg.locked():` holds the segment lock (a plain context manager, not a
        generator one: this is on every transfer's path)."""
        return self

    def __enter__(self) -> Segment:
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

    def owner_alive(self) -> bool:
        """Whether the process that made this segment still runs (its pid and start time, in the
        header); True where that cannot be told (no /proc)."""
        pid, start = (int(v) for v in np.ndarray((2,), dtype=np.int64, buffer=self.mm, offset=5 * 8))
        return owner_running(pid, start)

    def find(self, key: int) -> int:
        """Slot holding `key`, or -1. Looks at the key's home slot first (where expect()
        puts it unless taken): a scan of the whole table is slow in a process that was
        just woken up."""
        home = key % len(self.slots)
        if self.slots[home, KEY] == key:
            return home
        found = np.flatnonzero(self.slots[:, KEY] == key)
        return int(found[0]) if len(found) else -1

    def free_slot(self, key: int, live: set) -> int:
        """Where expect() puts `key`: a slot already holding it (an id reused after its earlier
        transfer ended, so that a key is never in two slots), else its home slot, else any free
        one, else one left terminal for late senders that is not in `live` (the owner's slots
        of receives still in progress)."""
        slot = self.find(key)
        if slot >= 0:
            return slot
        keys = self.slots[:, KEY]
        home = key % len(keys)
        if keys[home] == 0:
            return home
        candidates = np.flatnonzero(keys == 0)
        if len(candidates):
            return int(candidates[0])
        for i in range(len(keys)):
            if i not in live and TransferStatus(int(self.slots[i, STATE])).is_terminal:
                return i
        raise KVTransferError(f"all {len(keys)} shm transfer slots are in use; raise num_slots")


def layout_bytes(layout: KVLayout, num_blocks: int, num_slots: int) -> tuple[int, int]:
    table = HEADER_INTS * 8 + num_slots * SLOT_COLS * 8 + num_blocks * 8
    offset = (table + PAGE - 1) // PAGE * PAGE
    return offset, num_blocks * layout.block_bytes


def open_peer_segment(path: str, layout: KVLayout, num_blocks: int, num_slots: int, peer_name: str) -> Segment:
    """Map a receiver's segment for sending into it, after checking its size and header."""
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        raise KVTransferError(
            f"shared memory segment {path} of peer {peer_name} does not exist (peer closed, or on another node?)"
        ) from None
    offset, nbytes = layout_bytes(layout, num_blocks, num_slots)
    size = os.fstat(fd).st_size
    if size != offset + nbytes:
        os.close(fd)
        raise KVTransferError(f"segment {path} has {size} bytes, expected {offset + nbytes}")
    seg = map_segment(path, fd, size, layout, num_blocks, num_slots, False)
    header = np.ndarray((HEADER_INTS,), dtype=np.int64, buffer=seg.mm)
    if int(header[0]) != MAGIC or int(header[2]) != num_blocks:
        os.close(fd)
        raise KVTransferError(f"segment {path} is not a Baton KV cache of {num_blocks} blocks")
    return seg


def map_segment(
    path: str, fd: int, size: int, layout: KVLayout, num_blocks: int, num_slots: int, owner: bool
) -> Segment:
    mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
    offset, nbytes = layout_bytes(layout, num_blocks, num_slots)
    raw = torch.frombuffer(mm, dtype=torch.uint8)
    fault_in_background(raw)
    shape = layout.cache_shape(num_blocks)
    cache = raw[offset : offset + nbytes].view(torch_dtype(layout)).view(shape)
    slots = np.ndarray((num_slots, SLOT_COLS), dtype=np.int64, buffer=mm, offset=HEADER_INTS * 8)
    seals = np.ndarray((num_blocks,), dtype=np.uint64, buffer=mm, offset=HEADER_INTS * 8 + num_slots * SLOT_COLS * 8)
    cache_bytes = byte_view(cache)
    return Segment(path, fd, mm, slots, seals, cache_bytes, block_rows(cache_bytes), owner, threading.Lock())


def fault_in_background(mapping: torch.Tensor) -> threading.Thread:
    """Fault every page of `mapping` in from a daemon thread at the lowest priority (niceness 19).

    Otherwise the first copy into each page of a cache pays a page fault: a 4 MiB transfer into
    untouched blocks took as long as a 16 MiB one into touched blocks. Doing it up front
    (MAP_POPULATE) made every worker's start about 1.2 s longer per GiB of cache, which a worker
    restarted by healing waits out again; in the background it uses time the host has spare.
    The thread only reads, one byte per page (for a shared mapping a read fault maps the page
    writable), so it never changes what the engine or a peer wrote, and a page fault holds no
    lock that the engine's own mmap calls wait for, as madvise(MADV_POPULATE_WRITE) would while
    this thread waits for a core."""

    def fault_in() -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except OSError:  # not permitted: it still runs, at the process's priority
            pass
        # numpy, not torch: a torch op still running in a daemon thread while the process exits
        # aborts it ("terminate called without an active exception").
        pages = mapping.numpy()[::PAGE]
        for start in range(0, len(pages), FAULT_IN_PAGES):
            pages[start : start + FAULT_IN_PAGES].max()  # numpy drops the GIL for loops this long

    thread = threading.Thread(target=fault_in, name="kv-fault-in", daemon=True)
    thread.start()
    return thread
