"""A simulated worker: the real scheduler and block manager from `workers/`, timed by a cost model,
behind the same interface as a real worker (`common.worker_api.WorkerAPI`).

`SimWorker` runs what `workers.engine.llm_engine.LLMEngine.step` runs (the same `Scheduler` and
`BlockManager` objects: continuous batching, chunked prefill under the token budget, preemption
when KV runs out, prefix-cache hits, KV events), except the model: a step's duration comes from
the cost model applied to the step's shape, and each sampled row gets a placeholder token.

It takes the same calls as `workers.shell.worker.EngineWorker`, with the same records
(common.request), and answers the same way: at once, with what engine time produces (tokens, a
prefill's outcome after its KV handoff) left in its outbox for `poll_outputs`. The simulator
(cluster.sim.simulator) decides when a call reaches it and when its outbox is read.

Timing follows the real worker's threading (workers/shell/worker.py): the engine thread runs steps
back to back, and a call runs only between two steps (`call`), so a call that arrives during a
step waits for its end. A prefill's send begins as its step ends, the KV moves over the
`LinkModel`, then the blocks are released between steps and the outcome is queued. Workers that
share a CPU host (`host`, cluster.sim.host.SharedHost) slow each other's steps while both compute.
Faults a test or a study injects: `kill()` (the worker is gone with everything it held), `fail_prefills` (each
prefill's handoff fails), `fail_kv_loads` (each received KV fails its check under the `fail` policy).

LoRA (`EngineSettings.max_loras` > 0): the scheduler admits at most `max_loras` distinct adapters to
a step (its `max_adapters`, as the real engine builds it), the adapters live in device slots and
host memory as the real worker keeps them (cluster.sim.lora), a step waits for the slot and disk
loads it needs and costs more per distinct adapter, and the worker's stats report its
`LoRAStatus`, which the router ranks workers by. With max_loras 0 an adapter only separates its
requests' KV (their namespace) and costs nothing.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from cluster.sim.costs import CostModel, LinkModel, StepShape
from cluster.sim.engine_settings import EngineSettings, WorkerCounters
from cluster.sim.events import EventLoop
from cluster.sim.host import SharedHost
from cluster.sim.lora import AdapterResidency
from common.lora import LoRAModuleSpec, LoRAStatus
from common.protocol import (
    KVEndpoint,
    KVEvent,
    KVEventBatch,
    KVLayout,
    KVReservation,
    PrefillFailed,
    PrefillResult,
    RequestOutput,
    RouterClaim,
    WorkerHeartbeat,
    WorkerOutput,
    WorkerReady,
    WorkerStats,
)
from common.request import (
    AbortRequest,
    PrefillRequest,
    ReserveRequest,
    StartDecodeRequest,
    SubmitRequest,
    WorkerRequest,
)
from common.roles import Role
from common.sampling_params import SamplingParams
from common.transports import KVLoadFailed, PeerLink
from workers.engine.block_manager import BlockManager
from workers.engine.scheduler import Scheduler
from workers.engine.scheduling_policy import SchedulingPolicy
from workers.engine.sequence import Sequence

__all__ = ["EngineSettings", "EventLoop", "SimWorker", "WorkerCounters"]

PLACEHOLDER_TOKEN = 0  # sampled tokens; prompts use ids >= 1000, so they never collide with prompt blocks


@dataclass
class _SeqState:
    seq: Sequence
    attempt: int = 0  # the router's, stamped on the outputs
    prefill: PrefillRequest | None = None  # a prefill worker's: where the KV goes
    queued_at: float = 0.0
    started_at: float | None = None


class SimWorker:
    """A prefill or decode worker of the simulation (`common.worker_api.WorkerAPI`)."""

    def __init__(
        self,
        loop: EventLoop,
        worker_id: str,
        role: Role,
        cost: CostModel,
        settings: EngineSettings,
        link: LinkModel | None = None,
        host: SharedHost | None = None,
    ) -> None:
        self.loop = loop
        self.host = host  # None: the worker has its machine (its GPUs, its cores) to itself
        self.worker_id = worker_id
        self.role = Role(role)
        self.cost = cost
        self.settings = settings
        self.link = link or LinkModel("default", 50e9)
        num_blocks = settings.num_kv_blocks or cost.kv_capacity_tokens() // settings.block_size
        if num_blocks < 1:
            raise ValueError(f"worker {worker_id}: the KV cache holds no block of {settings.block_size} tokens")
        self.block_manager = BlockManager(num_blocks, settings.block_size, settings.enable_prefix_caching)
        limits = settings.lora_limits
        # None: LoRA off. As the real engine: the scheduler's adapter limit is the worker's slots.
        self.lora = None if limits is None else AdapterResidency(limits, settings.lora_costs)
        self.scheduler = Scheduler(
            self.block_manager,
            settings.max_num_seqs,
            settings.max_num_batched_tokens,
            max_adapters=None if limits is None else limits.max_loras,
            policy=SchedulingPolicy(settings.scheduling_policy),
        )
        self.alive = True  # the router may route here
        self.removed = False  # gone from the pools (drained, or dead)
        self.dead = False
        self.busy = False
        self._step_began = 0.0
        self.fail_prefills = False
        self.adapters: set[str] = set()  # LoRA adapters loaded by name (any adapter a request names is served)
        self.fail_kv_loads = False
        self._commands: deque[Callable[[], object]] = deque()
        self._states: dict[str, _SeqState] = {}
        self._events: list[KVEvent] = []
        self._event_hashes = 0
        self._events_lost = False
        self._max_event_hashes = max(1024, 4 * num_blocks)
        self.counters = WorkerCounters()
        self.outbox: list[WorkerOutput] = []
        self.on_outputs: Callable[[SimWorker], None] | None = None  # the outbox went from empty to not
        self.on_started: Callable[[str, float], None] | None = None  # (request id, seconds it queued here)

    # ---- when calls run -------------------------------------------------------------------------
    def call(self, fn: Callable[[], object]) -> None:
        """Run fn between steps: now if idle, else at the end of the current step (dropped when dead)."""
        if self.dead:
            return
        if self.busy:
            self._commands.append(fn)
            return
        fn()
        self._maybe_step()

    def kill(self) -> None:
        """The worker's process is gone, with everything it held and queued."""
        self.dead, self.alive, self.removed = True, False, True
        if self.host is not None:
            self.host.cancel(self)
        self._commands.clear()
        self._states.clear()
        self.outbox.clear()

    # ---- common.worker_api.WorkerAPI ------------------------------------------------------------
    def ready(self) -> WorkerReady:
        bs = self.settings.block_size
        return WorkerReady(
            self.worker_id,
            self.role,
            max_model_len=self.block_manager.num_blocks * bs,
            block_size=bs,
            num_blocks=self.block_manager.num_blocks,
            dtype="simulated",
            kv_cache_dtype="simulated",
        )

    def endpoint(self) -> KVEndpoint:
        layout = KVLayout(
            num_layers=1, num_kv_heads=1, head_dim=1, block_size=self.settings.block_size, dtype="float32"
        )
        return KVEndpoint("sim", self.worker_id, layout, self.block_manager.num_blocks)

    def connect_peer(self, endpoint: KVEndpoint) -> str:
        return self.link.name

    def kv_links(self) -> list[PeerLink]:
        return []

    def submit(self, request: SubmitRequest) -> None:
        seq = self._new_seq(request.request)
        if request.resume is not None:  # prompt + what the client has is prefilled, then decoding goes on
            for token in request.resume.output_token_ids:
                seq.append_token(token)
        self._states[seq.request_id] = _SeqState(seq, request.owner.attempt, None, self.loop.now)
        self.scheduler.add(seq)

    def reserve(self, request: ReserveRequest) -> KVReservation | None:
        seq = self._new_seq(request.request)
        if not self.scheduler.add_reserved(seq):
            return None
        now = self.loop.now
        self._states[seq.request_id] = _SeqState(seq, request.owner.attempt, None, now, now)
        return KVReservation(seq.request_id, list(seq.block_ids), seq.num_cached_tokens)

    def prefill(self, request: PrefillRequest) -> None:
        seq = self._new_seq(request.request)
        self._states[seq.request_id] = _SeqState(seq, 0, request, self.loop.now)
        self.scheduler.add(seq)

    def start_decode(self, request: StartDecodeRequest) -> None:
        state = self._states.get(request.request_id)
        if state is None:
            raise ValueError(f"request {request.request_id!r} is not waiting for KV on {self.worker_id}")
        if self.fail_kv_loads:  # as the `fail` policy does: free the request, then say why
            self._finish(state.seq)
            raise KVLoadFailed(f"the KV pushed for {request.request_id} failed its check", "checksum_mismatch")
        seq = state.seq
        self.scheduler.kv_arrived(seq)
        self.counters.kv_blocks_received += len(seq.block_ids)
        seq.append_token(request.first_token)
        if seq.num_output_tokens >= seq.sampling_params.max_tokens:  # unreachable via the router; kept exact
            self._finish(seq)

    def abort(self, request: AbortRequest) -> bool:
        state = self._states.pop(request.request_id, None)
        if state is not None:
            self.scheduler.finish(state.seq)
            return True
        return self.scheduler.abort_held(request.request_id)

    def compile_grammar(self, params: SamplingParams) -> None:
        """Nothing to compile: simulated requests have no structured output."""

    def load_lora_adapter(self, spec: LoRAModuleSpec) -> None:
        """Serve the adapter: with LoRA on it is read into host memory now (not counted as a load,
        as the real worker's registration); a simulated worker serves any adapter a request names
        anyway, one never loaded read from disk when a step first needs it."""
        self.adapters.add(spec.name)
        if self.lora is not None:
            self.lora.add(spec.name)

    def unload_lora_adapter(self, name: str) -> bool:
        known = name in self.adapters
        self.adapters.discard(name)
        if self.lora is not None:
            known = self.lora.remove(name) or known
        return known

    def poll_outputs(self, timeout_s: float = 0.05, router: RouterClaim | None = None) -> list[WorkerOutput]:
        outputs, self.outbox = self.outbox, []
        return outputs

    def renew_lease(self, router: RouterClaim) -> None:
        """One router, whose lease never runs out."""

    def heartbeat(self, router: RouterClaim | None = None) -> WorkerHeartbeat:
        events, snapshot = self.take_kv_events()
        return WorkerHeartbeat(self.stats(), KVEventBatch(events, snapshot, self.settings.block_size))

    def stats(self) -> WorkerStats:
        bm, c = self.block_manager, self.counters
        return WorkerStats(
            worker_id=self.worker_id,
            role=self.role,
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_usage=bm.usage,
            num_blocks=bm.num_blocks,
            num_free_blocks=bm.num_free_blocks,
            prefix_cache_queries=0,
            prefix_cache_hits=0,
            num_preemptions=self.scheduler.num_preemptions,
            kv_blocks_sent=c.kv_blocks_sent,
            kv_bytes_sent=c.kv_bytes_sent,
            kv_blocks_received=c.kv_blocks_received,
            prompt_tokens=c.prefill_tokens,
            generation_tokens=c.decode_tokens,
            pid=os.getpid(),
            lora=self.lora_status(),
        )

    def lora_status(self) -> LoRAStatus:
        """Its adapters as its stats report them (LoRAStatus(): LoRA off)."""
        if self.lora is None:
            return LoRAStatus()
        sched = self.scheduler
        return self.lora.status((s.adapter for s in sched.running), (s.adapter for s in sched.waiting))

    def shutdown(self) -> None:
        self.removed = True

    # ---- requests -------------------------------------------------------------------------------
    def _new_seq(self, request: WorkerRequest) -> Sequence:
        request_id = request.request_id
        if request_id in self._states or request_id in self.scheduler.held:
            raise ValueError(f"request {request_id!r} is already on {self.worker_id}")
        return Sequence(
            request_id,
            list(request.prompt_token_ids),
            request.sampling_params,
            arrival_time=self.loop.now,
            context=request.context,
        )

    def _emit(self, item: WorkerOutput) -> None:
        self.outbox.append(item)
        if len(self.outbox) == 1 and self.on_outputs is not None:
            self.on_outputs(self)

    def _send(self, seq: Sequence, state: _SeqState) -> None:
        """A prefill's first token: push the KV into the decode worker's blocks over the link, then
        release the blocks between steps and queue the outcome (as the engine thread and the
        transport do)."""
        assert state.prefill is not None
        request_id, bs = seq.request_id, self.settings.block_size
        blocks = self.scheduler.begin_send(request_id)
        sent = len(blocks) - state.prefill.dst_num_cached_tokens // bs
        nbytes = sent * bs * self.cost.kv_bytes_per_token()
        transfer_s = self.link.transfer_time(nbytes)
        prefill_s = self.loop.now - state.queued_at
        first = RequestOutput(
            request_id,
            [PLACEHOLDER_TOKEN],
            num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=seq.num_cached_tokens,
        )

        def sent_done() -> None:
            if self.dead:
                return
            self.call(lambda: self.scheduler.release_held(request_id))  # queued for the engine thread
            if self.fail_prefills:
                self._emit(PrefillFailed(request_id, f"the KV transfer of {request_id} failed"))
                return
            self.counters.kv_blocks_sent += sent
            self.counters.kv_bytes_sent += nbytes
            self._emit(PrefillResult(first, sent, nbytes, transfer_s, prefill_s))

        self.loop.after(transfer_s, sent_done)

    # ---- stepping ----------------------------------------------------------------------------
    def _maybe_step(self) -> None:
        if self.busy or self.removed or not self.scheduler.has_schedulable_work():
            return
        out = self.scheduler.schedule()
        if not out.chunks:
            return  # nothing fits now (blocks held for a transfer): a later call wakes us
        now = self.loop.now
        plan = []
        shape_rows = []
        for chunk in out.chunks:
            seq = chunk.seq
            before = seq.num_computed_tokens  # cached prefix included; the step adds chunk.num_tokens
            sample = before + chunk.num_tokens == seq.num_tokens
            plan.append((seq, chunk.num_tokens, sample))
            shape_rows.append((before, chunk.num_tokens, sample))
            state = self._states.get(seq.request_id)
            if state is not None and state.started_at is None:
                state.started_at = now
                self.counters.queue_s.append(now - state.queued_at)
                if self.on_started is not None:
                    self.on_started(seq.request_id, now - state.queued_at)
        shape = StepShape.of(shape_rows)
        dt = self.cost.step_time(shape)
        if self.lora is not None:  # the adapters' slots loaded before the forward, their kernels in it
            dt = self.lora.costs.step_time(dt, *self.lora.load_for(chunk.seq.adapter for chunk in out.chunks))
        self.busy = True
        self._step_began = now
        c = self.counters
        c.steps += 1
        c.tokens += shape.tokens
        c.prefill_tokens += shape.prefill_tokens
        c.decode_tokens += shape.decode_seqs
        if self.host is not None:  # dt is the step alone; the others' steps meanwhile stretch it
            self.host.run(self, dt, self._end_step, plan)
        else:
            self.loop.after(dt, self._end_step, plan)

    def _end_step(self, plan: list[tuple[Sequence, int, bool]]) -> None:
        if self.dead:
            return
        self.counters.busy_s += self.loop.now - self._step_began
        bm = self.block_manager
        sampled = []
        bs = self.settings.block_size
        for seq, n, sample in plan:
            before = seq.num_computed_tokens
            seq.num_computed_tokens += n
            # Only a step that fills a block can cache one.
            if (before + n) // bs > before // bs:
                bm.cache_computed_blocks(seq)
            if sample:
                sampled.append(seq)
        states = self._states
        for seq in sampled:
            state = states.get(seq.request_id)
            if state is None:  # aborted during the step
                continue
            seq.append_token(PLACEHOLDER_TOKEN)
            num_output = seq.num_output_tokens
            finished = num_output >= seq.sampling_params.max_tokens
            if state.prefill is not None and not finished:
                self.scheduler.hold(seq)
                del states[seq.request_id]
                self._send(seq, state)
                continue
            if finished:
                self._finish(seq)
            output = RequestOutput(
                seq.request_id,
                [PLACEHOLDER_TOKEN],
                finished=finished,
                finish_reason="length" if finished else None,
                num_prompt_tokens=seq.num_prompt_tokens,
                num_cached_tokens=seq.num_cached_tokens,
                num_output_tokens=num_output,
                attempt=state.attempt,
            )
            if state.prefill is not None:  # a one-token request: P's token is the answer, nothing moves
                self._emit(PrefillResult(output, 0, 0, 0.0, self.loop.now - state.queued_at))
            else:
                self._emit(output)
        self._collect_events()
        self.busy = False
        while self._commands and not self.busy:
            self._commands.popleft()()
        self._maybe_step()

    def _finish(self, seq: Sequence) -> None:
        self.scheduler.finish(seq)
        self._states.pop(seq.request_id, None)

    # ---- what the router sees ----------------------------------------------------------------
    def _collect_events(self) -> None:
        events = self.block_manager.drain_events()
        if not events or self._events_lost:
            return
        self._events.extend(events)
        self._event_hashes += sum(len(e.block_hashes) or 1 for e in events)
        if self._event_hashes > self._max_event_hashes:
            self._events, self._event_hashes, self._events_lost = [], 0, True

    def take_kv_events(self) -> tuple[list[KVEvent], tuple[int, ...] | None]:
        """(events, None), or ([], snapshot of every cached hash) after the buffer overflowed: as the worker does."""
        self._collect_events()
        if self._events_lost:
            out: tuple[list[KVEvent], tuple[int, ...] | None] = ([], self.block_manager.cached_hashes())
        else:
            out = (self._events, None)
        self._events, self._event_hashes, self._events_lost = [], 0, False
        return out

    def requests(self) -> list[str]:
        """The requests this worker holds now (running, waiting, reserved, or held for a send)."""
        return [*self._states, *self.scheduler.held]

    @property
    def num_requests(self) -> int:
        return len(self._states) + len(self.scheduler.held)

    @property
    def idle(self) -> bool:
        return not self.busy and self.num_requests == 0 and not self._commands
