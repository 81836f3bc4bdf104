"""A worker: one engine driven by its own thread, its KV transport, and the calls the router makes.

Roles: a prefill worker runs prompts to their first token and pushes the prompt's KV blocks into a
decode worker's reserved blocks; a decode worker reserves blocks, waits for the KV, then decodes
in its continuous batch and queues outputs for the router to collect. A decode worker also runs
whole requests itself (local prefill). The class runs without Ray (tests use it directly);
`workers.shell.actors` wraps it as Ray actors. Its calls are `common.worker_api.WorkerAPI`'s, and
take the records of `common.request`.

Threading: the engine is not thread-safe, so only the engine thread touches it. Calls from other
threads (Ray runs actor methods on a thread pool) queue closures to the engine thread and wait for
their result, which comes between two steps; no call waits for a prompt to be computed. What takes
engine time goes to an outbox per router that `poll_outputs` drains in batches: tokens (one call
carries every request's new tokens, so streaming costs one RPC per step, not one per token) and
prefills' outcomes (workers.shell.prefill_sender). The counters, added to from all threads, take a lock.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import replace

from common.lora import LoRAModuleSpec
from common.protocol import (
    GrammarCounts,
    KVEndpoint,
    KVEventBatch,
    KVReservation,
    RequestOutput,
    RouterClaim,
    WorkerHeartbeat,
    WorkerOutput,
    WorkerReady,
    WorkerStats,
)
from common.request import AbortRequest, PrefillRequest, ReserveRequest, StartDecodeRequest, SubmitRequest
from common.sampling_params import SamplingParams
from common.transports import PeerLink
from kvtransfer import PairwiseTransport
from kvtransfer.resharding import RankKV, combined
from workers.build import build_engine, load_tokenizer_decode
from workers.config import WorkerConfig
from workers.engine.grammar import GrammarCache
from workers.parallel.group import TPGroup, TPGroupBroken
from workers.parallel.rank import RankFollowers
from workers.parallel.shard import build_rank_shard
from workers.shell.bookkeeping import AbortedIds, Counters, RequestAborted
from workers.shell.elastic_threads import core_sharing_for
from workers.shell.kv_load import KVLoadFailures, PendingLoad, recompute
from workers.shell.prefill_sender import PrefillSender
from workers.shell.router_leases import RouterLeases
from workers.shell.step_log import STEP_LOG_ENV, StepLog

log = logging.getLogger(__name__)

__all__ = ["STEP_LOG_ENV", "AbortedIds", "Counters", "EngineWorker", "RequestAborted", "WorkerConfig"]


class EngineWorker:
    def __init__(
        self,
        config: WorkerConfig,
        engine=None,
        kv: RankKV[PairwiseTransport] | None = None,
        followers: RankFollowers | None = None,
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
        self._step_log = StepLog.if_asked(self.worker_id, self.role, engine)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._aborted = AbortedIds()
        self._recv_handles: dict[str, PendingLoad] = {}  # receives expected, by request id
        self.counters = Counters(
            "kv_blocks_sent", "kv_bytes_sent", "kv_blocks_received", "prompt_tokens", "generation_tokens"
        )
        self.kv_failures = KVLoadFailures(self.worker_id, config.kv_load_failure_policy)  # workers.kv_load
        # Per router (workers.router_leases): its requests, outbox, lease and KV events drained from
        # the engine after every step (bounded: past the bound that router gets a snapshot instead).
        self.leases = RouterLeases(max(1024, 4 * engine.block_manager.num_blocks))
        self.prefills = PrefillSender(
            self.worker_id,
            kv,
            followers,
            engine.block_manager.block_size,
            config.tp_size,
            config.transfer_timeout_s,
            self.counters,
            self.leases.deliver,
            lambda rid: self._post(lambda: self.engine.release(rid)),
        )
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
            self._end_expired_prefills()
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
                self._abort_here(request_id, True)  # a send releases after

    def _end_expired_prefills(self) -> None:
        """Engine thread: a prompt that did not reach its first token in time fails (the router
        prefills it elsewhere)."""
        if not self.prefills.pending:
            return
        for request_id in self.prefills.expired(time.monotonic()):
            log.warning("worker %s: %s did not reach its first token in time; giving it up", self.worker_id, request_id)
            self.engine.abort(request_id)
            self.engine.release(request_id)
            self.prefills.fail(request_id, f"{request_id} waited too long for its prefill on {self.worker_id}")

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        ready: list[WorkerOutput] = []
        now = time.time()
        for out in outputs:
            out.created_at = now
            self.counters.add(generation_tokens=len(out.token_ids))
            pending = self.prefills.pending.pop(out.request_id, None)
            if pending is not None:
                self.prefills.first_token(pending, out, self.engine.begin_send)
            else:
                ready.append(out)
        if ready:
            self.leases.deliver(ready)

    def _fail_all(self, exc: Exception) -> None:
        failed: list[WorkerOutput] = []
        for request_id in self.engine.abort_all():
            if self.prefills.pending.pop(request_id, None) is not None:
                self.engine.release(request_id)
                self.prefills.fail(request_id, f"the engine step failed: {exc!r}")
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

    def submit(self, request: SubmitRequest) -> None:
        """Run a whole request here (local prefill, then decode); its outputs go to its owner's
        poll_outputs, stamped with the owner's attempt. With `resume`, continue a request whose first
        decode worker died (engine.resume_request)."""
        req, resume = request.request, request.resume
        rid = req.request_id

        def add():
            self._aborted.refuse(rid)
            self.leases.own(rid, request.owner.router, request.owner.attempt)
            if resume is None:
                self.engine.add_request(req.prompt_token_ids, req.sampling_params, rid, context=req.context)
            else:
                self.engine.resume_request(req.prompt_token_ids, req.sampling_params, rid, resume, req.context)

        self.compile_grammar(req.sampling_params)
        self._call(add)
        self.counters.add(prompt_tokens=len(req.prompt_token_ids) + (len(resume.output_token_ids) if resume else 0))

    def compile_grammar(self, params: SamplingParams) -> None:
        """Compile a structured output's grammar in the calling thread (cached), off the engine
        thread's steps; a spec that does not compile (or not within the cache's time limit) raises
        GrammarCompileError here, before the worker holds anything of the request (the router
        answers 400)."""
        if params.structured_output is not None and self.engine.grammars is not None:
            self.engine.grammars.compiled(params.structured_output)

    def load_lora_adapter(self, spec: LoRAModuleSpec) -> None:
        """Read and check the adapter on the engine thread, between two steps (a step reads the slots)."""
        self._call(lambda: self.engine.load_lora_adapter(spec))

    def unload_lora_adapter(self, name: str) -> bool:
        return self._call(lambda: self.engine.unload_lora_adapter(name))

    def prefill(self, request: PrefillRequest) -> None:
        """Queue the prompt to its first token; the KV handoff into the decode worker's reserved
        blocks and the outcome (a PrefillResult or PrefillFailed in the owner's outbox) follow
        (workers.shell.prefill_sender)."""
        req = request.request
        rid = req.request_id
        self.compile_grammar(req.sampling_params)

        def add():
            self._aborted.refuse(rid)
            self.leases.own(rid, request.owner.router)
            self.prefills.expect(request)
            try:
                self.engine.add_request(req.prompt_token_ids, req.sampling_params, rid, True, req.context)
            except BaseException:
                self.prefills.pending.pop(rid, None)
                self.leases.forget(rid)
                raise

        self._call(add)
        self.counters.add(prompt_tokens=len(req.prompt_token_ids))

    def connect_peer(self, endpoint: KVEndpoint) -> str:
        """Handshake with a decode worker now (at start-up), so an incompatible KV layout fails
        before any request does: raises KVLayoutMismatch naming the field. Returns the backend
        that serves the pair (shm, gloo or nccl)."""
        peers = [endpoint, *endpoint.ranks]
        kv = self._moving_kv()
        kv.connect(peers)
        if self.followers is not None:
            self.followers.connect(peers)
        return kv.transport.kind_for(endpoint)

    def kv_links(self) -> list[PeerLink]:
        """The decode workers this worker has connected to: the backend of each pair and the
        blocks it carried."""
        return [link for transport in self._moving_kv().transports() for link in transport.links()]

    def _moving_kv(self) -> RankKV[PairwiseTransport]:
        """This worker's KV transports, which the calls that move KV need."""
        if self.kv is None:
            raise ValueError(f"worker {self.worker_id} was built without KV transports: it moves no KV")
        return self.kv

    def reserve(self, request: ReserveRequest) -> KVReservation | None:
        """Set aside blocks for a prompt a prefill worker will push; None when full right now. The
        decode's outputs go to the owner, stamped with its attempt."""
        req = request.request
        rid = req.request_id
        self.compile_grammar(req.sampling_params)

        def reserve_here():
            self._aborted.refuse(rid)
            self.leases.own(rid, request.owner.router, request.owner.attempt)
            return self.engine.reserve_for_kv(req.prompt_token_ids, req.sampling_params, rid, req.context)

        reservation = self._call(reserve_here)
        if reservation is not None and self.kv is not None:
            skip = reservation.num_cached_tokens // self.engine.block_manager.block_size
            block_ids = reservation.block_ids[skip:]
            self.kv.expect(rid, block_ids, self.config.transfer_timeout_s)
            self._recv_handles[rid] = PendingLoad(len(block_ids), req.prompt_token_ids, req.sampling_params)
            if self.followers is not None:  # before the prefill worker can send: this call returns first
                self.followers.expect(rid, block_ids, self.config.transfer_timeout_s)
        return reservation

    def start_decode(self, request: StartDecodeRequest) -> None:
        """The prefill worker has pushed the KV: check it landed intact (else see workers.shell.kv_load)
        and decode on."""
        request_id, first_token = request.request_id, request.first_token
        self._call(lambda: self.engine.check_kv_namespace(request_id, request.kv_namespace))
        load = self._recv_handles.pop(request_id, None)
        if load is not None:
            assert self.kv is not None  # reserve() expects a receive only with KV transports
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
        # A draft model's part came with it.
        with_draft_kv = load is not None and self.kv is not None and self.kv.draft is not None
        self._call(lambda: self.engine.start_decoding(request_id, first_token, with_draft_kv))

    def abort(self, request: AbortRequest) -> bool:
        """Free what this worker holds of the request. `final`: the router has ended it for good,
        so a creation call for it that arrives later is refused (RequestAborted); the router
        passes final=False when it frees a request here to start it again (a prefill fallback, a
        migration back to a restarted worker)."""
        request_id, final = request.request_id, request.final
        if self._recv_handles.pop(request_id, None) is not None:
            self._abort_transfer(request_id)  # no bytes land in the blocks once this returns
        return self._call(lambda: self._abort_here(request_id, final))

    def _abort_transfer(self, request_id: str) -> None:
        """End a transfer into this worker's blocks on every rank."""
        assert self.kv is not None  # called for a receive reserve() expected, which needs KV transports
        self.kv.abort(request_id)
        if self.followers is not None:
            self.followers.abort(request_id)

    def _abort_here(self, request_id: str, final: bool) -> bool:
        """Engine thread: free the engine's state of the request (a queued prefill's too; one whose
        send has begun releases its blocks when the send ends)."""
        if final:
            self._aborted.add(request_id)
        self.leases.forget(request_id)
        self.prefills.pending.pop(request_id, None)
        return self.engine.abort(request_id)

    def poll_outputs(self, timeout_s: float = 0.05, router: RouterClaim | None = None) -> list[WorkerOutput]:
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
            lora=s.lora,
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
        self.prefills.close()
        if self.kv is not None:
            self.kv.close()
        if self._step_log is not None:
            self._step_log.close()


def _build_engine_and_kv(config: WorkerConfig, group: TPGroup | None = None):
    """Rank 0's shard (the whole model without tensor parallelism), the engine on it, its KV transports."""
    group = group or TPGroup.single()
    shard = build_rank_shard(config, group)
    cfg = shard.model_config
    grammars = GrammarCache(shard.model_dir, cfg.vocab_size, cfg.eos_token_ids)
    engine = build_engine(
        cfg,
        shard.engine_config,
        shard.model,
        load_tokenizer_decode(shard.model_dir),
        kv_cache=shard.kv_cache,
        grammars=grammars,
        tp_group=group,
        draft_kv=shard.kv.allocate_draft,
        lora_sharding=shard.lora_sharding,
    )
    return engine, shard.kv
