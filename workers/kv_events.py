"""KV events: which block hashes a worker's prefix cache gained or lost. The router's prefix index feeds on them."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class KVEventKind(enum.Enum):
    STORED = "stored"
    REMOVED = "removed"
    CLEARED = "cleared"  # the worker dropped its whole cache (restart, reset)


@dataclass(frozen=True)
class KVEvent:
    kind: KVEventKind
    block_hashes: tuple[int, ...] = ()
