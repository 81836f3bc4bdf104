"""A non-zero rank of a tensor-parallel worker: its shard of the model, its KV cache (its heads of
every block) and its own KV transport. It schedules nothing: it runs each step rank 0 broadcasts
(`ModelRunner.follow`) on a thread of its own, and moves its heads of a request's blocks when
rank 0 says so (rank 0's `EngineWorker` drives it through `RankFollowers`). Without Ray, like
`workers.shell.worker`; `workers.shell.actors` wraps it as an actor.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from common.protocol import KVEndpoint
from kvtransfer import TransferResult, TransferStatus
from kvtransfer.base import TransferSide as TransferRole
from kvtransfer.resharding import HeadLink, LinkResult
from workers.config import WorkerConfig
from workers.engine.model_runner import ModelRunner
from workers.parallel.group import TPGroup, TPGroupBroken
from workers.parallel.shard import build_rank_shard

log = logging.getLogger(__name__)


class RankFollowers(Protocol):
    """Ranks 1..N-1 of a tensor-parallel worker as rank 0 drives their KV transfers (each rank moves
    its own heads, kvtransfer.resharding says to which peer ranks; `workers.parallel.rank` is a rank,
    `workers.shell.actors` reaches them over Ray). `peers` are the peer worker's ranks in order; lists
    of results are in rank order."""

    def endpoints(self) -> list[KVEndpoint]: ...

    def pids(self) -> list[int]:
        """The ranks' processes (the admin endpoint and the dashboard show a worker's group)."""

    def connect(self, peers: Sequence[KVEndpoint]) -> None: ...

    def expect(self, request_id: str, block_ids: list[int], timeout_s: float) -> None: ...

    def wait(self, request_id: str) -> list[TransferResult]: ...

    def send(
        self,
        peers: Sequence[KVEndpoint],
        src_block_ids: list[int],
        dst_block_ids: list[int],
        request_id: str,
        timeout_s: float,
    ) -> Callable[[], list[LinkResult]]:
        """Start every follower's sends; returns the function that waits for their links' results."""

    def abort(self, request_id: str) -> None: ...

    def closing(self) -> None:
        """Rank 0 is shutting down: the ranks' steps end now by its word, not by a loss."""

    def lost(self, exc: Exception) -> None:
        """Rank 0's step found the group broken (a rank is gone): end the worker, which restarts as
        a whole while its requests move (returns only where nothing restarts it)."""

    def shutdown(self) -> None: ...


class TPRankWorker:
    def __init__(self, config: WorkerConfig, rank: int) -> None:
        if not 0 < rank < config.tp_size or not config.tp_init_method:
            raise ValueError(
                f"worker {config.worker_id}: rank {rank} needs 0 < rank < tp_size ({config.tp_size}) "
                f"and the group's tp_init_method"
            )
        self.name = f"{config.worker_id}.tp{rank}"
        if config.engine.num_threads:
            torch.set_num_threads(config.engine.num_threads)
        group = TPGroup.connect(rank, config.tp_size, config.tp_init_method, config.engine.device)
        shard = build_rank_shard(config, group)
        self.runner = ModelRunner(
            shard.model_config,
            shard.engine_config,
            shard.model,
            kv_cache=shard.kv_cache,
            tp_group=group,
            lora_sharding=shard.lora_sharding,
        )
        self.rank = rank
        self.kv = shard.kv
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._follow, name=f"steps-{self.name}", daemon=True)
        self._thread.start()

    def _follow(self) -> None:
        try:
            steps = self.runner.follow()
            log.info("%s: rank 0 ended the steps after %d", self.name, steps)
        except TPGroupBroken as exc:
            log.error("%s: %s", self.name, exc)
        except Exception:
            log.exception("%s: a step failed; this rank stops (its group restarts)", self.name)
        finally:
            self._stopped.set()

    def endpoint(self) -> KVEndpoint:
        return self.kv.endpoint()

    def pid(self) -> int:
        return os.getpid()

    def connect_peer(self, peers: Sequence[KVEndpoint]) -> list[HeadLink]:
        """Connect to the peer ranks this rank sends to (KVLayoutMismatch names the field that
        differs); the transports connect once per peer, however many calls ask at once."""
        return self.kv.connect(peers)

    def expect(self, request_id: str, block_ids: list[int], timeout_s: float) -> None:
        self.kv.expect(request_id, block_ids, timeout_s)

    def wait(self, request_id: str) -> TransferResult:
        """The end of the transfers into this rank's blocks that expect() announced."""
        return self.kv.wait_received(request_id)

    def send(
        self,
        peers: Sequence[KVEndpoint],
        src_block_ids: list[int],
        dst_block_ids: list[int],
        request_id: str,
        timeout_s: float,
    ) -> list[LinkResult]:
        """Push this rank's heads of src_block_ids into the peer ranks' dst_block_ids; waits for the end."""
        started = time.perf_counter()
        try:
            return self.kv.wait_sent(self.kv.send(peers, src_block_ids, dst_block_ids, request_id, timeout_s))
        except Exception as exc:  # a failed rank fails the request's transfer, which the policy handles
            failed = TransferResult(
                request_id,
                TransferRole.SEND,
                TransferStatus.FAILED,
                0,
                time.perf_counter() - started,
                f"{self.name}: {exc!r}",
            )
            return [LinkResult(HeadLink(self.rank, -1, self.kv.heads), failed)]

    def abort(self, request_id: str) -> None:
        self.kv.abort(request_id)

    def wait_stopped(self, timeout_s: float | None = None) -> bool:
        """Whether this rank's steps have ended (rank 0 ended them, or the group broke)."""
        return self._stopped.wait(timeout_s)

    def shutdown(self) -> None:
        self._stopped.wait(5)
        self.kv.close()
