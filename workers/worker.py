"""A worker: one engine driven by its own thread, its KV transport, and the calls the router makes.

Roles: a prefill worker runs prompts to their first token and pushes the prompt's KV blocks into a
decode worker's reserved blocks; a decode worker reserves blocks, waits for the KV, then decodes
in its continuous batch and queues outputs for the router to collect. A decode worker also runs
whole requests itself (local prefill). The class runs without Ray (tests use it directly);
`workers.actors` wraps it as Ray actors.

Threading: the engine is not thread-safe, so only the engine thread touches it. Calls from other
threads (Ray runs actor methods on a thread pool) queue closures to the engine thread and wait for
their result; the counters, added to from both, take a lock. Outputs go to an outbox that `poll_outputs` drains in batches: one call carries every
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
from dataclasses import dataclass, field, replace

from common import envs
from kvtransfer import KVTransferError, PairwiseTransport, PeerLink, Place, dtype_name
from workers.config import EngineConfig
from workers.engine import LLMEngine, load_tokenizer_decode
from workers.model_config import ModelConfig
from workers.model_files import ModelNotFoundError, resolve_model_dir
from workers.model_runner import (iter_safetensors, kv_cache_num_blocks, kv_cache_scales, kv_cache_torch_dtype,
                                  load_model)
from common.protocol import (
    KVEndpoint, KVEvent, KVEventBatch, KVLayout, PrefillRequest, PrefillResult, RequestOutput, ResumeState,
    WorkerHeartbeat, WorkerReady, WorkerStats,
)
from common.roles import ROLES
from common.sampling_params import SamplingParams

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


@dataclass(frozen=True)
class WorkerConfig:
    worker_id: str
    role: str
    model: str | None = None  # None: the default model; resolved on the worker's own node
    engine: EngineConfig = field(default_factory=EngineConfig)
    # KV transport choice (common.transports.CHOICES): auto picks per pair of workers.
    transport: str = "auto"
    transfer_timeout_s: float = 30.0
    # Where the worker runs, filled in by the Ray actor shell (workers.actors) from Ray's own
    # view: the transport per pair compares node ids, and gloo/nccl rendezvous on `host`.
    node_id: str = "local"
    host: str = "127.0.0.1"
    # The engine thread runs at idle priority (Linux SCHED_IDLE): a decode worker sharing a CPU host
    # with a prefill worker yields to it, and to the router, whenever they want a core
    # (cluster.placement decides).
    idle_priority: bool = False

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {tuple(r.value for r in ROLES)}, got {self.role!r}")


def _run_at_idle_priority(worker_id: str) -> None:
    """The calling thread (and the threads it starts) runs only when no other thread wants the CPU."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError) as exc:  # not Linux, or not allowed: run as before
        log.warning("worker %s: cannot run at idle priority (%s)", worker_id, exc)


class EngineWorker:
    def __init__(self, config: WorkerConfig, engine=None, transport=None) -> None:
        self.config = config
        self.worker_id = config.worker_id
        self.role = config.role
        if engine is None:
            engine, transport = _build_engine_and_transport(config, transport)
        self.engine = engine
        self.transport = transport
        self._step_log = None
        self._stop_step_log = None
        step_log_dir = envs.step_log_dir()
        if step_log_dir:
            self._step_log = open(os.path.join(step_log_dir, f"{self.worker_id}.jsonl"), "a", buffering=1)
            self._stop_step_log = engine.observe_steps(self._log_step)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._outbox: list[RequestOutput] = []
        self._outbox_ready = threading.Condition()
        self._prefills: dict[str, PendingPrefill] = {}
        self._aborted = AbortedIds()
        self._recv_handles: dict[str, object] = {}
        self._peers: dict[tuple[str, str], str] = {}  # KVEndpoint.peer_key -> transport peer id
        self.counters = Counters("kv_blocks_sent", "kv_bytes_sent", "kv_blocks_received", "prompt_tokens",
                                 "generation_tokens")
        # KV events drained from the engine after every step (engine thread only); bounded so a
        # router that stops collecting cannot grow it: past the bound we send a snapshot instead.
        self._kv_events: list[KVEvent] = []
        self._kv_event_hashes = 0
        self._kv_events_lost = False
        self._max_kv_event_hashes = max(1024, 4 * engine.block_manager.num_blocks)
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"engine-{self.worker_id}", daemon=True)
        self._thread.start()

    # ---- engine thread -------------------------------------------------------------------
    def _loop(self) -> None:
        if self.config.idle_priority:
            _run_at_idle_priority(self.worker_id)
        engine = self.engine
        while not self._stopped.is_set():
            block = not engine.has_schedulable_work()
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
                try:
                    self._dispatch(engine.step())
                except Exception as exc:  # a failed step must fail its requests, not hang them
                    self._fail_all(exc)
            self._drain_kv_events()

    def _drain_kv_events(self) -> None:
        events = self.engine.block_manager.drain_events()
        if not events or self._kv_events_lost:
            return
        self._kv_events.extend(events)
        self._kv_event_hashes += sum(len(e.block_hashes) or 1 for e in events)
        if self._kv_event_hashes > self._max_kv_event_hashes:
            self._kv_events, self._kv_event_hashes, self._kv_events_lost = [], 0, True

    def _take_kv_events(self) -> KVEventBatch:
        """Engine thread: hand over the buffered events (or a snapshot after an overflow)."""
        self._drain_kv_events()
        bm = self.engine.block_manager
        if self._kv_events_lost:
            batch = KVEventBatch([], bm.cached_hashes(), bm.block_size)
        else:
            batch = KVEventBatch(self._kv_events, None, bm.block_size)
        self._kv_events, self._kv_event_hashes, self._kv_events_lost = [], 0, False
        return batch

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
            with self._outbox_ready:
                self._outbox.extend(ready)
                self._outbox_ready.notify_all()

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
        with self._outbox_ready:
            self._outbox.extend(failed)
            self._outbox_ready.notify_all()

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
            worker_id=self.worker_id, role=self.role, max_model_len=engine.max_model_len,
            block_size=engine.block_manager.block_size, num_blocks=engine.block_manager.num_blocks,
            dtype=engine.config.dtype, kv_cache_dtype=engine.kv_cache_dtype,
        )

    def endpoint(self) -> KVEndpoint:
        """This worker's KV endpoint, for prefill workers to push into (torch-free: the router
        passes it on)."""
        if self.transport is None:
            raise ValueError(f"worker {self.worker_id} has no KV transport")
        return self.transport.endpoint()

    def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
               resume: ResumeState | None = None) -> None:
        """Run a whole request here (local prefill, then decode); outputs go to poll_outputs.
        With `resume`, continue a request whose first decode worker died (engine.resume_request)."""
        def add():
            self._aborted.refuse(request_id)
            if resume is None:
                self.engine.add_request(prompt_token_ids, params, request_id)
            else:
                self.engine.resume_request(prompt_token_ids, params, request_id, resume)

        self._call(add)
        self.counters.add(prompt_tokens=len(prompt_token_ids) + (len(resume.output_token_ids) if resume else 0))

    def prefill(self, request: PrefillRequest) -> PrefillResult:
        """Compute the prompt's KV and first token, push the blocks to the peer, return the token."""
        rid = request.request_id
        started = time.perf_counter()
        pending = PendingPrefill(Future(), send=request.peer_endpoint is not None)

        def add():
            self._aborted.refuse(rid)
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
            self._call(lambda: (self.engine.abort(rid), self.engine.release(rid)))
            raise
        prefill_seconds = time.perf_counter() - started
        sent = nbytes = 0
        transfer_seconds = 0.0
        try:
            if src is not None:
                if len(src) != len(request.dst_block_ids):
                    raise ValueError(f"request {rid}: {len(src)} KV blocks here, {len(request.dst_block_ids)} reserved on the decode worker")
                skip = request.dst_num_cached_tokens // self.engine.block_manager.block_size
                peer_id = self._connect(request.peer_endpoint)
                handle = self.transport.send(peer_id, src[skip:], request.dst_block_ids[skip:], rid, self.config.transfer_timeout_s)
                result = self.transport.wait(handle)
                if not result.ok:
                    raise KVTransferError(f"KV transfer for {rid} ended {result.status.name}: {result.error}")
                sent, nbytes, transfer_seconds = len(src) - skip, result.nbytes, result.seconds
                self.counters.add(kv_blocks_sent=sent, kv_bytes_sent=nbytes)
        finally:
            # Not waited for: the engine thread may be inside a long step, and the blocks only
            # return to the pool (the router needs the first token now).
            self._post(lambda: self.engine.release(rid))
        return PrefillResult(output, sent, nbytes, transfer_seconds, prefill_seconds)

    def connect_peer(self, endpoint: KVEndpoint) -> str:
        """Handshake with a decode worker now (at start-up), so an incompatible KV layout fails
        before any request does: raises KVLayoutMismatch naming the field. Returns the backend
        that serves the pair (shm, gloo or nccl)."""
        self._connect(endpoint)
        return self.transport.kind_for(endpoint)

    def kv_links(self) -> list[PeerLink]:
        """The decode workers this worker has connected to: the backend of each pair and the
        blocks it carried."""
        return self.transport.links()

    def _connect(self, endpoint: KVEndpoint) -> str:
        peer_id = self._peers.get(endpoint.peer_key)
        if peer_id is None:
            peer_id = self.transport.connect(endpoint)
            self._peers[endpoint.peer_key] = peer_id
        return peer_id

    def reserve(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams):
        """Set aside blocks for a prompt a prefill worker will push; None when full right now."""
        def reserve_here():
            self._aborted.refuse(request_id)
            return self.engine.reserve_for_kv(prompt_token_ids, params, request_id)

        reservation = self._call(reserve_here)
        if reservation is not None and self.transport is not None:
            skip = reservation.num_cached_tokens // self.engine.block_manager.block_size
            self._recv_handles[request_id] = self.transport.expect(
                request_id, reservation.block_ids[skip:], self.config.transfer_timeout_s
            )
        return reservation

    def start_decode(self, request_id: str, first_token: int) -> None:
        """The prefill worker has pushed the KV: check it landed and decode on."""
        handle = self._recv_handles.pop(request_id, None)
        if handle is not None:
            result = self.transport.wait(handle)
            if not result.ok:
                self._call(lambda: self.engine.abort(request_id))
                raise KVTransferError(f"KV for {request_id} did not arrive: {result.status.name} {result.error or ''}")
            self.counters.add(kv_blocks_received=handle.num_blocks)
        self._call(lambda: self.engine.start_decoding(request_id, first_token))

    def abort(self, request_id: str, final: bool = True) -> bool:
        """Free what this worker holds of the request. `final`: the router has ended it for good,
        so a creation call for it that arrives later is refused (RequestAborted); the router
        passes final=False when it frees a request here to start it again (a prefill fallback, a
        migration back to a restarted worker)."""
        handle = self._recv_handles.pop(request_id, None)
        if handle is not None:
            self.transport.abort(request_id)  # no bytes land in the blocks once this returns

        def abort_here() -> bool:
            if final:
                self._aborted.add(request_id)
            pending = self._prefills.pop(request_id, None)
            if pending is not None:  # a prefill in flight: release the call waiting for its token
                pending.done.set_exception(RequestAborted(f"request {request_id} was aborted"))
            return self.engine.abort(request_id)

        return self._call(abort_here)

    def poll_outputs(self, timeout_s: float = 0.05) -> list[RequestOutput]:
        """Every queued output, waiting up to timeout_s for the first one."""
        with self._outbox_ready:
            if not self._outbox:
                self._outbox_ready.wait(timeout_s)
            outputs, self._outbox = self._outbox, []
        return outputs

    def heartbeat(self) -> WorkerHeartbeat:
        """Stats and the KV events since the last heartbeat, taken together on the engine thread."""
        s, events = self._call(lambda: (self.engine.stats(), self._take_kv_events()), timeout_s=10.0)
        return WorkerHeartbeat(self._make_stats(s), events)

    def stats(self) -> WorkerStats:
        return self._make_stats(self._call(self.engine.stats, timeout_s=10.0))

    def _make_stats(self, s) -> WorkerStats:
        c = self.counters.snapshot()
        return WorkerStats(
            worker_id=self.worker_id, role=self.role, num_running=s.num_running, num_waiting=s.num_waiting,
            kv_usage=s.kv_usage, num_blocks=s.num_blocks, num_free_blocks=s.num_free_blocks,
            prefix_cache_queries=s.prefix_cache_queries, prefix_cache_hits=s.prefix_cache_hits,
            num_preemptions=s.num_preemptions, kv_blocks_sent=c["kv_blocks_sent"], kv_bytes_sent=c["kv_bytes_sent"],
            kv_blocks_received=c["kv_blocks_received"], prompt_tokens=c["prompt_tokens"],
            generation_tokens=c["generation_tokens"], pid=os.getpid(),
        )

    def shutdown(self) -> None:
        self._stopped.set()
        self._thread.join(timeout=5)
        if self.transport is not None:
            self.transport.close()
        if self._step_log is not None:
            self._stop_step_log()
            self._step_log.close()

    def _log_step(self, chunks: list[tuple[int, int, bool]], seconds: float) -> None:
        if not self._step_log.closed:  # an engine thread that outlived shutdown's join logs nothing more
            self._step_log.write(json.dumps({"role": self.role, "seconds": seconds, "chunks": chunks}) + "\n")


def _build_engine_and_transport(config: WorkerConfig, transport=None):
    """Load the model and allocate its KV cache through the transport (which may put it in shared memory)."""
    ec = config.engine
    try:
        model_dir = resolve_model_dir(config.model, quiet=True)
    except ModelNotFoundError as exc:  # every node needs the files: say which one lacks them
        raise ModelNotFoundError(f"worker {config.worker_id} on node {config.node_id} ({config.host}): {exc}") from None
    model_config = ModelConfig.from_model_dir(model_dir)
    kv_dtype = kv_cache_torch_dtype(ec)
    # The model comes first: FP8 KV scales are calibrated on it, and they belong to the layout
    # the transport checks when a prefill worker connects (deterministic, so equal configs pair).
    # load_model refuses FP8 on a GPU without native FP8 before any kernel runs.
    weights = iter_safetensors(model_dir)
    model = load_model(model_config, ec, weights, ec.max_model_len)
    # On a GPU without --kv-cache-memory: --gpu-memory-utilization less the weights and the profiled activation peak.
    num_blocks = kv_cache_num_blocks(model, model_config, ec, ec.max_model_len)
    kv_scales = kv_cache_scales(model, ec, weights)
    ec = replace(ec, kv_scales=kv_scales) if ec.kv_cache_dtype == "fp8" else ec
    layout = KVLayout(
        num_layers=model_config.num_layers, num_kv_heads=model_config.num_kv_heads, head_dim=model_config.head_dim,
        block_size=ec.block_size, dtype=dtype_name(kv_dtype), kv_scales=kv_scales,
    )
    place = Place(config.node_id, config.host, "cuda" if ec.device.startswith("cuda") else "cpu")
    transport = transport or PairwiseTransport(config.transport, place, config.worker_id)
    kv_cache = transport.allocate_cache(layout, num_blocks)
    engine = LLMEngine(model_config, ec, model, load_tokenizer_decode(model_dir), kv_cache=kv_cache)
    return engine, transport
