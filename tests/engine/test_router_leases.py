"""Router leases on real workers (no Ray): a router that stops calling loses its requests and
their KV blocks in both pools once its lease runs out; a router that keeps polling is untouched;
outputs and KV events go to the router that owns them.

Two EngineWorkers in this process (prefill + decode over shared memory), as test_worker_handoff.
The oracle for "untouched" is the same request on a lone engine (greedy: identical tokens).
"""

from __future__ import annotations

import time

import pytest

from common.protocol import KVEventKind, PrefillResult, RouterClaim
from common.request import PrefillRequest, RequestOwner
from common.sampling_params import SamplingParams
from testkit import workers
from testkit.harness import wait_until
from tests.engine.helpers import worker_pair
from workers.build import load_engine
from workers.config import EngineConfig
from workers.shell.worker import EngineWorker

pytestmark = pytest.mark.slow
# Small prefill chunks: a long prompt takes many engine steps, so a lease runs out in the middle.
CONFIG = EngineConfig(kv_cache_memory=48 << 20, max_num_batched_tokens=32)
GONE = RouterClaim("router-gone", lease_s=0.3)  # never calls again after creating its requests
LIVE = RouterClaim("router-live", lease_s=60.0)


@pytest.fixture(scope="module")
def pair(default_model_dir):
    with worker_pair(default_model_dir, CONFIG) as both:
        yield both


def collect(worker: EngineWorker, router: RouterClaim, request_id: str, timeout_s: float = 120.0) -> list[int]:
    """Poll as `router` until `request_id` finishes; fail on any output of another request."""
    tokens: list[int] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for out in worker.poll_outputs(0.2, router):
            assert out.request_id == request_id, f"{router.router_id} got {out.request_id}'s output"
            tokens += out.token_ids
            if out.finished:
                return tokens
    raise AssertionError(f"{request_id} did not finish in {timeout_s} s")


def test_a_silent_router_loses_its_requests_and_blocks_a_polling_one_keeps_its_own(
    pair, default_model_dir, chat_prompts
):
    prefill, decode = pair
    long_prompt = max(chat_prompts, key=len)[:600]  # 19 prefill chunks
    short = chat_prompts[0]
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    [want] = load_engine(default_model_dir, CONFIG).generate([chat_prompts[1]], params)

    # The live router's request decodes on D while the silent router's requests are created.
    workers.submit(decode, "live-1", chat_prompts[1], params, router=LIVE)
    # The silent router: a whole request decoding on D, and a reservation on D for a long prompt
    # whose prefill runs on P when its lease runs out.
    workers.submit(
        decode, "gone-1", short, SamplingParams(max_tokens=10_000, temperature=0.0, ignore_eos=True), router=GONE
    )
    reservation = workers.reserve(decode, "gone-2", long_prompt, params, router=GONE)
    assert reservation is not None
    # The prefill's outcome would go to GONE's outbox on P, which only a poll as GONE (a lease
    # renewal) could read: record what P reports for it as it reports it instead.
    outcomes: list[object] = []
    real_deliver = prefill.prefills.deliver

    def recording_deliver(items):
        outcomes.extend(i for i in items if i.request_id == "gone-2")
        real_deliver(items)

    prefill.prefills.deliver = recording_deliver
    try:
        prefill.prefill(
            PrefillRequest(
                workers.request("gone-2", long_prompt, params),
                decode.endpoint(),
                reservation.block_ids,
                reservation.num_cached_tokens,
                RequestOwner(GONE),
            )
        )
        assert {"gone-1", "gone-2"} <= set(decode._call(decode.engine.request_ids))

        live_tokens = collect(decode, LIVE, "live-1")  # LIVE polls all along; GONE never does
        assert live_tokens == want.token_ids  # untouched by the other router's end

        def blocks_free(worker: EngineWorker) -> bool:
            s = worker.stats()
            return s.num_free_blocks == s.num_blocks and s.num_running == 0 and s.num_waiting == 0

        wait_until(
            lambda: blocks_free(decode) and blocks_free(prefill), 10, "both pools to free the silent router's blocks"
        )
        assert decode._call(decode.engine.request_ids) == []
        assert prefill._call(lambda: "gone-2" not in {*prefill.prefills.pending, *prefill.engine.scheduler.held})
        # Nobody owns the silent router's requests any more, and its lease is gone on both workers.
        assert [r.router_id for r in decode.heartbeat(LIVE).routers] == ["router-live"]
        assert "router-gone" not in [r.router_id for r in prefill.heartbeat(LIVE).routers]
        # The prefill ended early: dropped before its first token (no outcome), or its handoff
        # refused by D (PrefillFailed); never finished (a PrefillResult).
        assert not any(isinstance(o, PrefillResult) for o in outcomes), (
            f"the prefill of a router whose lease ran out should end early, got {outcomes}"
        )
    finally:
        prefill.prefills.deliver = real_deliver
    # A late creation call of the gone router's request is refused (no blocks held by it again).
    with pytest.raises(Exception, match="aborted"):
        workers.submit(decode, "gone-1", short, params, router=GONE)


def test_outputs_and_kv_events_go_to_their_own_router(pair, chat_prompts):
    prefill, decode = pair
    a, b = RouterClaim("router-a", 60.0), RouterClaim("router-b", 60.0)
    # Both routers join now: their first heartbeat is a snapshot of D's whole cache.
    first_a, first_b = decode.heartbeat(a).kv_events, decode.heartbeat(b).kv_events
    assert first_a.snapshot is not None and sorted(first_a.snapshot) == sorted(first_b.snapshot)
    params = SamplingParams(max_tokens=8, temperature=0.0)
    prompt = chat_prompts[5] + [42] * 40  # a prompt no earlier test cached: new full blocks
    workers.submit(decode, "a-1", prompt, params, router=a)
    workers.submit(decode, "b-1", chat_prompts[6], params, router=b)
    tokens_b = collect(decode, b, "b-1")  # fails if a-1's outputs reached router b
    tokens_a = collect(decode, a, "a-1")
    assert len(tokens_a) == len(tokens_b) == 8
    # Each router got the new blocks' STORED events once, in its own queue.
    stored_a = {h for e in decode.heartbeat(a).kv_events.events if e.kind is KVEventKind.STORED for h in e.block_hashes}
    stored_b = {h for e in decode.heartbeat(b).kv_events.events if e.kind is KVEventKind.STORED for h in e.block_hashes}
    assert len(stored_a) >= len(prompt) // 16 - len(chat_prompts[5]) // 16 and stored_a == stored_b
    assert decode.heartbeat(a).kv_events.events == []  # handed over once per router
    holders = {r.router_id: r for r in decode.heartbeat(a).routers}
    assert {"router-a", "router-b"} <= set(holders) and holders["router-a"].requests == 0
