"""A prefill worker's handoffs: each prompt's KV pushed into its decode worker's reserved blocks
once its first token is out, and the outcome queued for the request's router.

`EngineWorker.prefill` answers at once; the prompt waits in the engine like any other. When its
first token comes out of a step, the engine thread starts the send (`first_token`: taking the
blocks for reading there, before the next step can touch them) and hands the rest to a pool of
sender threads, so the engine goes on stepping while bytes move. The outcome, a `PrefillResult`
(the first token and what moved) or a `PrefillFailed`, goes to the router's outbox like tokens
do; the blocks go back to the engine either way. A prompt that has not come out of the engine
within its deadline fails the same way (`expired`), so the router prefills it elsewhere.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from common.protocol import PrefillFailed, PrefillResult, RequestOutput, WorkerOutput
from common.request import PrefillRequest
from kvtransfer import KVTransferError
from kvtransfer.resharding import RankKV, combined
from workers.parallel.rank import RankFollowers
from workers.shell.bookkeeping import Counters

__all__ = ["PendingPrefill", "PrefillSender"]

log = logging.getLogger(__name__)

# Handoffs in flight at once (each waits on its transport; the bytes move on the transport's own threads).
SENDER_THREADS = 8


@dataclass
class PendingPrefill:
    """A prefill queued in the engine, not yet at its first token."""

    request: PrefillRequest
    started: float  # time.perf_counter() when the call came
    deadline: float  # time.monotonic(): past it, the prefill fails


class PrefillSender:
    """The prefills of one worker, from the call to the outcome in the router's outbox."""

    def __init__(
        self,
        worker_id: str,
        kv: RankKV | None,
        followers: RankFollowers | None,
        block_size: int,
        tp_size: int,
        transfer_timeout_s: float,
        counters: Counters,
        deliver: Callable[[list[WorkerOutput]], None],
        release: Callable[[str], None],
    ) -> None:
        self.worker_id = worker_id
        self.kv = kv
        self.followers = followers
        self.block_size = block_size
        self.tp_size = tp_size
        self.transfer_timeout_s = transfer_timeout_s
        self.counters = counters
        self.deliver = deliver
        self.release = release  # queues the engine's release of the request's blocks (any thread)
        self.pending: dict[str, PendingPrefill] = {}  # engine thread only
        self._pool = ThreadPoolExecutor(SENDER_THREADS, thread_name_prefix=f"kv-send-{worker_id}")

    def expect(self, request: PrefillRequest) -> None:
        """Engine thread: the prompt is queued; its first token is this worker's to send on."""
        # A prompt gets as long to reach its first token as four transfers would take (a queue
        # that long means the pool is overloaded; the router's decode worker prefills it instead).
        deadline = time.monotonic() + 4 * self.transfer_timeout_s
        self.pending[request.request_id] = PendingPrefill(request, time.perf_counter(), deadline)

    def first_token(self, pending: PendingPrefill, out: RequestOutput, begin_send: Callable[[str], list[int]]) -> None:
        """Engine thread: the prompt's first token is out. Start the send here, not on a sender
        thread: by the time one could, this thread is inside the next step (a whole chunk of
        another prompt, seconds on a CPU), and this prompt's first token would wait for it."""
        rid = out.request_id
        prefill_s = time.perf_counter() - pending.started
        if pending.request.peer_endpoint is None or out.finished:  # nothing to send
            self.release(rid)
            namespace = pending.request.request.context.kv_namespace
            self.deliver([PrefillResult(out, 0, 0, 0.0, prefill_s, kv_namespace=namespace)])
            return
        try:
            src = begin_send(rid)
        except Exception as exc:
            self.release(rid)
            self.fail(rid, f"could not start sending the KV of {rid}: {exc}")
            return
        self._pool.submit(self._send, pending.request, out, src, prefill_s)

    def _send(self, request: PrefillRequest, out: RequestOutput, src: list[int], prefill_s: float) -> None:
        """A sender thread: push the blocks (every rank its heads, into the decode ranks that hold
        them: kvtransfer.resharding), then report."""
        rid = request.request_id
        try:
            result = self._transfer(request, src)
        except Exception as exc:  # the decode worker prefills it instead; nothing is decoded from it
            self.release(rid)  # queued before the outcome, as below: a call made on hearing of it runs after it
            log.warning("worker %s: the KV handoff of %s failed: %s", self.worker_id, rid, exc)
            self.fail(rid, f"the KV handoff of {rid} failed: {exc}")
            return
        # Queued, not waited for: the engine thread may be inside a long step, and the blocks only
        # return to the pool (the router needs the first token now).
        self.release(rid)
        sent, nbytes, seconds, rank_pairs = result
        self.counters.add(kv_blocks_sent=sent, kv_bytes_sent=nbytes)
        namespace = request.request.context.kv_namespace
        self.deliver([PrefillResult(out, sent, nbytes, seconds, prefill_s, rank_pairs, namespace)])

    def _transfer(self, request: PrefillRequest, src: list[int]) -> tuple[int, int, float, tuple]:
        """(blocks sent, bytes, seconds, rank pairs) of pushing `src` into the reserved blocks."""
        rid, peer = request.request_id, request.peer_endpoint
        assert peer is not None and self.kv is not None
        if len(src) != len(request.dst_block_ids):
            raise ValueError(
                f"request {rid}: {len(src)} KV blocks here, {len(request.dst_block_ids)} reserved on the decode worker"
            )
        skip = request.dst_num_cached_tokens // self.block_size
        peers = [peer, *peer.ranks]
        src_ids, dst_ids, timeout_s = src[skip:], request.dst_block_ids[skip:], self.transfer_timeout_s
        sends = self.kv.send(peers, src_ids, dst_ids, rid, timeout_s)
        others = None if self.followers is None else self.followers.send(peers, src_ids, dst_ids, rid, timeout_s)
        links = self.kv.wait_sent(sends) + (others() if others is not None else [])
        result = combined([link.result for link in links])
        rank_pairs: tuple[tuple[int, int, int], ...] = ()
        if self.tp_size > 1 or len(peers) > 1:
            rank_pairs = tuple((x.link.src_rank, x.link.dst_rank, x.result.nbytes) for x in links)
        if not result.ok:
            raise KVTransferError(f"KV transfer for {rid} ended {result.status.name}: {result.error}")
        return len(src) - skip, result.nbytes, result.seconds, rank_pairs

    def fail(self, request_id: str, message: str) -> None:
        self.deliver([PrefillFailed(request_id, message, time.time())])

    def expired(self, now: float) -> list[str]:
        """Engine thread: the prefills past their deadline (taken out of `pending`)."""
        gone = [rid for rid, p in self.pending.items() if p.deadline < now]
        for rid in gone:
            del self.pending[rid]
        return gone

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
