"""A worker: one engine driven by its own thread, its KV transport, and the calls the router makes.

Roles: a prefill worker runs prompts to their first token and pushes the prompt's KV blocks into a
decode worker's reserved blocks; a decode worker reserves blocks, waits for the KV, then decodes
in its continuous batch and queues outputs for the router to collect. A decode worker also runs
whole requests itself (local prefill). The class runs without Ray (tests use it directly);
`workers.actors` wraps it as Ray actors.

Threading: the engine is not thread-safe, so only the engine thread touches it. Calls from other
threads (Ray runs actor methods on a thread pool) queue closures to the engine thread and wait for
their result; the counters, added to from both, take a lock. Outputs go to an outbox that
`poll_outputs` drains in batches: one call carries every
request's new tokens, so streaming costs one RPC per step, not one per token.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass, replace

import torch

from common import envs
from common.protocol import (
    GrammarCounts,
    KVEndpoint,
    KVEventBatch,
    PrefillRequest,
    PrefillResult,
    RequestOutput,
    ResumeState,
    RouterClaim,
    WorkerHeartbeat,
    WorkerReady,
    WorkerStats,
)
from common.sampling_params import SamplingParams
from kvtransfer import KVTransferError, PeerLink
from kvtransfer.resharding import RankKV, combined
from workers.config import WorkerConfig
from workers.elastic_threads import core_sharing_for
from workers.engine import LLMEngine, load_tokenizer_decode
from workers.grammar import GrammarCache
from workers.kv_load import KVLoadFailures, PendingLoad, recompute
from workers.router_leases import RouterLeases
from workers.shard import build_rank_shard
from workers.tensor_parallel import TPGroup, TPGroupBroken
from workers.tp_rank import RankFollowers

log = logging.getLogger(__name__)

# A folder: every worker appends each engine step's shape and wall time to <worker id>.jsonl
# there (bench/profile_costs.py --served fits the simulator's cost model to a real server's steps).
STEP_LOG_ENV = envs.BATON_STEP_LOG_DIR.name


class RequestAborted(RuntimeError):
    """The request was aborted while a call was waiting on it."""


class AbortedIds:
    """The ids of the last `capacity` requests the router ended for good (engine thread only).

    A call that creates a request's state (submit, reserve, prefill) can reach a worker after the
    router's abort of that request did, when the two race through different Ray call threads; the
    state it made would then be held until the worker restarts. Creation calls check this list."""

    def __init__(self, capacity: int = 4096) -> None:
        self.capacity = capacity
        self._ids: OrderedDict[str, None] = OrderedDict()

    def add(self, request_id: str) -> None:
        self._ids[request_id] = None
        self._ids.move_to_end(request_id)
        while len(self._ids) > self.capacity:
            self._ids.popitem(last=False)

    def refuse(self, request_id: str) -> None:
        """Raise RequestAborted if the request was ended for good."""
        if request_id in self._ids:
            raise RequestAborted(f"request {request_id} was aborted before this call reached the worker")


@dataclass
class PendingPrefill:
    """A prefill call waiting on the engine thread for its prompt's first token."""

    done: Future  # set to (RequestOutput, the blocks to send or None)
    send: bool  # the KV goes to a peer: the send starts on the engine thread as the prefill ends


class Counters:
    """Named integer counters that any thread may add to (Ray call threads and the engine thread)."""

    def __init__(self, *names: str) -> None:
        self._values = dict.fromkeys(names, 0)
        self._lock = threading.Lock()

    def add(self, **deltas: int) -> None:
        """Add to one or more counters at once (readers see all of them or none)."""
        with self._lock:
            for name, delta in deltas.items():
                if name not in self._values:
                    raise KeyError(f"unknown counter {name!r}; known: {sorted(self._values)}")
                self._values[name] += delta

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._values)


class EngineWorker:
    def __init__(
        self, config: WorkerConfig, engine=None, kv: RankKV | None = None, followers: RankFollowers | None = None
    ) -> None:
        """Without `engine`, the worker loads its own (and its KV transports); with one, `kv` gives
        the transports (None: the worker moves no KV). `followers`: the other ranks of a
        tensor-parallel worker (config.tp_size > 1), whose constructors are joining the group at
        config.tp_init_method as this one does."""
        self.config = config
        self.worker_id = config.worker_id
        self.role = config.role
        self.followers = followers
        if engine is None:
            group = None
            if config.tp_size > 1:
                if followers is None or not config.tp_init_method:
                    raise ValueError(
                        f"worker {config.worker_id}: tensor-parallel size {config.tp_size} needs its "
                        f"other ranks and the group's tp_init_method"
                    )
                group = TPGroup.connect(0, config.tp_size, config.tp_init_method, config.engine.device)
            engine, kv = _build_engine_and_kv(config, group)
        self.engine = engine
        self.kv = kv
        self.transport = kv.transport if kv is not None else None  # this rank's own cache's
        self._step_log = None
        self._stop_step_log = None
        step_log_dir = envs.step_log_dir()
        if step_log_dir:
            self._step_log = open(os.path.join(step_log_dir, f"{self.worker_id}.jsonl"), "a", buffering=1)
            self._stop_step_log = engine.observe_steps(self._log_step)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._prefills: dict[str, PendingPrefill] = {}
        self._aborted = AbortedIds()
        self._recv_handles: dict[str, object] = {}
        self.counters = Counters(
            "kv_blocks_sent", "kv_bytes_sent", "kv_blocks_received", "prompt_tokens", "generation_tokens"
        )
        self.kv_failures = KVLoadFailures(self.worker_id, config.kv_load_failure_policy)  # workers.kv_load
        # Per router (workers.router_leases): its requests, outbox, lease and KV events drained from
        # the engine after every step (bounded: past the bound that router gets a snapshot instead).
        self.leases = RouterLeases(max(1024, 4 * engine.block_manager.num_blocks))
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"engine-{self.worker_id}", daemon=True)
        self._thread.start()

    # ---- engine thread -------------------------------------------------------------------
    def _loop(self) -> None:
        engine = self.engine
        # OpenMP's thread count is per calling thread: the governor must live on this one.
        cores = core_sharing_for(self.config)
        while not self._stopped.is_set():
            block = not engine.has_schedulable_work()
            if block:
                cores.idle()
            try:
                while True:
                    fn, fut = self._commands.get(block=block, timeout=0.5 if block else None)
                    block = False
                    try:
                        fut.set_result(fn())
                    except BaseException as exc:  # the caller's thread re-raises it
                        fut.set_exception(exc)
            except queue.Empty:
                pass
            if engine.has_schedulable_work():
                cores.before_step()
                try:
                    self._dispatch(engine.step())
                except Exception as exc:  # a failed step must fail its requests, not hang them
                    if isinstance(exc, TPGroupBroken) and self.followers is not None:
                        self.followers.lost(exc)  # unless the worker restarts as a whole first: they move
                    self._fail_all(exc)
                finally:
                    cores.after_step()
            self._drain_kv_events()
            self._end_expired_leases()
        cores.close()

    def _drain_kv_events(self) -> None:
        self.leases.publish_kv_events(self.engine.block_manager.drain_events())

    def _take_kv_events(self, router: RouterClaim | None = None) -> KVEventBatch:
        """Engine thread: hand the router its buffered events (or a snapshot: new router, overflow)."""
        self._drain_kv_events()
        bm = self.engine.block_manager
        return self.leases.take_kv_events(router, bm.cached_hashes, bm.block_size)

    def _end_expired_leases(self) -> None:
        """Engine thread: a router whose lease ran out is gone; end its requests and free their blocks."""
        for lease in self.leases.take_expired():
            log.warning(
                "worker %s: router %s renewed no lease for %.1f s; aborting its %d requests",
                self.worker_id,
                lease.router_id,
                lease.term_s,
                len(lease.request_ids),
            )
            for request_id in lease.request_ids:
                if self._recv_handles.pop(request_id, None) is not None:
                    self._abort_transfer(request_id)
                self._abort_here(request_id, True, "was ended: its router is gone")  # a send releases after

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        ready = []
        now = time.time()
        for out in outputs:
            out.created_at = now
            self.counters.add(generation_tokens=len(out.token_ids))
            pending = self._prefills.pop(out.request_id, None)
            if pending is not None:
                self._prefilled(pending, out)
            else:
                ready.append(out)
        if ready:
            self.leases.deliver(ready)

    def _prefilled(self, pending: PendingPrefill, out: RequestOutput) -> None:
        # begin_send here, not from the waiting call's thread: by the time that thread could queue
        # it, this thread is inside the next step (a whole chunk of another prompt, seconds on a
        # CPU), and this prompt's first token would wait for it.
        try:
            src = self.engine.begin_send(out.request_id) if pending.send and not out.finished else None
        except Exception as exc:
            pending.done.set_exception(exc)
            return
        pending.done.set_result((out, src))

    def _fail_all(self, exc: Exception) -> None:
        failed = []
        for request_id in self.engine.abort_all():
            pending = self._prefills.pop(request_id, None)
            if pending is not None:
                pending.done.set_exception(exc)
            else:
                failed.append(RequestOutput(request_id, [], finished=True, finish_reason="abort"))
        self.leases.deliver(failed)

    def _call(self, fn, timeout_s: float | None = 60.0):
        fut: Future = Future()
        self._commands.put((fn, fut))
        return fut.result(timeout=timeout_s)

    def _post(self, fn) -> None:
        """Queue fn for the engine thread without waiting for it (a failure is logged)."""

        def report(fut: Future) -> None:
            if fut.exception() is not None:
                log.error("worker %s: a queued engine call failed: %r", self.worker_id, fut.exception())

        fut: Future = Future()
        fut.add_done_callback(report)
        self._commands.put((fn, fut))

    # ---- calls ---------------------------------------------------------------------------
    def ready(self) -> WorkerReady:
        """The start-up report: this worker's real limits (the engine's, fixed once it is built)."""
        engine = self.engine
        return WorkerReady(
            worker_id=self.worker_id,
            role=self.role,
            max_model_len=engine.max_model_len,
            block_size=engine.block_manager.block_size,
            num_blocks=engine.block_manager.num_blocks,
            dtype=engine.config.dtype,
            kv_cache_dtype=engine.kv_cache_dtype,
        )

    def endpoint(self) -> KVEndpoint:
        """This worker's KV endpoint, for prefill workers to push into (torch-free: the router
        passes it on)."""
        if self.kv is None:
            raise ValueError(f"worker {self.worker_id} has no KV transport")
        endpoint = self.kv.endpoint()
        if self.followers is not None:
            endpoint = replace(endpoint, ranks=tuple(self.followers.endpoints()))
        return endpoint

    def submit(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        resume: ResumeState | None = None,
        router: RouterClaim | None = None,
        attempt: int = 0,
    ) -> None:
        """Run a whole request here (local prefill, then decode); outputs go to `router`'s poll_outputs,
        stamped with the router's `attempt`. With `resume`, continue a request whose first decode
        worker died (engine.resume_request)."""

        def add():
            self._aborted.refuse(request_id)
            self.leases.own(request_id, router, attempt)
            if resume is None:
                self.engine.add_request(prompt_token_ids, params, request_id)
            else:
                self.engine.resume_request(prompt_token_ids, params, request_id, resume)

        self.compile_grammar(params)
        self._call(add)
        self.counters.add(prompt_tokens=len(prompt_token_ids) + (len(resume.output_token_ids) if resume else 0))

    def compile_grammar(self, params: SamplingParams) -> None:
        """Compile a structured output's grammar in the calling thread (cached), off the engine
        thread's steps; a spec that does not compile (or not within the cache's time limit) raises
        GrammarCompileError here, before the worker holds anything of the request (the router
        answers 400)."""
        if params.structured_output is not None and self.engine.grammars is not None:
            self.engine.grammars.compiled(params.structured_output)

    def prefill(self, request: PrefillRequest) -> PrefillResult:
        """Compute the prompt's KV and first token, push the blocks to the peer, return the token."""
        rid = request.request_id
        self.compile_grammar(request.sampling_params)
        started = time.perf_counter()
        pending = PendingPrefill(Future(), send=request.peer_endpoint is not None)

        def add():
            self._aborted.refuse(rid)
            self.leases.own(rid, request.router)
            self._prefills[rid] = pending
            try:
                self.engine.add_request(request.prompt_token_ids, request.sampling_params, rid, prefill_only=True)
            except BaseException:
                self._prefills.pop(rid, None)
                raise

        self._call(add)
        self.counters.add(prompt_tokens=len(request.prompt_token_ids))
        try:
            output, src = pending.done.result(timeout=self.config.transfer_timeout_s * 4)
        except RequestAborted:
            raise
        except BaseException:
            # Stopped waiting: whatever state the request reached here (queued, held, sending) ends.
            self._call(lambda: (self.engine.abort(rid), self.engine.release(rid), self.leases.forget(rid)))
            raise
        prefill_seconds = time.perf_counter() - started
        sent = nbytes = 0
        transfer_seconds = 0.0
        rank_pairs: tuple[tuple[int, int, int], ...] = ()
        try:
            if src is not None:
                if len(src) != len(request.dst_block_ids):
                    raise ValueError(
                        f"request {rid}: {len(src)} KV blocks here, "
                        f"{len(request.dst_block_ids)} reserved on the decode worker"
                    )
                skip = request.dst_num_cached_tokens // self.engine.block_manager.block_size
                peers = [request.peer_endpoint, *request.peer_endpoint.ranks]
                src_ids, dst_ids, timeout_s = src[skip:], request.dst_block_ids[skip:], self.config.transfer_timeout_s
                # Every rank pushes its heads into the decode ranks that hold them (kvtransfer.resharding).
                sends = self.kv.send(peers, src_ids, dst_ids, rid, timeout_s)
                others = (
                    None if self.followers is None else self.followers.send(peers, src_ids, dst_ids, rid, timeout_s)
                )
                links = self.kv.wait_sent(sends) + (others() if others is not None else [])
                result = combined([link.result for link in links])
                if self.config.tp_size > 1 or len(peers) > 1:
                    rank_pairs = tuple((x.link.src_rank, x.link.dst_rank, x.result.nbytes) for x in links)
                if not result.ok:
                    raise KVTransferError(f"KV transfer for {rid} ended {result.status.name}: {result.error}")
                sent, nbytes, transfer_seconds = len(src) - skip, result.nbytes, result.seconds
                self.counters.add(kv_blocks_sent=sent, kv_bytes_sent=nbytes)
        finally:
            # Not waited for: the engine thread may be inside a long step, and the blocks only
            # return to the pool (the router needs the first token now).
            self._post(lambda: self.engine.release(rid))
            self.leases.forget(rid)
        return PrefillResult(output, sent, nbytes, transfer_seconds, prefill_seconds, rank_pairs)

    def connect_peer(self, endpoint: KVEndpoint) -> str:
        """Handshake with a decode worker now (at start-up), so an incompatible KV layout fails
        before any request does: raises KVLayoutMismatch naming the field. Returns the backend
        that serves the pair (shm, gloo or nccl)."""
        peers = [endpoint, *endpoint.ranks]
        self.kv.connect(peers)
        if self.followers is not None:
            self.followers.connect(peers)
        return self.transport.kind_for(endpoint)

    def kv_links(self) -> list[PeerLink]:
        """The decode workers this worker has connected to: the backend of each pair and the
        blocks it carried."""
        return [link for transport in self.kv.transports() for link in transport.links()]

    def reserve(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        router: RouterClaim | None = None,
        attempt: int = 0,
    ):
        """Set aside blocks for a prompt a prefill worker will push; None when full right now.
        The decode's outputs go to `router`, stamped with its `attempt`."""
        self.compile_grammar(params)

        def reserve_here():
            self._aborted.refuse(request_id)
            self.leases.own(request_id, router, attempt)
            return self.engine.reserve_for_kv(prompt_token_ids, params, request_id)

        reservation = self._call(reserve_here)
        if reservation is not None and self.kv is not None:
            skip = reservation.num_cached_tokens // self.engine.block_manager.block_size
            block_ids = reservation.block_ids[skip:]
            self.kv.expect(request_id, block_ids, self.config.transfer_timeout_s)
            self._recv_handles[request_id] = PendingLoad(len(block_ids), prompt_token_ids, params)
            if self.followers is not None:  # before the prefill worker can send: this call returns first
                self.followers.expect(request_id, block_ids, self.config.transfer_timeout_s)
        return reservation

    def start_decode(self, request_id: str, first_token: int) -> None:
        """The prefill worker has pushed the KV: check it landed intact (else see workers.kv_load) and decode on."""
        load = self._recv_handles.pop(request_id, None)
        if load is not None:
            result = self.kv.wait_received(request_id)
            if self.followers is not None:
                result = combined([result, *self.followers.wait(request_id)])
            if not result.ok:
                reason = self.kv_failures.record(request_id, result)
                if self.kv_failures.policy == "recompute":
                    return self._call(lambda: recompute(self.engine, request_id, load, first_token))
                self._call(lambda: self.engine.abort(request_id))
                raise self.kv_failures.error(request_id, reason, result)
            self.counters.add(kv_blocks_received=load.num_blocks)
        with_draft_kv = load is not None and self.kv.draft is not None  # a draft model's part came with it
        self._call(lambda: self.engine.start_decoding(request_id, first_token, with_draft_kv))

    def abort(self, request_id: str, final: bool = True) -> bool:
        """Free what this worker holds of the request. `final`: the router has ended it for good,
        so a creation call for it that arrives later is refused (RequestAborted); the router
        passes final=False when it frees a request here to start it again (a prefill fallback, a
        migration back to a restarted worker)."""
        if self._recv_handles.pop(request_id, None) is not None:
            self._abort_transfer(request_id)  # no bytes land in the blocks once this returns
        return self._call(lambda: self._abort_here(request_id, final, "was aborted"))

    def _abort_transfer(self, request_id: str) -> None:
        """End a transfer into this worker's blocks on every rank."""
        self.kv.abort(request_id)
        if self.followers is not None:
            self.followers.abort(request_id)

    def _abort_here(self, request_id: str, final: bool, why: str) -> bool:
        """Engine thread: free the engine's state of the request (and end a prefill call waiting on it)."""
        if final:
            self._aborted.add(request_id)
        self.leases.forget(request_id)
        pending = self._prefills.pop(request_id, None)
        if pending is not None:  # a prefill in flight: release the call waiting for its token
            pending.done.set_exception(RequestAborted(f"request {request_id} {why}"))
        return self.engine.abort(request_id)

    def poll_outputs(self, timeout_s: float = 0.05, router: RouterClaim | None = None) -> list[RequestOutput]:
        """Every output queued for `router`, waiting up to timeout_s for the first one (renews its lease)."""
        return self.leases.take_outputs(router, timeout_s)

    def renew_lease(self, router: RouterClaim) -> None:
        """Keep the router's requests alive here for another `router.lease_s` seconds."""
        self.leases.renew(router)

    def heartbeat(self, router: RouterClaim | None = None) -> WorkerHeartbeat:
        """Stats and the router's KV events since its last heartbeat (taken together on the engine
        thread), and the routers holding a lease here."""
        self.leases.renew(router)
        s, events = self._call(lambda: (self.engine.stats(), self._take_kv_events(router)), timeout_s=10.0)
        return WorkerHeartbeat(self._make_stats(s), events, self.leases.holders())

    def stats(self) -> WorkerStats:
        return self._make_stats(self._call(self.engine.stats, timeout_s=10.0))

    def _make_stats(self, s) -> WorkerStats:
        c = self.counters.snapshot()
        return WorkerStats(
            worker_id=self.worker_id,
            role=self.role,
            num_running=s.num_running,
            num_waiting=s.num_waiting,
            kv_usage=s.kv_usage,
            num_blocks=s.num_blocks,
            num_free_blocks=s.num_free_blocks,
            prefix_cache_queries=s.prefix_cache_queries,
            prefix_cache_hits=s.prefix_cache_hits,
            num_preemptions=s.num_preemptions,
            kv_blocks_sent=c["kv_blocks_sent"],
            kv_bytes_sent=c["kv_bytes_sent"],
            kv_blocks_received=c["kv_blocks_received"],
            prompt_tokens=c["prompt_tokens"],
            generation_tokens=c["generation_tokens"],
            pid=os.getpid(),
            kv_transfer_failures=self.kv_failures.snapshot(),
            grammar=self.engine.grammars.counts() if self.engine.grammars is not None else GrammarCounts(),
            spec_decode=s.spec_decode,
            tp_size=self.config.tp_size,
            rank_pids=tuple(self.followers.pids()) if self.followers is not None else (),
        )

    def shutdown(self) -> None:
        self._stopped.set()
        self._post(lambda: None)  # wakes an idle engine thread now, not at its next 0.5 s timeout
        self._thread.join(timeout=5)
        if self.followers is not None:
            self.followers.closing()
            if not self._thread.is_alive():  # the step broadcast is the engine thread's
                try:
                    self.engine.runner.stop_followers()
                except Exception as exc:  # a rank already gone: nothing to stop there
                    log.warning("worker %s: could not stop the other ranks' steps: %r", self.worker_id, exc)
            self.followers.shutdown()
        if self.kv is not None:
            self.kv.close()
        if self._step_log is not None:
            self._stop_step_log()
            self._step_log.close()

    def _log_step(self, chunks: list[tuple[int, int, bool]], seconds: float) -> None:
        if not self._step_log.closed:  # an engine thread that outlived shutdown's join logs nothing more
            # `end` on the monotonic clock, which every process of the host shares: steps of two
            # workers can be laid side by side (tests/e2e/test_streams_beside_a_long_prompt.py).
            self._step_log.write(
                json.dumps(
                    {
                        "role": self.role,
                        "seconds": seconds,
                        "end": time.monotonic(),
                        "threads": torch.get_num_threads(),
                        "chunks": chunks,
                    }
                )
                + "\n"
            )


def _build_engine_and_kv(config: WorkerConfig, group: TPGroup | None = None):
    """Rank 0's shard (the whole model without tensor parallelism), the engine on it, its KV transports."""
    group = group or TPGroup.single()
    shard = build_rank_shard(config, group)
    cfg = shard.model_config
    grammars = GrammarCache(shard.model_dir, cfg.vocab_size, cfg.eos_token_ids)
    engine = LLMEngine(
        cfg,
        shard.engine_config,
        shard.model,
        load_tokenizer_decode(shard.model_dir),
        kv_cache=shard.kv_cache,
        grammars=grammars,
        tp_group=group,
        draft_kv=shard.kv.allocate_draft,
    )
    return engine, shard.kv
