"""Admission control and deadlines: the gates (router.admission) alone, then through a live router
over a FakeBackend: 429 beyond the waiting queue, FIFO admission, the prefill gate, deadlines while
waiting (503) and while running (504, in-band when streaming), aborts that free the backend, and
gates that end empty however requests end."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from router.admission import AdmissionControl, Gate, request_deadline
from router.app import build_app
from router.config import ServerConfig
from router.protocol import APIError
from testkit.backend import FakeBackend
from tests.router.conftest import MAX_MODEL_LEN, MODEL_NAME, running_server

USER = [{"role": "user", "content": "Hello"}]


# ----------------------------------------------------------------------------- the gate alone


def test_gate_runs_capacity_then_queues_in_order_then_refuses():
    async def scenario():
        gate = Gate("decode", capacity=2, max_waiting=2)
        await gate.acquire(None)
        await gate.acquire(None)
        order: list[int] = []

        async def waiter(i: int) -> None:
            await gate.acquire(None)
            order.append(i)

        waiters = [asyncio.create_task(waiter(i)) for i in range(2)]
        await asyncio.sleep(0)
        assert (gate.running, gate.state().waiting, gate.full()) == (2, 2, True)
        with pytest.raises(APIError) as info:
            await gate.acquire(None)
        assert info.value.status == 429 and info.value.headers["Retry-After"] == "1" and "decode" in info.value.message
        gate.release()
        await asyncio.sleep(0)
        gate.release()
        await asyncio.gather(*waiters)
        assert order == [0, 1] and gate.running == 2 and gate.state().waiting == 0
        gate.release()
        gate.release()
        assert gate.running == 0

    asyncio.run(scenario())


def test_a_waiter_that_gives_up_leaves_the_queue_and_a_late_grant_passes_on():
    async def scenario():
        gate = Gate("prefill", capacity=1, max_waiting=5)
        await gate.acquire(None)
        deadline = request_deadline(ServerConfig(request_timeout=0.05), {}, time.monotonic())
        with pytest.raises(APIError) as info:
            await gate.acquire(deadline)
        assert info.value.status == 503 and "Retry-After" in info.value.headers
        assert gate.state().waiting == 0
        cancelled = asyncio.create_task(gate.acquire(None))
        second = asyncio.create_task(gate.acquire(None))
        await asyncio.sleep(0)
        gate.release()  # granted to `cancelled` ...
        cancelled.cancel()  # ... which gives up before it runs: the slot must reach `second`
        await asyncio.gather(cancelled, return_exceptions=True)
        await asyncio.wait_for(second, 1)
        assert gate.running == 1 and gate.state().waiting == 0

    asyncio.run(scenario())


def test_deadline_is_the_shorter_of_the_server_and_the_client_timeouts():
    config = ServerConfig(request_timeout=30)
    assert request_deadline(config, {}, 100.0).at == 130.0
    assert request_deadline(config, {"x-stainless-read-timeout": "5"}, 100.0).at == 105.0
    assert request_deadline(config, {"x-stainless-read-timeout": "600"}, 100.0).at == 130.0
    assert request_deadline(config, {"x-stainless-read-timeout": "soon"}, 100.0).at == 130.0
    assert request_deadline(ServerConfig(request_timeout=None), {}, 100.0) is None


def test_admission_check_refuses_when_either_queue_is_full():
    admission = AdmissionControl(ServerConfig(max_running_requests=1, max_waiting_requests=0))
    admission.check()
    asyncio.run(admission.decode.acquire(None))
    with pytest.raises(APIError) as info:
        admission.check()
    assert info.value.status == 429 and admission.rejected["decode_queue_full"] == 1


# ----------------------------------------------------------------------------- through the router


def serve(backend: FakeBackend, tokenizer, **server):
    app = build_app(backend, tokenizer, MODEL_NAME, MAX_MODEL_LEN, server=ServerConfig(**server))
    return app, running_server(app)


def gates_empty(app) -> bool:
    state = app.state.baton.admission.state()
    return all(state[p]["running"] == 0 and state[p]["waiting"] == 0 for p in ("decode", "prefill"))


async def wait_for(predicate, timeout_s: float = 5.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not predicate():
            await asyncio.sleep(0.01)


def test_beyond_the_queue_requests_get_429_and_the_queue_runs_in_order(tokenizer):
    backend = FakeBackend(tokenizer, token_delay=0.02)
    app, server = serve(backend, tokenizer, max_running_requests=2, max_waiting_requests=2)
    with server as url:

        async def scenario():
            async with httpx.AsyncClient(base_url=url, timeout=30) as client:
                body = {"messages": USER, "max_tokens": 20, "ignore_eos": True}
                events: list[tuple[int, int]] = []

                async def one(i: int) -> None:
                    r = await client.post(
                        "/v1/chat/completions", json=dict(body, messages=[{"role": "user", "content": f"client {i}"}])
                    )
                    events.append((i, r.status_code))
                    if r.status_code == 429:
                        assert r.headers["retry-after"] == "1" and r.json()["error"]["type"] == "RateLimitError"
                        assert "max_waiting_requests=2" in r.json()["error"]["message"]

                tasks = []
                for i in range(6):  # one at a time, so arrival order is known
                    tasks.append(asyncio.create_task(one(i)))
                    await wait_for(  # awaited in this iteration: the default binds its i explicitly
                        lambda i=i: (
                            len(backend.requests)
                            + app.state.baton.admission.decode.state().waiting
                            + sum(1 for _, s in events if s == 429)
                            >= i + 1
                        )
                    )
                await asyncio.gather(*tasks)
                return events

        events = asyncio.run(scenario())
        assert sorted(s for _, s in events) == [200] * 4 + [429] * 2
        assert {i for i, s in events if s == 429} == {4, 5}
        # The two refusals came before any admitted request finished; the queue ran first come, first served.
        assert [s for _, s in events[:2]] == [429, 429]
        started = [
            next(i for i in range(6) if f"client {i}" in tokenizer.decode(r.prompt_token_ids)) for r in backend.requests
        ]
        assert started == [0, 1, 2, 3]
        assert len(backend.finished) == 4 and gates_empty(app)
        status = httpx.get(url + "/v1/status").json()["admission"]
        assert status["rejected"] == {"decode_queue_full": 2}
        metrics = httpx.get(url + "/metrics").text
        assert (
            'baton:router_requests_rejected_total{model_name="SmolLM2-135M-Instruct",reason="decode_queue_full"} 2.0'
            in metrics
        )


def test_the_prefill_gate_holds_requests_until_the_first_token(tokenizer):
    backend = FakeBackend(tokenizer, first_token_delay=0.5)
    app, server = serve(backend, tokenizer, max_running_prefills=1, max_waiting_prefills=0)
    with server as url:

        async def scenario():
            async with httpx.AsyncClient(base_url=url, timeout=30) as client:
                first = asyncio.create_task(
                    client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 2})
                )
                await wait_for(lambda: len(backend.requests) == 1)
                refused = await client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 2})
                done = await first
                after = await client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 2})
                return refused, done, after

        refused, done, after = asyncio.run(scenario())
        assert refused.status_code == 429 and "prefill pool is saturated" in refused.json()["error"]["message"]
        assert done.status_code == 200 and after.status_code == 200 and gates_empty(app)


def test_deadline_while_running_is_504_and_aborts_the_request(tokenizer):
    backend = FakeBackend(tokenizer, token_delay=0.1)
    app, server = serve(backend, tokenizer, request_timeout=0.5)
    with server as url:
        r = httpx.post(url + "/v1/chat/completions", json={"messages": USER, "max_tokens": 100, "ignore_eos": True})
        assert r.status_code == 504
        error = r.json()["error"]
        assert error["type"] == "TimeoutError" and error["code"] == 504 and "0.5 s" in error["message"]
        assert backend.aborted == [backend.requests[0].request_id] and backend.finished == []

        # Streaming: the headers are out, so the deadline comes as an error event, then [DONE].
        with httpx.stream(
            "POST",
            url + "/v1/chat/completions",
            json={"messages": USER, "max_tokens": 100, "ignore_eos": True, "stream": True},
        ) as r:
            assert r.status_code == 200
            frames = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        assert frames[-1] == "[DONE]"
        error = json.loads(frames[-2])["error"]
        assert error["code"] == 504 and error["type"] == "TimeoutError"
        assert 1 < len(frames) - 2 < 100  # some tokens came first
        assert backend.aborted[-1] == backend.requests[1].request_id and backend.finished == []
        asyncio.run(wait_for(lambda: gates_empty(app)))


def test_the_client_timeout_header_shortens_the_deadline(tokenizer):
    backend = FakeBackend(tokenizer, token_delay=0.1)
    app, server = serve(backend, tokenizer)  # request_timeout 600 s
    with server as url:
        r = httpx.post(
            url + "/v1/completions",
            json={"prompt": "x", "max_tokens": 100, "ignore_eos": True},
            headers={"x-stainless-read-timeout": "0.4"},
        )
        assert r.status_code == 504 and backend.aborted == [backend.requests[0].request_id]
        assert gates_empty(app)


def test_deadline_while_waiting_is_503_with_retry_after(tokenizer):
    backend = FakeBackend(tokenizer, token_delay=0.05)
    app, server = serve(backend, tokenizer, max_running_requests=1)
    with server as url:

        async def scenario():
            async with httpx.AsyncClient(base_url=url, timeout=30) as client:
                body = {"messages": USER, "max_tokens": 30, "ignore_eos": True}
                running = asyncio.create_task(client.post("/v1/chat/completions", json=body))
                await wait_for(lambda: len(backend.requests) == 1)
                waiting = await client.post(
                    "/v1/chat/completions", json=body, headers={"x-stainless-read-timeout": "0.3"}
                )
                return await running, waiting

        running, waiting = asyncio.run(scenario())
        assert running.status_code == 200
        assert waiting.status_code == 503 and waiting.headers["retry-after"] == "1"
        assert "waited for a free slot" in waiting.json()["error"]["message"]
        assert len(backend.requests) == 1  # the waiting one never reached the pools
        assert app.state.baton.admission.rejected["deadline_waiting"] == 1 and gates_empty(app)


def test_clients_that_leave_while_waiting_or_streaming_free_their_slots(tokenizer):
    backend = FakeBackend(tokenizer, token_delay=0.05)
    app, server = serve(backend, tokenizer, max_running_requests=1)
    with server as url:

        async def scenario():
            async with httpx.AsyncClient(base_url=url, timeout=30) as client:
                body = {"messages": USER, "max_tokens": 200, "ignore_eos": True, "stream": True}

                waiter_left = asyncio.Event()

                async def read_two_chunks() -> None:
                    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                        seen = 0
                        async for line in r.aiter_lines():
                            seen += line.startswith("data: {")
                            if seen == 2:
                                await waiter_left.wait()
                                return  # hang up mid-stream

                async def wait_then_leave() -> None:
                    await client.post("/v1/chat/completions", json=body)

                streaming = asyncio.create_task(read_two_chunks())
                await wait_for(lambda: len(backend.requests) == 1)
                waiter = asyncio.create_task(wait_then_leave())
                await wait_for(lambda: app.state.baton.admission.decode.state().waiting == 1)
                waiter.cancel()  # leaves while queued: the router must notice and drop it from the queue
                await asyncio.gather(waiter, return_exceptions=True)
                await wait_for(lambda: app.state.baton.admission.decode.state().waiting == 0)
                waiter_left.set()
                await streaming
                await wait_for(lambda: gates_empty(app))
                r = await client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 3})
                assert r.status_code == 200

        asyncio.run(scenario())
        assert backend.aborted == [backend.requests[0].request_id]
        assert len(backend.requests) == 2 and gates_empty(app)


def test_a_full_server_refuses_before_reading_and_only_after_the_key_check(tokenizer):
    from fastapi.testclient import TestClient

    backend = FakeBackend(tokenizer)
    app = build_app(
        backend,
        tokenizer,
        MODEL_NAME,
        MAX_MODEL_LEN,
        server=ServerConfig(api_key="k", max_running_requests=1, max_waiting_requests=0),
    )
    client = TestClient(app, raise_server_exceptions=False)
    asyncio.run(app.state.baton.admission.decode.acquire(None))  # the one slot is taken
    assert client.post("/v1/chat/completions", json={"messages": USER}).status_code == 401
    r = client.post("/v1/chat/completions", content=b"not even json", headers={"Authorization": "Bearer k"})
    assert r.status_code == 429 and r.headers["retry-after"] == "1" and r.json()["error"]["code"] == 429
    assert client.post("/tokenize", json={"prompt": "hi"}, headers={"Authorization": "Bearer k"}).status_code == 200
    app.state.baton.admission.decode.release()
    r = client.post(
        "/v1/chat/completions", json={"messages": USER, "max_tokens": 2}, headers={"Authorization": "Bearer k"}
    )
    assert r.status_code == 200 and backend.requests


def test_growing_a_gate_admits_waiting_requests_at_once_and_shrinking_holds_new_ones():
    async def scenario():
        gate = Gate("decode", capacity=1, max_waiting=4)
        await gate.acquire(None)
        waiters = [asyncio.create_task(gate.acquire(None)) for _ in range(3)]
        await asyncio.sleep(0)
        gate.capacity = 3  # the pool grew (cluster.launcher resizes automatic gates)
        await asyncio.sleep(0)
        assert [w.done() for w in waiters] == [True, True, False] and gate.running == 3
        gate.capacity = 1  # and shrank: the three running finish, the waiter starts only below 1
        gate.release()
        gate.release()
        await asyncio.sleep(0)
        assert not waiters[2].done() and gate.running == 1
        gate.release()
        await asyncio.wait_for(waiters[2], 1)
        assert gate.running == 1

    asyncio.run(scenario())
