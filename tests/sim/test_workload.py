"""Workload generation: rates, shared prefixes, traces, and the validation workloads against the
requests bench/serve.py really sends."""

from __future__ import annotations

import asyncio
import random
import threading

import pytest

from bench import loadgen as load
from cluster.sim import LengthDist, WorkloadSpec, read_trace
from cluster.sim.validation import serve_requests, validation_workload
from cluster.sim.workload import write_trace


def test_poisson_count_and_a_rate_step():
    spec = WorkloadSpec(rate=20, duration_s=100, seed=1)
    n = spec.generate().num_requests
    assert abs(n - 2000) < 4 * 2000**0.5
    step = WorkloadSpec(rate=10, duration_s=100, seed=2, rate_points=((0, 0.2), (50, 0.2), (50.01, 1.0)))
    arrivals = [r.arrival_s for r in step.generate().clients[0].requests]
    low, high = sum(a < 50 for a in arrivals), sum(a >= 50 for a in arrivals)
    assert abs(low - 100) < 4 * 10 and abs(high - 500) < 4 * 23


def test_prompts_are_the_random_modules_randrange_draws():
    # The generator draws token ids without a Python call per token; the ids must be the ones
    # random.Random.randrange gives (the workloads, and so every simulated result, stay the same).
    spec = WorkloadSpec(
        rate=5, duration_s=10, prompt_len=LengthDist("fixed", 300), output_len=LengthDist("fixed", 8), seed=7
    )
    rng = random.Random(7)
    expected, t = [], rng.expovariate(5)
    while t < 10:
        expected.append((t, tuple(rng.randrange(1000, 40000) for _ in range(300))))
        t += rng.expovariate(5)
    got = [(r.arrival_s, r.prompt) for r in spec.generate().clients[0].requests]
    assert len(got) > 20 and got == expected


def test_prefix_groups_share_their_first_tokens():
    spec = WorkloadSpec(
        rate=5,
        duration_s=40,
        prefix_groups=3,
        prefix_len=64,
        prefix_fraction=1.0,
        prompt_len=LengthDist("fixed", 10),
        seed=3,
    )
    heads = {r.prompt[:64] for r in spec.generate().clients[0].requests}
    assert len(heads) == 3


def test_trace_round_trip(tmp_path):
    wl = WorkloadSpec(rate=5, duration_s=5, seed=4).generate()
    path = tmp_path / "t.jsonl"
    write_trace(path, wl.clients[0].requests)
    back = read_trace(path).clients[0].requests
    assert [(r.prompt, r.output_len, r.arrival_s) for r in back] == [
        (r.prompt, r.output_len, r.arrival_s) for r in wl.clients[0].requests
    ]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"arrival_s": 0}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        read_trace(bad)


@pytest.mark.parametrize("input_len,output_len,num,seed,rate", [(256, 128, 64, 0, None), (2000, 1, 10, 2, 0.25)])
def test_validation_requests_are_the_ones_bench_serve_sends(monkeypatch, input_len, output_len, num, seed, rate):
    sent, sleeps = [], []
    real_sleep, this_thread = asyncio.sleep, threading.get_ident()

    async def fake_request(client, args, prompt):
        sent.append(list(prompt))
        return load.RequestResult(ok=True, prompt_chars=len(prompt), output_tokens=1, ttft_s=0.01, e2el_s=0.01)

    async def fake_sleep(seconds):
        # asyncio.sleep is patched for the whole process: event loops other tests left running in
        # other threads (servers, Ray clients) keep their own sleeps and are not recorded.
        if threading.get_ident() != this_thread:
            return await real_sleep(seconds)
        sleeps.append(seconds)

    monkeypatch.setattr(load, "one_request", fake_request)
    monkeypatch.setattr(load.asyncio, "sleep", fake_sleep)
    args = load.parser().parse_args(
        [
            "--token-ids",
            "--input-len",
            str(input_len),
            "--output-len",
            str(output_len),
            "--num-prompts",
            str(num),
            "--seed",
            str(seed),
        ]
        + (["--request-rate", str(rate)] if rate else [])
    )
    asyncio.run(load.run(args))
    ours = serve_requests("x", input_len, output_len, num, seed, rate)
    assert sent == [list(r.prompt) for r in ours]
    if rate:
        starts = [sum(sleeps[:i]) for i in range(num)]
        assert [r.arrival_s for r in ours] == pytest.approx(starts)


def test_the_chat_workload_grows_each_conversation_by_reply_and_user_turn():
    wl = validation_workload("chat")
    (client,) = wl.clients
    for unit in client.units:
        for a, b in zip(unit, unit[1:]):
            assert b.prompt[: len(a.prompt)] == a.prompt and len(b.prompt) == len(a.prompt) + 32 + 48
    assert len({unit[0].prompt[:384] for unit in client.units}) == 1  # one system prompt
