"""A simulated worker: the real scheduler and block manager from `workers/`, timed by a cost model.

`SimWorker` runs what `workers.engine.LLMEngine.step` runs (the same `Scheduler` and
`BlockManager` objects: continuous batching, chunked prefill under the token budget, preemption
when KV runs out, prefix-cache hits, KV events), except the model: a step's duration comes from
the cost model applied to the step's shape, and each sampled row gets a placeholder token.

Timing follows the real worker's threading (workers/worker.py): the engine thread runs steps back
to back, and a call from the router (add, reserve, start decoding, release) runs only between two
steps, so a call that arrives during a step waits for its end. (A prefill's send begins on the
engine thread as its step ends: the simulator calls begin_send from the step's output.)
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from cluster.sim.costs import CostModel, StepShape
from common.protocol import KVEvent
from common.sampling_params import SamplingParams
from workers.block_manager import BlockManager
from workers.scheduler import Scheduler
from workers.sequence import Sequence

__all__ = ["EngineSettings", "EventLoop", "SimWorker"]

PLACEHOLDER_TOKEN = 0  # sampled tokens; prompts use ids >= 1000, so they never collide with prompt blocks


class _Seq(Sequence):
    """The engine's Sequence compared by identity, as the scheduler means it: the dataclass's generated
    __eq__ compares every field (token lists included) each time `running.index(seq)` passes an element,
    which made big simulated batches quadratic in tokens. Nothing else differs."""

    __eq__ = object.__eq__
    __hash__ = object.__hash__


class EventLoop:
    """A heap of timed callbacks; `now` is the simulated time in seconds. Callbacks at the same
    time run in the order they were scheduled."""

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list = []
        self._pushes = 0  # callbacks scheduled so far: each one's place in the order of a tie
        self._open_group: tuple[int, float, Callable, list] | None = None  # see after_grouped

    def at(self, t: float, fn: Callable, *args) -> None:
        now = self.now
        self._pushes += 1
        heapq.heappush(self._heap, (t if t > now else now, self._pushes, fn, args))

    def after(self, dt: float, fn: Callable, *args) -> None:
        # at(now + dt) written out: a simulation schedules an event or two per token.
        now = self.now
        t = now + dt
        self._pushes += 1
        heapq.heappush(self._heap, (t if t > now else now, self._pushes, fn, args))

    def after_grouped(self, dt: float, fn: Callable, *args) -> None:
        """after(dt, fn, *args), in one heap entry with the previous call when that was to the same
        fn at the same time and nothing was scheduled in between (a step's outputs, one per
        sequence): the calls run back to back at that time either way, in the same order."""
        now = self.now
        t = now + dt
        t = t if t > now else now
        group = self._open_group
        if group is not None and group[0] == self._pushes and group[1] == t and group[2] == fn:
            group[3].append(args)
            return
        calls = [args]
        self._pushes += 1
        heapq.heappush(self._heap, (t, self._pushes, self._run_group, (fn, calls)))
        self._open_group = (self._pushes, t, fn, calls)

    def _run_group(self, fn: Callable, calls: list) -> None:
        if self._open_group is not None and self._open_group[3] is calls:
            self._open_group = None  # running: a call scheduled from now on goes after what is queued
        for args in calls:
            fn(*args)

    def run(self, until: float | None = None, stop: Callable[[], bool] | None = None) -> None:
        heap, pop = self._heap, heapq.heappop
        limit = math.inf if until is None else until
        while heap:
            if heap[0][0] > limit:
                self.now = limit
                return
            t, _, fn, args = pop(heap)
            self.now = t
            fn(*args)
            if stop is not None and stop():
                return

    def __len__(self) -> int:
        return len(self._heap)


@dataclass(frozen=True)
class EngineSettings:
    """The engine knobs that shape scheduling (workers.config.EngineConfig's names)."""

    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 256
    enable_prefix_caching: bool = True
    num_kv_blocks: int | None = None  # default: what the cost model's KV capacity holds

    def __post_init__(self) -> None:
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


# (request id, output tokens so far, finished, prompt tokens this worker found cached)
OutputCallback = Callable[[str, int, bool, int], None]


@dataclass
class _SeqState:
    seq: Sequence
    on_output: OutputCallback
    prefill_only: bool = False
    queued_at: float = 0.0
    started_at: float | None = None


@dataclass
class WorkerCounters:
    busy_s: float = 0.0
    steps: int = 0
    tokens: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    queue_s: list[float] = field(default_factory=list)  # add to first chunk, per request
    kv_blocks_sent: int = 0


class SimWorker:
    def __init__(self, loop: EventLoop, worker_id: str, role: str, cost: CostModel, settings: EngineSettings) -> None:
        self.loop = loop
        self.worker_id = worker_id
        self.role = role
        self.cost = cost
        self.settings = settings
        num_blocks = settings.num_kv_blocks or cost.kv_capacity_tokens() // settings.block_size
        if num_blocks < 1:
            raise ValueError(f"worker {worker_id}: the KV cache holds no block of {settings.block_size} tokens")
        self.block_manager = BlockManager(num_blocks, settings.block_size, settings.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, settings.max_num_seqs, settings.max_num_batched_tokens)
        self.alive = True  # the router may route here
        self.removed = False
        self.busy = False
        self._commands: deque[Callable[[], None]] = deque()
        self._states: dict[str, _SeqState] = {}
        self._events: list[KVEvent] = []
        self._event_hashes = 0
        self._events_lost = False
        self._max_event_hashes = max(1024, 4 * num_blocks)
        self.counters = WorkerCounters()
        self.on_started: Callable[[str, float], None] | None = None  # (request id, seconds it queued here)

    # ---- calls (between steps) -------------------------------------------------------------
    def call(self, fn: Callable[[], None]) -> None:
        """Run fn between steps: now if idle, else at the end of the current step."""
        if self.busy:
            self._commands.append(fn)
            return
        fn()
        self._maybe_step()

    def _new_seq(self, request_id: str, prompt: tuple[int, ...], output_len: int) -> Sequence:
        if request_id in self._states or request_id in self.scheduler.held:
            raise ValueError(f"request {request_id!r} is already on {self.worker_id}")
        params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
        return _Seq(request_id, list(prompt), params, arrival_time=self.loop.now)

    def add(
        self,
        request_id: str,
        prompt: tuple[int, ...],
        output_len: int,
        on_output: OutputCallback,
        prefill_only: bool = False,
    ) -> None:
        seq = self._new_seq(request_id, prompt, output_len)
        self._states[request_id] = _SeqState(seq, on_output, prefill_only, self.loop.now)
        self.scheduler.add(seq)

    def reserve(
        self, request_id: str, prompt: tuple[int, ...], output_len: int, on_output: OutputCallback
    ) -> tuple[int, int] | None:
        """Decode side: (blocks reserved, tokens already cached here), or None when full right now."""
        seq = self._new_seq(request_id, prompt, output_len)
        if not self.scheduler.add_reserved(seq):
            return None
        self._states[request_id] = _SeqState(seq, on_output, False, self.loop.now, self.loop.now)
        return len(seq.block_ids), seq.num_cached_tokens

    def kv_arrived(self, request_id: str) -> None:
        seq = self._states[request_id].seq
        self.scheduler.kv_arrived(seq)
        seq.append_token(PLACEHOLDER_TOKEN)
        if seq.num_output_tokens >= seq.sampling_params.max_tokens:  # unreachable via the router; kept exact
            self._finish(seq)

    def abort(self, request_id: str) -> None:
        state = self._states.pop(request_id, None)
        if state is not None:
            self.scheduler.finish(state.seq)

    def begin_send(self, request_id: str) -> list[int]:
        return self.scheduler.begin_send(request_id)

    def release(self, request_id: str) -> None:
        self.scheduler.release_held(request_id)

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
        for c in out.chunks:
            seq = c.seq
            before = seq.num_computed_tokens  # cached prefix included; the step adds c.num_tokens
            sample = before + c.num_tokens == seq.num_tokens
            plan.append((seq, c.num_tokens, sample))
            shape_rows.append((before, c.num_tokens, sample))
            state = self._states.get(seq.request_id)
            if state is not None and state.started_at is None:
                state.started_at = now
                self.counters.queue_s.append(now - state.queued_at)
                if self.on_started is not None:
                    self.on_started(seq.request_id, now - state.queued_at)
        shape = StepShape.of(shape_rows)
        dt = self.cost.step_time(shape)
        self.busy = True
        c = self.counters
        c.busy_s += dt
        c.steps += 1
        c.tokens += shape.tokens
        c.prefill_tokens += shape.prefill_tokens
        c.decode_tokens += shape.decode_seqs
        self.loop.after(dt, self._end_step, plan)

    def _end_step(self, plan: list[tuple[Sequence, int, bool]]) -> None:
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
            state = states[seq.request_id]
            seq.append_token(PLACEHOLDER_TOKEN)
            num_output = seq.num_output_tokens
            finished = num_output >= seq.sampling_params.max_tokens
            if finished:
                self._finish(seq)
            elif state.prefill_only:
                self.scheduler.hold(seq)
                del states[seq.request_id]
            state.on_output(seq.request_id, num_output, finished, seq.num_cached_tokens)
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

    def stats(self) -> tuple[int, int, float]:
        """(running, waiting, kv usage) as the worker's heartbeat reports them."""
        return len(self.scheduler.running), len(self.scheduler.waiting), self.block_manager.usage

    @property
    def num_requests(self) -> int:
        return len(self._states) + len(self.scheduler.held)

    @property
    def idle(self) -> bool:
        return not self.busy and self.num_requests == 0 and not self._commands
