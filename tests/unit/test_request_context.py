"""A request's identity (common.request.RequestContext): refused when malformed, the same object from
the router's edge to the worker's call records, and part of what a KV block is: a prompt's blocks
under one adapter are never another adapter's, in the router's prefix index or the worker's cache.
Oracles: hand-written values, and the block hashes of the same prompt without a namespace."""

from __future__ import annotations

import asyncio
import math

import pytest

from common.block_hash import ROOT_PARENT_HASH, hash_prefix_blocks, root_hash
from common.request import DEFAULT_TENANT, RequestContext
from common.roles import Role
from common.sampling_params import SamplingParams
from router.backend import RouteDecision, WorkerInfo
from router.pools import WorkerPools
from router.prefix_index import PrefixIndex
from router.ray_backend import RayBackend
from router.routing import KvAwarePolicy, RoutingConfig
from tests.routing.fake_actors import FakeActor, make_request
from workers.engine.block_manager import BlockManager
from workers.engine.sequence import Sequence

BS = 16
PROMPT = list(range(500, 564))  # four full blocks


@pytest.mark.parametrize(
    "fields,message",
    [
        ({"request_id": ""}, "request_id"),
        ({"request_id": "r", "priority": True}, "priority"),
        ({"request_id": "r", "priority": 1.5}, "priority"),
        ({"request_id": "r", "tenant": ""}, "tenant"),
        ({"request_id": "r", "adapter": ""}, "adapter"),
        ({"request_id": "r", "deadline": math.inf}, "deadline"),
    ],
)
def test_a_malformed_context_is_refused_naming_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        RequestContext(**fields)


def test_a_context_defaults_and_its_choices_keep_everything_but_the_id():
    ctx = RequestContext("chatcmpl-1", model="m", adapter="sql", priority=-2, deadline=100.0)
    assert ctx.tenant == DEFAULT_TENANT and ctx.trace_id == "chatcmpl-1" and ctx.kv_namespace == "sql"
    second = ctx.for_choice("chatcmpl-1-1")
    assert second.request_id == "chatcmpl-1-1" and second.trace_id == "chatcmpl-1"
    assert (second.model, second.adapter, second.priority, second.deadline) == ("m", "sql", -2, 100.0)
    assert ctx.seconds_left(now=90.0) == 10.0 and RequestContext("r").seconds_left() is None


def test_a_namespace_starts_another_chain_of_block_hashes():
    base = hash_prefix_blocks(PROMPT, BS)
    assert root_hash(None) == ROOT_PARENT_HASH and hash_prefix_blocks(PROMPT, BS, root_hash(None)) == base
    a, b = (hash_prefix_blocks(PROMPT, BS, root_hash(n)) for n in ("adapter-a", "adapter-b"))
    assert len(a) == len(b) == len(base) == 4
    assert not set(a) & set(b) and not set(a) & set(base)
    assert hash_prefix_blocks(PROMPT, BS, root_hash("adapter-a")) == a  # stable


def computed(bm: BlockManager, request_id: str, adapter: str | None) -> Sequence:
    """A sequence whose whole prompt was computed and cached, as a prefill leaves it."""
    seq = Sequence(
        request_id, list(PROMPT) + [7], SamplingParams(), context=RequestContext(request_id, adapter=adapter)
    )
    assert bm.allocate_prefix_and_new(seq, bm.find_cached_prefix(seq), seq.num_tokens)
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_computed_blocks(seq)
    return seq


def test_the_workers_prefix_cache_hands_an_adapters_blocks_only_to_that_adapter():
    bm = BlockManager(64, BS)
    computed(bm, "first", "adapter-a")
    for adapter, hits in (("adapter-a", 4), ("adapter-b", 0), (None, 0)):
        ask = Sequence("ask", list(PROMPT) + [7], SamplingParams(), context=RequestContext("ask", adapter=adapter))
        assert len(bm.find_cached_prefix(ask)) == hits, adapter


def test_the_routers_index_matches_a_prompt_under_its_own_adapter_only():
    index = PrefixIndex()
    index.add("decode-0", hash_prefix_blocks(PROMPT, BS, root_hash("adapter-a")))
    policy = KvAwarePolicy(index, BS, RoutingConfig(seed=0, temperature=0.0))
    workers = [WorkerInfo("decode-0", Role.DECODE), WorkerInfo("prefill-0", Role.PREFILL)]
    assert policy.choose(PROMPT + [7], workers, RequestContext("r1", adapter="adapter-a")).cached_blocks == 4
    assert policy.choose(PROMPT + [7], workers, RequestContext("r2", adapter="adapter-b")).cached_blocks == 0
    assert policy.choose(PROMPT + [7], workers).cached_blocks == 0


def test_the_context_made_at_the_edge_is_what_every_worker_call_carries():
    """Reserve and start on D, prefill on P, then a migration's resubmit: each call's record holds
    the very context the request was made with."""
    seen: list[tuple[str, RequestContext]] = []

    class Recording(FakeActor):
        async def _reserve(self, call):
            seen.append((f"reserve@{self.worker_id}", call.request.context))
            return await super()._reserve(call)

        async def _prefill(self, call):
            seen.append((f"prefill@{self.worker_id}", call.request.context))
            return await super()._prefill(call)

        async def _submit(self, call):
            seen.append((f"submit@{self.worker_id}", call.request.context))
            return await super()._submit(call)

    async def main() -> None:
        actors = [Recording(w, w.split("-")[0], step_s=0.01) for w in ("prefill-0", "decode-0", "decode-1")]
        backend = RayBackend(WorkerPools(actors, health_interval_s=0.05, poll_timeout_s=0.02))
        request = make_request("ctx", PROMPT, SamplingParams(max_tokens=6), RouteDecision("decode-0", "prefill-0"))
        context = RequestContext("ctx", model="m", adapter="sql", priority=3, tenant="acme", deadline=2e9)
        request = type(request)(
            type(request.request)(context, PROMPT, request.sampling_params), request.route, request.trace
        )
        backend.workers()
        outputs = 0
        async for out in backend.generate(request):
            outputs += len(out.token_ids)
            if outputs == 2:
                backend.pools.mark_down(backend.pools.get("decode-0"), RuntimeError("lost"))
        await backend.close()
        assert outputs == 6

    asyncio.run(main())
    assert [where for where, _ in seen] == ["reserve@decode-0", "prefill@prefill-0", "submit@decode-1"]
    assert all(ctx is seen[0][1] and ctx.adapter == "sql" and ctx.tenant == "acme" for _, ctx in seen)
