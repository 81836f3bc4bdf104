"""Healing and scaling in RayBackend over fake actors (no Ray, no model): requests on a dead
decode worker migrate and continue exactly, a dead prefill worker's prefill moves to another,
attempts are bounded, a restarted worker is re-admitted with its index entries cleared, and
workers join and drain at runtime.

Oracle: the fake workers' deterministic script (tests/routing/fake_actors.py): whatever worker
produces token i of a request, it is `script_token(prompt, i)`, so a stream that lost or repeated a
token, or a character of text, differs from `script(prompt, max_tokens)`.
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from ray.exceptions import ActorDiedError, RayTaskError

from common.sampling_params import SamplingParams
from router.backend import BackendError, RouteDecision
from router.flow import FlowLimits
from router.pools import WorkerPools
from router.ray_backend import RayBackend
from router.routing import live_workers

from .fake_actors import FakeActor, make_request, script, script_text

STEP_S = 0.01


def make(num_prefill=1, num_decode=2, **kwargs):
    actors = {f"prefill-{i}": FakeActor(f"prefill-{i}", "prefill", prefill_delay_s=0.01) for i in range(num_prefill)}
    actors.update({f"decode-{i}": FakeActor(f"decode-{i}", "decode", step_s=STEP_S) for i in range(num_decode)})
    limits = FlowLimits(**{k: kwargs.pop(k) for k in ("max_migrations", "migration_wait_s") if k in kwargs})
    kwargs = {"health_interval_s": 0.05, "health_timeout_s": 0.5, "poll_timeout_s": 0.02, **kwargs}
    backend = RayBackend(WorkerPools(list(actors.values()), **kwargs), limits)
    return backend, actors


def prompt_of(i: int) -> list[int]:
    return [100 + i, 7, 8, 9, i % 5]


async def stream(backend, rid, prompt, max_tokens, decode, prefill=None):
    """(token ids, text, last output) of one request, or the exception that ended it."""
    tokens, text, last = [], "", None
    request = make_request(
        rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0), RouteDecision(decode, prefill)
    )
    try:
        async for out in backend.generate(request):
            tokens += out.token_ids
            text += out.text
            last = out
    except BackendError as exc:
        return exc
    return tokens, text, last


def assert_exact(result, prompt, max_tokens):
    assert not isinstance(result, Exception), result
    tokens, text, last = result
    want = script(prompt, max_tokens)
    assert tokens == want
    assert text == "".join(script_text(t) for t in want)
    assert last.finished and last.finish_reason == "length" and last.num_output_tokens == max_tokens


async def wait_for(predicate, timeout_s=5.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


def test_streams_on_a_killed_decode_worker_continue_exactly_on_the_other():
    async def main():
        backend, actors = make(num_prefill=1, num_decode=2)
        try:
            backend.workers()
            n, max_tokens = 32, 40
            tasks = [
                asyncio.create_task(
                    stream(
                        backend,
                        f"r{i}",
                        prompt_of(i),
                        max_tokens,
                        f"decode-{i % 2}",
                        "prefill-0" if i % 4 < 2 else None,
                    )
                )
                for i in range(n)
            ]
            await wait_for(lambda: len(actors["decode-0"].running) >= 8)
            await asyncio.sleep(5 * STEP_S)
            moved = list(actors["decode-0"].running)
            actors["decode-0"].kill()
            results = await asyncio.wait_for(asyncio.gather(*tasks), 20)
            for i, result in enumerate(results):
                assert_exact(result, prompt_of(i), max_tokens)
            assert backend.counters["migrations"] == len(moved) >= 8
            # Each moved request resumed from what its client had: never nothing, never everything.
            resumes = {rid: r for rid, r in actors["decode-1"].submitted if r is not None}
            assert set(resumes) == set(moved)
            assert all(0 < len(r.output_token_ids) < max_tokens for r in resumes.values())
            assert len(backend.migration_gaps) == len(moved)
            assert [w.alive for w in backend.workers() if w.worker_id == "decode-0"] == [False]
            assert backend.pools.gone_workers() == ["decode-0"]  # ActorDiedError: no restart left
            assert not len(backend.pools.requests) and all(not a.running for a in actors.values())
        finally:
            await backend.close()

    asyncio.run(main())


def test_a_stream_that_loses_too_many_workers_ends_with_a_clean_error():
    async def main():
        backend, actors = make(num_prefill=0, num_decode=3, max_migrations=1)
        try:
            backend.workers()
            task = asyncio.create_task(stream(backend, "r", prompt_of(0), 200, "decode-0"))
            await wait_for(lambda: "r" in actors["decode-0"].running)
            actors["decode-0"].kill()
            await wait_for(lambda: any("r" in actors[w].running for w in ("decode-1", "decode-2")))
            second = next(w for w in ("decode-1", "decode-2") if "r" in actors[w].running)
            actors[second].kill()
            result = await asyncio.wait_for(task, 10)
            assert isinstance(result, BackendError) and result.retryable
            assert "giving up after 1 migrations" in str(result) and second in str(result)
            assert backend.counters["migrations_failed"] == 1
            third = ({"decode-1", "decode-2"} - {second}).pop()
            assert not actors[third].running  # the stream did not also go on there
        finally:
            await backend.close()

    asyncio.run(main())


def test_a_lone_decode_worker_that_restarts_takes_its_streams_back():
    async def main():
        backend, actors = make(num_prefill=1, num_decode=1)
        d = actors["decode-0"]
        try:
            backend.workers()
            d._compute(list(range(64)))  # something cached, so the index has entries to lose
            await wait_for(lambda: backend.prefix_index.num_blocks("decode-0") > 0)
            tasks = [asyncio.create_task(stream(backend, f"r{i}", prompt_of(i), 30, "decode-0")) for i in range(4)]
            await wait_for(lambda: len(d.running) == 4)
            await asyncio.sleep(5 * STEP_S)
            old_pid = d.pid
            d.kill(restart_after_s=0.3)
            await wait_for(lambda: not backend.workers()[1].alive)
            assert backend.prefix_index.num_blocks("decode-0") == 0
            results = await asyncio.wait_for(asyncio.gather(*tasks), 10)
            for i, result in enumerate(results):
                assert_exact(result, prompt_of(i), 30)
            assert d.pid != old_pid and backend.workers()[1].alive  # re-admitted
            assert backend.pools.gone_workers() == [] and backend.counters["migrations"] == 4
        finally:
            await backend.close()

    asyncio.run(main())


def test_no_decode_worker_within_the_wait_ends_the_stream_cleanly():
    async def main():
        backend, actors = make(num_prefill=0, num_decode=1, migration_wait_s=0.3)
        try:
            backend.workers()
            task = asyncio.create_task(stream(backend, "r", prompt_of(0), 100, "decode-0"))
            await wait_for(lambda: "r" in actors["decode-0"].running)
            actors["decode-0"].kill()
            started = time.monotonic()
            result = await asyncio.wait_for(task, 5)
            assert isinstance(result, BackendError) and "no decode worker was live within" in str(result)
            assert time.monotonic() - started < 2.0
        finally:
            await backend.close()

    asyncio.run(main())


def test_a_hung_decode_worker_is_given_up_and_its_streams_move():
    async def main():
        backend, actors = make(num_prefill=0, num_decode=2)
        try:
            backend.workers()
            tasks = [asyncio.create_task(stream(backend, f"r{i}", prompt_of(i), 60, "decode-0")) for i in range(3)]
            await wait_for(lambda: len(actors["decode-0"].running) == 3)
            actors["decode-0"].hang()  # alive but answers nothing: the heartbeat times out
            results = await asyncio.wait_for(asyncio.gather(*tasks), 10)
            for i, result in enumerate(results):
                assert_exact(result, prompt_of(i), 60)
            assert backend.pools.gone_workers() == []  # not known dead: Ray may still bring it back
        finally:
            await backend.close()

    asyncio.run(main())


def test_a_lone_decode_worker_that_stalls_and_comes_back_as_it_was_takes_its_streams_back_exactly():
    """Given up while it stalled, the worker kept decoding: what it queued for the first attempt
    (and the long-poll that was out when it stalled) reaches the router after the streams came back
    to it, beside the new attempt's outputs, and must not reach the clients."""

    async def main():
        backend, actors = make(num_prefill=0, num_decode=1, migration_wait_s=10.0)
        d = actors["decode-0"]
        try:
            backend.workers()
            tasks = [asyncio.create_task(stream(backend, f"r{i}", prompt_of(i), 80, "decode-0")) for i in range(3)]
            await wait_for(lambda: len(d.running) == 3)
            await asyncio.sleep(5 * STEP_S)
            d.hang()
            await wait_for(lambda: not backend.workers()[0].alive)
            await asyncio.sleep(10 * STEP_S)  # it decodes on into its outbox meanwhile
            d.reply_delay_s = 0.3  # the stalled long-poll's reply (those outputs) lands after the move back
            d.unhang()
            results = await asyncio.wait_for(asyncio.gather(*tasks), 10)
            for i, result in enumerate(results):
                assert_exact(result, prompt_of(i), 80)
            assert backend.counters["migrations"] == 3
            assert [resume is not None for _, resume in d.submitted] == [False] * 3 + [True] * 3
        finally:
            await backend.close()

    asyncio.run(main())


def test_calls_to_a_worker_that_never_answers_end_when_it_is_marked_down():
    """A Ray actor being restarted (or that cannot be placed again) leaves calls to it waiting;
    the request must not wait with them: once the heartbeat gives the worker up, it moves on."""

    async def main():
        backend, actors = make(num_prefill=2, num_decode=2)
        try:
            backend.workers()
            actors["decode-0"].hang()  # the submit below never returns
            local = asyncio.create_task(stream(backend, "local", prompt_of(1), 10, "decode-0"))
            actors["prefill-0"].hang()  # the prefill below never returns
            remote = asyncio.create_task(stream(backend, "remote", prompt_of(2), 10, "decode-1", "prefill-0"))
            assert_exact(await asyncio.wait_for(local, 5), prompt_of(1), 10)
            assert_exact(await asyncio.wait_for(remote, 5), prompt_of(2), 10)
            assert backend.counters["migrations"] == 1 and backend.counters["prefill_retries"] == 1
        finally:
            await backend.close()

    asyncio.run(main())


def test_a_dead_prefill_worker_is_replaced_by_another_then_by_the_decode_worker():
    async def main():
        backend, actors = make(num_prefill=2, num_decode=1)
        try:
            backend.workers()
            actors["prefill-0"].prefill_delay_s = 0.3
            task = asyncio.create_task(stream(backend, "r0", prompt_of(0), 10, "decode-0", "prefill-0"))
            await wait_for(lambda: "prefill" in actors["prefill-0"].calls)
            actors["prefill-0"].kill()
            assert_exact(await asyncio.wait_for(task, 5), prompt_of(0), 10)
            assert backend.counters["prefill_retries"] == 1 and actors["prefill-1"].calls.count("prefill") == 1
            assert backend.counters["remote_prefill"] == 1 and backend.counters["local_prefill"] == 0

            actors["prefill-1"].prefill_delay_s = 0.3
            task = asyncio.create_task(stream(backend, "r1", prompt_of(1), 10, "decode-0", "prefill-1"))
            await wait_for(lambda: actors["prefill-1"].calls.count("prefill") == 2)
            actors["prefill-1"].kill()
            assert_exact(await asyncio.wait_for(task, 5), prompt_of(1), 10)
            assert backend.counters["local_prefill"] == 1  # no prefill worker left: D prefilled it
            assert not actors["decode-0"].reserved  # the reservations were given back
        finally:
            await backend.close()

    asyncio.run(main())


def test_workers_join_and_drain_at_runtime_without_losing_a_request():
    async def main():
        backend, actors = make(num_prefill=1, num_decode=1)
        try:
            backend.workers()
            late = FakeActor("decode-1", "decode", step_s=STEP_S)
            backend.pools.add_worker("decode-1", "decode", late)
            with pytest.raises(ValueError, match="already"):
                backend.pools.add_worker("decode-1", "decode", late)
            short = asyncio.create_task(stream(backend, "short", prompt_of(1), 5, "decode-1"))
            assert_exact(await asyncio.wait_for(short, 5), prompt_of(1), 5)  # its pump runs

            # Drain decode-0 while it runs long streams: new work avoids it at once, and after the
            # drain timeout its streams move (no failure counted), then it leaves the index.
            d0 = actors["decode-0"]
            d0._compute(list(range(64)))
            await wait_for(lambda: backend.prefix_index.num_blocks("decode-0") > 0)
            tasks = [asyncio.create_task(stream(backend, f"r{i}", prompt_of(i), 80, "decode-0")) for i in range(4)]
            await wait_for(lambda: len(d0.running) == 4)
            drain = asyncio.create_task(backend.pools.drain_worker("decode-0", timeout_s=0.1))
            await asyncio.sleep(0)
            assert [w.worker_id for w in live_workers(backend.workers(), "decode")] == ["decode-1"]
            assert await asyncio.wait_for(drain, 5) == 4
            assert backend.pools.in_flight("decode-0") == 0
            assert backend.pools.remove_worker("decode-0") is d0
            assert backend.prefix_index.num_blocks("decode-0") == 0
            assert "decode-0" not in {w.worker_id for w in backend.workers()}
            for i, result in enumerate(await asyncio.wait_for(asyncio.gather(*tasks), 10)):
                assert_exact(result, prompt_of(i), 80)
            assert backend.counters["migrations"] == 4 and backend.counters["migrations_failed"] == 0
            # A request routed to the removed worker (a stale decision) goes elsewhere.
            assert_exact(await stream(backend, "stale", prompt_of(9), 3, "decode-0"), prompt_of(9), 3)
        finally:
            await backend.close()

    asyncio.run(main())


def test_over_http_a_stream_out_of_attempts_ends_with_an_error_event_and_done(tokenizer):
    """The client's view of a request that cannot go on: its stream ends with an error event in the
    OpenAI envelope, then [DONE] (no hang, no stack trace)."""
    from fastapi.testclient import TestClient

    from router.app import build_app

    backend, actors = make(num_prefill=1, num_decode=2, max_migrations=0)
    app = build_app(backend, tokenizer, "m", 8192)
    body = {"prompt": [5, 6, 7], "max_tokens": 200, "stream": True}
    with TestClient(app) as client:
        with client.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            lines = []
            for line in response.iter_lines():
                lines.append(line)
                if len(lines) == 10:  # mid-stream: its worker dies, and no move is allowed
                    for wid in ("decode-0", "decode-1"):
                        actors[wid].kill()
        events = [line for line in lines if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        error = json.loads(events[-2][6:])["error"]
        assert "giving up after 0 migrations" in error["message"] and "Traceback" not in error["message"]
        client.portal.call(backend.close)


def test_a_decode_worker_that_dies_before_starting_the_decode_moves_the_request():
    """D dies between P's first token and its start_decode: the stream moves to the other decode
    worker with the first token already sent, and ends exactly."""

    async def main():
        backend, actors = make(num_prefill=1, num_decode=2)
        d0 = actors["decode-0"]

        async def die_instead(call):
            d0.kill()  # the call's answer never comes: ActorUnavailableError

        d0.start_decode.fn = die_instead  # the fake's method table (fake_actors._Method)
        try:
            prompt = prompt_of(1)
            result = await stream(backend, "r-start", prompt, 12, "decode-0", "prefill-0")
            assert_exact(result, prompt, 12)
            assert backend.counters["migrations"] == 1 and backend.counters["remote_prefill"] == 1
            assert actors["decode-1"].submitted[-1][1].output_token_ids == tuple(script(prompt, 1))
        finally:
            await backend.close()

    asyncio.run(main())


def test_a_call_that_failed_because_a_rank_died_marks_the_worker_down_but_not_gone():
    """A tensor-parallel worker's reserve fails because one of its rank actors died (Ray raises a
    RayTaskError that is also an ActorDiedError): the worker restarts as a whole, so it is down,
    not gone for good (gone would have the pool manager start a replacement beside it)."""

    async def main():
        backend, actors = make(num_prefill=1, num_decode=2)
        d0 = actors["decode-0"]

        async def rank_died(*args):
            d0.kill(restart_after_s=0.2)
            raise RayTaskError("reserve", "a rank's traceback", ActorDiedError()).as_instanceof_cause()

        d0.reserve.fn = rank_died
        try:
            prompt = prompt_of(2)
            result = await stream(backend, "r-rank", prompt, 12, "decode-0", "prefill-0")
            assert_exact(result, prompt, 12)
            assert backend.pools.gone_workers() == []
            await wait_for(lambda: backend.workers()[1].alive)  # back after its restart
        finally:
            await backend.close()

    asyncio.run(main())
