"""Request priority at the router (vLLM's `priority` field, `--scheduling-policy priority`): refused
without the policy as vLLM does, carried in the request's context with llm-d's TTFT target, and
ordering the admission gates: waiting requests go through lowest priority value first, and when
the queue is full the lowest priority present is the one refused."""

from __future__ import annotations

import asyncio

import pytest
from fastapi.testclient import TestClient

from router.admission import Gate
from router.app import build_app
from router.config import ServerConfig
from router.protocol import APIError
from testkit.backend import FakeBackend
from tests.router.conftest import MAX_MODEL_LEN, MODEL_NAME


def client(tokenizer, policy: str) -> tuple[TestClient, FakeBackend]:
    backend = FakeBackend(tokenizer)
    server = ServerConfig(scheduling_policy=policy)
    return TestClient(build_app(backend, tokenizer, MODEL_NAME, MAX_MODEL_LEN, server=server)), backend


def complete(c: TestClient, **extra):
    return c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, **extra})


def test_priority_needs_the_policy_and_travels_in_the_context(tokenizer):
    fcfs, _ = client(tokenizer, "fcfs")
    r = complete(fcfs, priority=-3)
    assert r.status_code == 400 and r.json()["error"]["param"] == "priority"
    assert "--scheduling-policy priority" in r.json()["error"]["message"]
    assert complete(fcfs, priority=0).status_code == 200
    assert complete(fcfs, priority="high").status_code == 400

    prio, backend = client(tokenizer, "priority")
    r = prio.post(
        "/v1/completions",
        json={"prompt": "hi", "max_tokens": 2, "priority": -3},
        headers={"x-llm-d-slo-ttft-ms": "250"},
    )
    assert r.status_code == 200, r.text
    context = backend.requests[-1].request.context
    assert context.priority == -3 and context.ttft_target is not None and context.ttft_target > context.arrival_time
    r = prio.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers={"x-llm-d-slo-ttft-ms": "soon"})
    assert r.status_code == 400 and "x-llm-d-slo-ttft-ms" in r.json()["error"]["message"]


async def _gate_run(by_priority: bool) -> tuple[list[int], list[int]]:
    """One slot held; five requests wait (the queue holds three) with priorities 5, 0, 9, -1, 3:
    (the order they get the slot, the priorities refused with 429)."""
    gate = Gate("decode", capacity=1, max_waiting=3, by_priority=by_priority)
    assert await gate.acquire(None) == 0.0
    order: list[int] = []
    refused: list[int] = []

    async def one(priority: int) -> None:
        try:
            await gate.acquire(None, priority)
        except APIError as e:
            assert e.status == 429
            refused.append(priority)
            return
        order.append(priority)
        await asyncio.sleep(0)
        gate.release()

    tasks = []
    for p in (5, 0, 9, -1, 3):
        tasks.append(asyncio.create_task(one(p)))
        await asyncio.sleep(0)  # each reaches the gate before the next arrives
    gate.release()
    await asyncio.gather(*tasks)
    return order, refused


def test_the_gate_lets_the_lowest_priority_value_through_first_and_refuses_the_lowest_priority():
    order, refused = asyncio.run(_gate_run(by_priority=True))
    # 5, 0, 9 wait; -1 takes 9's place (9 refused); 3 takes 5's place (5 refused).
    assert refused == [9, 5] and order == [-1, 0, 3]
    order, refused = asyncio.run(_gate_run(by_priority=False))
    assert refused == [-1, 3] and order == [5, 0, 9]  # FIFO: the newest are refused, whoever they are


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_scheduling_policy_is_vllms_engine_option(policy):
    from cluster.config import BatonConfig

    assert BatonConfig.from_options(scheduling_policy=policy).engine.scheduling_policy == policy
    with pytest.raises(ValueError, match="scheduling_policy"):
        BatonConfig.from_options(scheduling_policy="lifo")


async def _tenant_run(by_priority: bool, weights: dict[str, float]) -> list[str]:
    """One slot, held by "big"; four more of big's wait, then two of "small": the order they get it."""
    gate = Gate("decode", capacity=1, max_waiting=16, by_priority=by_priority, tenant_weights=weights)
    await gate.acquire(None, tenant="big")
    order: list[str] = []

    async def one(name: str, tenant: str) -> None:
        await gate.acquire(None, tenant=tenant)
        order.append(name)
        await asyncio.sleep(0)
        gate.release(tenant)

    tasks = []
    for name, tenant in [("b1", "big"), ("b2", "big"), ("b3", "big"), ("b4", "big"), ("s1", "small"), ("s2", "small")]:
        tasks.append(asyncio.create_task(one(name, tenant)))
        await asyncio.sleep(0)
    gate.release("big")
    await asyncio.gather(*tasks)
    return order


def test_a_tenant_holding_fewer_slots_goes_first():
    async def run() -> list[str]:
        gate = Gate("decode", capacity=3, max_waiting=16, by_priority=True)
        for _ in range(3):
            await gate.acquire(None, tenant="big")  # big holds every slot
        order: list[str] = []

        async def one(name: str, tenant: str) -> None:
            await gate.acquire(None, tenant=tenant)
            order.append(name)

        tasks = []
        for name, tenant in [("b1", "big"), ("b2", "big"), ("b3", "big"), ("s1", "small")]:
            tasks.append(asyncio.create_task(one(name, tenant)))
            await asyncio.sleep(0)
        gate.release("big")  # one slot frees: small holds none, big two
        await asyncio.sleep(0)
        for t in tasks:
            t.cancel()
        return order

    assert asyncio.run(run()) == ["s1"]  # though it came last


def test_the_gate_lets_tenants_take_turns_by_weight():
    assert asyncio.run(_tenant_run(False, {})) == ["b1", "b2", "b3", "b4", "s1", "s2"]  # FIFO
    assert asyncio.run(_tenant_run(True, {})) == ["b1", "s1", "b2", "s2", "b3", "b4"]
    # big weighs 3: three of its requests for each of small's (small, new, starts level with big).
    assert asyncio.run(_tenant_run(True, {"big": 3.0})) == ["b1", "s1", "b2", "b3", "b4", "s2"]


def test_the_fairness_header_names_the_tenant(tokenizer):
    prio, backend = client(tokenizer, "priority")
    headers = {"x-llm-d-inference-fairness-id": "team-a"}
    assert prio.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers=headers).status_code == 200
    assert backend.requests[-1].request.context.tenant == "team-a"
    assert complete(prio).status_code == 200 and backend.requests[-1].request.context.tenant == "default"
    # The trace and the TTFT histogram by class carry the request's priority and tenant.
    recent = prio.get("/v1/status").json()["recent"]
    assert {(t["priority"], t["tenant"]) for t in recent} == {(0, "team-a"), (0, "default")}
    metrics = prio.get("/metrics").text
    series = 'model_name="SmolLM2-135M-Instruct",priority="0",tenant="team-a"'
    assert f"baton:time_to_first_token_by_class_seconds_count{{{series}}} 1.0" in metrics
    bad = {"x-llm-d-inference-fairness-id": "x" * 200}
    r = prio.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers=bad)
    assert r.status_code == 400 and "x-llm-d-inference-fairness-id" in r.json()["error"]["message"]


def test_overload_refuses_the_tenant_furthest_over_its_share():
    async def run() -> tuple[list[str], list[str]]:
        gate = Gate("decode", capacity=1, max_waiting=3, by_priority=True)
        await gate.acquire(None, tenant="big")  # big holds the slot
        admitted: list[str] = []
        refused: list[str] = []

        async def one(name: str, tenant: str) -> None:
            try:
                await gate.acquire(None, tenant=tenant)
            except APIError as e:
                assert e.status == 429
                refused.append(name)
                return
            admitted.append(name)
            gate.release(tenant)

        tasks = []
        for name, tenant in [("b1", "big"), ("b2", "big"), ("s1", "small"), ("s2", "small"), ("b3", "big")]:
            tasks.append(asyncio.create_task(one(name, tenant)))
            await asyncio.sleep(0)
        gate.release("big")
        await asyncio.gather(*tasks)
        return admitted, refused

    admitted, refused = asyncio.run(run())
    # Full at b1, b2, s1: s2 takes the place of big's latest (b2); b3, big's, is refused itself.
    assert refused == ["b2", "b3"] and sorted(admitted) == ["b1", "s1", "s2"]
