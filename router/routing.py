"""Routing policies: which prefill worker and which decode worker serve a request.

The interface is one method, `choose(prompt_token_ids, workers) -> RouteDecision`, so policies
swap without touching the HTTP layer. Four are built in (`make_policy(name, ...)`):

- `kv-aware` (default, `KvAwarePolicy`): prefix overlap from the router's `PrefixIndex`, load,
  and conditional disaggregation. Cost of a candidate worker W, in prompt-token equivalents:

      cost(W) = weight_uncached * uncached_tokens(W)        # prompt minus W's longest cached prefix
              + weight_queue    * queued_prefill_tokens(W)  # prompts routed to W, not yet prefilled
              + weight_kv       * kv_usage(W)               # (decode only) 0..1, a full cache costs weight_kv
              + weight_running  * (running(W) + waiting(W)) # (decode only) per sequence in its batch
              + weight_lora     * lora_affinity(W, adapter)   # 0 running there, .25 resident, .5 free slot, 1 evict

  queued_prefill_tokens counts the whole prompts (cached part included) of requests routed to W
  that have no first token yet, from the moment each route is chosen (so the requests of a burst
  see each other: WorkerPools.routed): a prefill reads its whole context in attention and holds
  all of its blocks, and counting whole prompts is what stops herding. With a hot prefix cached on W
  only, W keeps winning while its queue is shorter than the recomputation saved (the prefix
  length); past that, requests split about evenly instead of piling onto W.
  The decode worker D is drawn from the decode pool (its prefix counts: `reserve` and local
  prefill reuse D's cache). Then: D prefills locally when D's uncached part is at most
  `local_prefill_threshold` tokens (reason `local_short_uncached`), when no prefill worker is
  alive (`local_no_prefill_worker`), or when every prefill worker has more than
  `prefill_queue_threshold` queued tokens (`local_prefill_busy`). Otherwise the prefill worker
  P is drawn from the prefill pool (`remote_prefill`). Left automatic, that threshold follows the
  prefill pool's device (`RoutingConfig.for_device`): a prefill worker on a CPU core takes
  seconds per thousand tokens, so past 1,024 queued tokens a long prompt starts sooner on the
  decode worker's core (whose streams then slow down for its chunks, but do not stop); a GPU
  clears 8,192 in a fraction of a second.
  Each draw is a softmax over -cost / (temperature * scale), scale = the prompt length: at
  temperature 0.1 a worker costing 10% of the prompt more is e times less likely. A hot prefix
  thus keeps its worker while that worker's queue is short, and spills over once the queue costs
  more than the recomputation elsewhere, instead of herding everything onto one worker.
  temperature 0 is a plain argmin (ties to the lowest id).
- `round-robin`: each pool in turn; always remote prefill (local only without prefill workers).
- `random`: uniform over each pool's live workers; always remote prefill.
- `least-loaded`: fewest running + waiting (then queued prefill tokens, then KV usage).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Protocol

from common.block_hash import hash_prefix_blocks, root_hash
from common.request import RequestContext
from common.roles import Role
from router.backend import RouteDecision, WorkerInfo
from router.prefix_index import PrefixIndex

__all__ = [
    "POLICIES",
    "KvAwarePolicy",
    "LeastLoadedPolicy",
    "NoWorkerAvailable",
    "RandomPolicy",
    "RoundRobinPolicy",
    "RoutingConfig",
    "RoutingPolicy",
    "live_workers",
    "make_policy",
]

POLICIES = ("kv-aware", "round-robin", "random", "least-loaded")


class NoWorkerAvailable(RuntimeError):
    """A pool has no live worker; the router answers 503 with Retry-After."""

    def __init__(self, pool: str, message: str | None = None) -> None:
        self.pool = pool
        super().__init__(message or f"no live {pool} worker is available; retry later")


class RoutingPolicy(Protocol):
    def choose(
        self, prompt_token_ids: Sequence[int], workers: Sequence[WorkerInfo], context: RequestContext | None = None
    ) -> RouteDecision:
        """Pick the workers for one request; raise NoWorkerAvailable when a needed pool is empty.
        `context`: who the request is; a cache-aware policy hashes its prompt under the context's
        `kv_namespace` (what its KV depends on besides its tokens) and ranks workers by where its
        LoRA adapter is resident."""
        ...


def live_workers(workers: Sequence[WorkerInfo], role: Role) -> list[WorkerInfo]:
    """The pool's workers that take new requests: alive and not draining."""
    return [w for w in workers if w.role == role and w.alive and not w.draining]


def able_workers(workers: Sequence[WorkerInfo], context: RequestContext | None) -> Sequence[WorkerInfo]:
    """The workers that serve the request's LoRA adapter (all of them for a base-model request).
    A worker started after a run-time load lacks it until loaded there; a worker yet to report
    its stats (max_loras 0) is given the benefit of the doubt."""
    adapter = context.adapter if context is not None else None
    if adapter is None:
        return workers
    return [w for w in workers if not w.lora.max_loras or w.lora.serves(adapter)]


class RoundRobinPolicy:
    """Prefill round-robin over live prefill workers, decode round-robin over live decode workers.

    Each pool keeps the id of the worker it picked last and moves to the next live one in id
    order, so a worker dying or joining does not reshuffle the others. With
    `local_prefill_fallback`, an empty prefill pool means the decode worker prefills locally
    instead of a 503.
    """

    def __init__(self, local_prefill_fallback: bool = False) -> None:
        self.local_prefill_fallback = local_prefill_fallback
        self._last: dict[str, str | None] = {Role.PREFILL: None, Role.DECODE: None}

    def _next(self, workers: Sequence[WorkerInfo], role: Role) -> str | None:
        ids = sorted(w.worker_id for w in live_workers(workers, role))
        if not ids:
            return None
        last = self._last[role]
        chosen = ids[0]
        if last is not None:
            chosen = next((i for i in ids if i > last), ids[0])
        self._last[role] = chosen
        return chosen

    def choose(
        self, prompt_token_ids: Sequence[int], workers: Sequence[WorkerInfo], context: RequestContext | None = None
    ) -> RouteDecision:
        workers = able_workers(workers, context)
        decode = self._next(workers, Role.DECODE)
        if decode is None:
            raise NoWorkerAvailable(Role.DECODE)
        prefill = self._next(workers, Role.PREFILL)
        if prefill is None:
            if not self.local_prefill_fallback:
                raise NoWorkerAvailable(Role.PREFILL)
            return RouteDecision(decode_worker=decode, prefill_worker=None, reason="local_prefill_no_prefill_worker")
        return RouteDecision(decode_worker=decode, prefill_worker=prefill, reason="round_robin")


# prefill_queue_threshold left automatic, by the prefill pool's device (see the module docstring;
# measured in bench/results/issue29_attempts/prefill_queue_threshold.json).
CPU_PREFILL_QUEUE_THRESHOLD = 1024
GPU_PREFILL_QUEUE_THRESHOLD = 8192


@dataclass(frozen=True)
class RoutingConfig:
    """Knobs of the routing policies; each field's metadata names its `baton serve` flag."""

    policy: str = field(
        default="kv-aware",
        metadata={
            "flag": "routing_policy",
            "choices": POLICIES,
            "help": "how the router picks workers; kv-aware: prefix overlap + load",
        },
    )
    weight_uncached: float = field(
        default=1.0, metadata={"flag": "routing_weight_uncached", "help": "kv-aware cost per uncached prompt token"}
    )
    weight_queue: float = field(
        default=1.0,
        metadata={
            "flag": "routing_weight_queue",
            "help": "kv-aware cost per prompt token queued for prefill on the worker",
        },
    )
    weight_kv: float = field(
        default=512.0,
        metadata={
            "flag": "routing_weight_kv",
            "help": "kv-aware cost of a full KV cache on a decode worker (scaled by usage)",
        },
    )
    weight_running: float = field(
        default=16.0,
        metadata={
            "flag": "routing_weight_running",
            "help": "kv-aware cost per sequence running or waiting on a decode worker",
        },
    )
    weight_lora: float = field(
        default=256.0,
        metadata={
            "flag": "routing_weight_lora",
            "help": "kv-aware cost of a worker that must evict a LoRA adapter to load the request's "
            "(a quarter when the adapter is resident but idle, half when a slot is free, none when it runs there)",
        },
    )
    temperature: float = field(
        default=0.1,
        metadata={
            "flag": "routing_temperature",
            "help": "softmax temperature of the kv-aware draw, relative to the prompt length; 0: argmin",
        },
    )
    local_prefill_threshold: int = field(
        default=64, metadata={"help": "uncached prompt tokens at or below which the decode worker prefills itself"}
    )
    prefill_queue_threshold: int | None = field(
        default=None,
        metadata={
            "help": "queued prefill tokens per prefill worker beyond which decode workers prefill locally "
            f"(default: {CPU_PREFILL_QUEUE_THRESHOLD} when the prefill pool runs on CPUs, "
            f"{GPU_PREFILL_QUEUE_THRESHOLD} on GPUs)"
        },
    )
    seed: int | None = field(
        default=None,
        metadata={"flag": "routing_seed", "help": "seed of the kv-aware and random policies' draws (default: random)"},
    )

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"routing policy must be one of {', '.join(POLICIES)}; got {self.policy!r}")
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name not in ("policy", "seed") and value is not None:
                if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0 or math.isnan(value):
                    raise ValueError(f"routing option {f.name} must be a number >= 0, got {value!r}")
        if not isinstance(self.local_prefill_threshold, int):
            raise ValueError(
                f"routing option local_prefill_threshold must be an integer, got {self.local_prefill_threshold!r}"
            )
        if self.prefill_queue_threshold is not None and not isinstance(self.prefill_queue_threshold, int):
            raise ValueError(
                f"routing option prefill_queue_threshold must be an integer, got {self.prefill_queue_threshold!r}"
            )

    def for_device(self, device: str) -> RoutingConfig:
        """This configuration with an automatic prefill_queue_threshold set for a prefill pool on
        `device` ("cpu" or "cuda")."""
        if self.prefill_queue_threshold is not None:
            return self
        return replace(
            self,
            prefill_queue_threshold=CPU_PREFILL_QUEUE_THRESHOLD if device == "cpu" else GPU_PREFILL_QUEUE_THRESHOLD,
        )

    @property
    def queue_threshold(self) -> int:
        """prefill_queue_threshold, the GPU default where nothing set it (a policy built without a
        deployment: the simulator, tests)."""
        return GPU_PREFILL_QUEUE_THRESHOLD if self.prefill_queue_threshold is None else self.prefill_queue_threshold


class RandomPolicy:
    """Uniformly random live worker in each pool; remote prefill whenever a prefill worker lives."""

    def __init__(self, seed: int | None = None, local_prefill_fallback: bool = True) -> None:
        self._rng = random.Random(seed)
        self.local_prefill_fallback = local_prefill_fallback

    def choose(
        self, prompt_token_ids: Sequence[int], workers: Sequence[WorkerInfo], context: RequestContext | None = None
    ) -> RouteDecision:
        workers = able_workers(workers, context)
        decode = live_workers(workers, Role.DECODE)
        if not decode:
            raise NoWorkerAvailable(Role.DECODE)
        d = self._rng.choice(decode).worker_id
        prefill = live_workers(workers, Role.PREFILL)
        if not prefill:
            if not self.local_prefill_fallback:
                raise NoWorkerAvailable(Role.PREFILL)
            return RouteDecision(d, None, "local_no_prefill_worker")
        return RouteDecision(d, self._rng.choice(prefill).worker_id, "random")


def _load_key(w: WorkerInfo) -> tuple:
    return (w.running + w.waiting, w.queued_prefill_tokens, w.kv_usage, w.worker_id)


class LeastLoadedPolicy:
    """The live worker with the fewest running + waiting sequences in each pool; remote prefill."""

    def __init__(self, local_prefill_fallback: bool = True) -> None:
        self.local_prefill_fallback = local_prefill_fallback

    def choose(
        self, prompt_token_ids: Sequence[int], workers: Sequence[WorkerInfo], context: RequestContext | None = None
    ) -> RouteDecision:
        workers = able_workers(workers, context)
        decode = live_workers(workers, Role.DECODE)
        if not decode:
            raise NoWorkerAvailable(Role.DECODE)
        d = min(decode, key=_load_key).worker_id
        prefill = live_workers(workers, Role.PREFILL)
        if not prefill:
            if not self.local_prefill_fallback:
                raise NoWorkerAvailable(Role.PREFILL)
            return RouteDecision(d, None, "local_no_prefill_worker")
        return RouteDecision(d, min(prefill, key=_load_key).worker_id, "least_loaded")


class KvAwarePolicy:
    """Prefix overlap + load, with conditional disaggregation; see the module docstring for the cost."""

    def __init__(self, index: PrefixIndex, block_size: int, config: RoutingConfig | None = None) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.index = index
        self.block_size = block_size
        self.config = config or RoutingConfig()
        self._rng = random.Random(self.config.seed)

    def _cost(self, w: WorkerInfo, uncached: int, decode: bool, adapter: str | None = None) -> float:
        c = self.config
        cost = c.weight_uncached * uncached + c.weight_queue * w.queued_prefill_tokens
        cost += c.weight_lora * w.lora.affinity(adapter)
        if decode:
            cost += c.weight_kv * w.kv_usage + c.weight_running * (w.running + w.waiting)
        return cost

    def _draw(self, candidates: list[WorkerInfo], costs: list[float], scale: float) -> int:
        t = self.config.temperature
        best = min(range(len(costs)), key=lambda i: (costs[i], candidates[i].worker_id))
        if t <= 0 or len(costs) == 1:
            return best
        lo = costs[best]
        weights = [math.exp(-(c - lo) / (t * scale)) for c in costs]
        r = self._rng.random() * sum(weights)
        for i, wt in enumerate(weights):
            r -= wt
            if r <= 0:
                return i
        return best

    def choose(
        self, prompt_token_ids: Sequence[int], workers: Sequence[WorkerInfo], context: RequestContext | None = None
    ) -> RouteDecision:
        workers = able_workers(workers, context)
        c = self.config
        n = len(prompt_token_ids)
        bs = self.block_size
        # The last prompt token is always computed (it yields the logits), so never count it cached.
        namespace = context.kv_namespace if context is not None else None
        adapter = context.adapter if context is not None else None
        hashes = hash_prefix_blocks(prompt_token_ids[: max(0, n - 1)], bs, root_hash(namespace))
        matched = self.index.match(hashes) if hashes else {}
        scale = float(max(n, bs))

        decode = live_workers(workers, Role.DECODE)
        if not decode:
            raise NoWorkerAvailable(Role.DECODE)
        d_uncached = [n - matched.get(w.worker_id, 0) * bs for w in decode]
        i = self._draw(decode, [self._cost(w, u, True, adapter) for w, u in zip(decode, d_uncached)], scale)
        d, d_unc = decode[i], d_uncached[i]
        d_blocks = matched.get(d.worker_id, 0)

        if d_unc <= c.local_prefill_threshold:
            return RouteDecision(d.worker_id, None, "local_short_uncached", d_blocks)
        prefill = live_workers(workers, Role.PREFILL)
        if not prefill:
            return RouteDecision(d.worker_id, None, "local_no_prefill_worker", d_blocks)
        if min(w.queued_prefill_tokens for w in prefill) > c.queue_threshold:
            return RouteDecision(d.worker_id, None, "local_prefill_busy", d_blocks)
        p_uncached = [n - matched.get(w.worker_id, 0) * bs for w in prefill]
        j = self._draw(prefill, [self._cost(w, u, False, adapter) for w, u in zip(prefill, p_uncached)], scale)
        p = prefill[j]
        return RouteDecision(d.worker_id, p.worker_id, "remote_prefill", matched.get(p.worker_id, 0))


def make_policy(
    config: RoutingConfig | str = "kv-aware", index: PrefixIndex | None = None, block_size: int = 16
) -> RoutingPolicy:
    """The policy named by `config.policy` (kv-aware needs the backend's prefix index)."""
    if isinstance(config, str):
        config = RoutingConfig(policy=config)
    if config.policy == "kv-aware":
        if index is None:
            raise ValueError("the kv-aware routing policy needs a prefix index (the backend's)")
        return KvAwarePolicy(index, block_size, config)
    if config.policy == "round-robin":
        return RoundRobinPolicy(local_prefill_fallback=True)
    if config.policy == "random":
        return RandomPolicy(config.seed)
    return LeastLoadedPolicy()
