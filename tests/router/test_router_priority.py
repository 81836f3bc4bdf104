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
