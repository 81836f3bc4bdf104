"""Streams never stop behind a long prompt's prefill on a busy CPU host.

`baton serve` with its CPU defaults (one prefill and one decode worker sharing this machine's
cores), four streams decoding, then a 2,000-token prompt on the quiet host and another beside a
CPU hog at normal priority (bench/cpu_hog.py: one core half busy). Judged by the workers' own step logs
(BATON_STEP_LOG_DIR), not by wall-clock thresholds: while the prefill worker runs the long
prompt's chunks, the decode worker must complete at least one step per chunk, with no interval
between two of its steps longer than two chunks, and it must give back the core it borrows while the
prefill worker is idle (at most two of its steps inside the prefill run on more than its own share).
With the decode worker at idle priority and the prefill on both cores (an arrangement since
dropped) it completed 7 steps during the 8 chunks of the quiet case.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from testkit.harness import baton_serve, stop_process
from workers.shell.worker import STEP_LOG_ENV

pytestmark = pytest.mark.slow

NUM_STREAMS = 4
LONG_PROMPT_TOKENS = 2000
CHUNK_TOKENS = 256  # the engine's max_num_batched_tokens default: a long prompt prefills in such chunks


def _steps(path: Path) -> list[dict]:
    """A worker's step log: each step's chunks and its [start, end] on the monotonic clock."""
    steps = []
    for line in path.read_text().splitlines():
        step = json.loads(line)
        step["start"] = step["end"] - step["seconds"]
        steps.append(step)
    return steps


def _stream(base_url: str, index: int, stop: threading.Event, first_token: threading.Event, counts: list[int]) -> None:
    body = {
        "model": "SmolLM2-135M-Instruct",
        "stream": True,
        "max_tokens": 3000,
        "ignore_eos": True,
        "temperature": 0,
        "messages": [{"role": "user", "content": f"Count slowly from {index} upwards."}],
    }
    with (
        httpx.Client(timeout=120.0) as client,
        client.stream("POST", f"{base_url}/v1/chat/completions", json=body) as r,
    ):
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                counts[index] += 1
                first_token.set()
            if stop.is_set():
                return  # closing the connection aborts the request


def _check_decode_kept_stepping(logs: Path, sent: float, answered: float, condition: str) -> None:
    """The long prompt sent at `sent` and answered at `answered` (monotonic): while its chunks ran
    on the prefill worker, the decode worker completed a step per chunk, never two chunks apart."""
    prefill = [s for s in _steps(logs / "prefill-0.jsonl") if sent <= s["start"] and s["end"] <= answered]
    decode = _steps(logs / "decode-0.jsonl")
    long_chunks = [
        s
        for s in prefill
        if any(tokens >= CHUNK_TOKENS // 2 or done >= CHUNK_TOKENS for done, tokens, _ in s["chunks"])
    ]
    assert len(long_chunks) >= LONG_PROMPT_TOKENS // CHUNK_TOKENS, (condition, prefill)  # chunk by chunk
    window = (long_chunks[0]["start"], long_chunks[-1]["end"])
    chunk_s = statistics.median(s["seconds"] for s in long_chunks)
    ends = [s["end"] for s in decode if window[0] <= s["end"] <= window[1]]
    assert len(ends) >= len(long_chunks), (
        f"{condition}: the decode worker completed {len(ends)} steps during the {len(long_chunks)} chunks of the "
        "long prompt's prefill"
    )
    # Each interval between the ends of two decode steps overlapping the prefill (the first one
    # counted from the prefill's start, the last to its end).
    marks = [window[0], *ends, window[1]]
    longest = max(b - a for a, b in zip(marks, marks[1:]))
    assert longest <= 2 * chunk_s, (
        f"{condition}: the decode worker went {longest:.3f} s without completing a step while a prefill chunk took "
        f"{chunk_s:.3f} s"
    )
    # A core the decode worker borrowed while the prefill worker was idle (workers.shell.elastic_threads)
    # is given back once the prefill runs: a step or two notice it, the rest run on its own share.
    borrowed = [s for s in decode if window[0] <= s["start"] and s["end"] <= window[1] and s["threads"] > 1]
    assert len(borrowed) <= 2, f"{condition}: {len(borrowed)} decode steps kept a borrowed core during the prefill"


def test_the_decode_worker_keeps_stepping_while_a_long_prompt_prefills(tmp_path, no_driver_ray):
    """One deployment, one long prompt on the quiet host, then another beside a CPU hog."""
    logs = tmp_path / "steps"
    logs.mkdir()
    hog = None
    windows = []
    try:
        with baton_serve(
            ["--kv-cache-memory", "256MiB", "--max-model-len", "4096"], env={STEP_LOG_ENV: str(logs)}
        ) as server:
            stop = threading.Event()
            started = [threading.Event() for _ in range(NUM_STREAMS)]
            counts = [0] * NUM_STREAMS
            streams = [
                threading.Thread(target=_stream, args=(server.base_url, i, stop, started[i], counts), daemon=True)
                for i in range(NUM_STREAMS)
            ]
            for t in streams:
                t.start()
            try:
                assert all(e.wait(120.0) for e in started), "the streams did not start"
                for condition, first_token in (("quiet", 1000), ("beside a cpu hog", 5000)):
                    if condition != "quiet":
                        hog = subprocess.Popen(
                            [sys.executable, "-m", "bench.cpu_hog", "--duty", "0.5", "--seconds", "600"],
                            stdout=subprocess.PIPE,
                            start_new_session=True,
                        )
                    time.sleep(1.0)  # the streams are decoding together (beside the hog)
                    # Distinct tokens each time: no prefix of the first prompt is cached for the second.
                    long_prompt = list(range(first_token, first_token + LONG_PROMPT_TOKENS))
                    sent = time.monotonic()
                    r = httpx.post(
                        f"{server.base_url}/v1/completions",
                        timeout=300.0,
                        json={
                            "model": "SmolLM2-135M-Instruct",
                            "prompt": long_prompt,
                            "max_tokens": 1,
                            "temperature": 0,
                        },
                    )
                    assert r.status_code == 200, r.text
                    windows.append((condition, sent, time.monotonic()))
                    time.sleep(0.5)
                    streaming = list(counts)
                    time.sleep(1.0)
                    assert all(after > before for after, before in zip(counts, streaming)), (
                        f"{condition}: a stream stopped"
                    )
            finally:
                stop.set()
                for t in streams:
                    t.join(60.0)
    finally:
        if hog is not None:
            stop_process(hog, 10.0)
    for condition, sent, answered in windows:
        _check_decode_kept_stepping(logs, sent, answered, condition)
