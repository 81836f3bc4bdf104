"""The engine's disaggregated lifecycle on a tiny model, through its public methods only:
reserve / abort and prefill / hold / send / release cycles leave every block accounted for."""

from __future__ import annotations

import json

import pytest

from common.protocol import WorkerReady
from common.request import PrefillRequest
from common.sampling_params import SamplingParams
from testkit import workers as calls
from tests.engine.test_prefix_and_stress import tiny_engine
from workers.engine.sequence import SequenceStatus
from workers.shell.worker import STEP_LOG_ENV, AbortedIds, EngineWorker, RequestAborted, WorkerConfig

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine():
    return tiny_engine(num_kv_blocks=32, block_size=16, max_num_batched_tokens=64)


@pytest.fixture(autouse=True)
def clean(engine):
    engine.block_manager.reset_prefix_cache()
    start = engine.block_manager.num_free_blocks
    yield
    assert not engine.has_unfinished_requests() and not engine.scheduler.held
    engine.scheduler.check_invariants()
    assert engine.block_manager.num_free_blocks == start


def run_until_idle(engine) -> list:
    outputs = []
    while engine.has_schedulable_work():
        outputs += engine.step()
    return outputs


def prompt(n: int, base: int = 10) -> list[int]:
    return [3 + (base + i) % 500 for i in range(n)]  # inside the tiny vocabulary (512)


def test_reserve_then_abort_frees_the_reservation(engine):
    reservation = engine.reserve_for_kv(prompt(40), GREEDY, "r")
    assert len(reservation.block_ids) == 3 and reservation.num_cached_tokens == 0
    assert engine.request_ids() == ["r"] and not engine.has_schedulable_work()
    engine.scheduler.check_invariants()
    assert engine.abort("r") and not engine.abort("r")


def test_reserve_kv_arrives_then_decodes_to_the_end(engine):
    engine.reserve_for_kv(prompt(40), GREEDY, "r")
    engine.start_decoding("r", 5)
    outs = run_until_idle(engine)
    assert outs[-1].finished and outs[-1].num_output_tokens == 4
    with pytest.raises(ValueError, match="'r' is not waiting for KV"):
        engine.start_decoding("r", 5)


def test_start_decoding_a_request_not_waiting_for_kv_is_refused(engine):
    with pytest.raises(ValueError, match="'nobody' is not waiting for KV"):
        engine.start_decoding("nobody", 5)
    engine.add_request(prompt(20), GREEDY, "local")
    with pytest.raises(ValueError, match="'local' cannot go from waiting to running .needs waiting_for_kv."):
        engine.start_decoding("local", 5)
    engine.abort("local")


def test_prefill_hold_send_release_cycle(engine):
    engine.add_request(prompt(40), GREEDY, "p", prefill_only=True)
    [first] = run_until_idle(engine)
    assert not first.finished and len(first.token_ids) == 1
    assert engine.request_ids() == [] and not engine.has_unfinished_requests()
    held = engine.scheduler.held["p"]
    assert held.status is SequenceStatus.HELD_FOR_PEER
    with pytest.raises(ValueError, match="'p' is already in use"):
        engine.add_request(prompt(8), GREEDY, "p")
    blocks = engine.held_block_ids("p")
    assert engine.begin_send("p") == blocks and held.status is SequenceStatus.SENDING_KV
    assert engine.release("p") and not engine.release("p")
    assert held.status is SequenceStatus.FINISHED


def test_abort_during_send_defers_the_free_to_release(engine):
    engine.add_request(prompt(40), GREEDY, "p", prefill_only=True)
    run_until_idle(engine)
    engine.begin_send("p")
    free = engine.block_manager.num_free_blocks
    assert engine.abort("p")
    assert engine.block_manager.num_free_blocks == free  # the transfer still reads them
    assert engine.release("p")


def test_abort_all_aborts_waiting_running_and_reserved_but_not_held(engine):
    engine.add_request(prompt(200), GREEDY, "long")
    engine.add_request(prompt(20, base=500), GREEDY, "queued")
    engine.reserve_for_kv(prompt(30, base=700), GREEDY, "reserved")
    engine.add_request(prompt(16, base=900), GREEDY, "held", prefill_only=True)
    engine.step()  # "long" takes the whole first budget
    assert sorted(engine.abort_all()) == ["held", "long", "queued", "reserved"]
    engine.add_request(prompt(16, base=900), GREEDY, "held", prefill_only=True)
    run_until_idle(engine)
    assert engine.abort_all() == [] and list(engine.scheduler.held) == ["held"]
    engine.release("held")


def test_worker_ready_reports_the_engines_limits(engine):
    worker = EngineWorker(WorkerConfig("decode-0", "decode"), engine=engine)
    try:
        report = worker.ready()
    finally:
        worker.shutdown()
    assert report == WorkerReady(
        worker_id="decode-0",
        role="decode",
        max_model_len=engine.max_model_len,
        block_size=16,
        num_blocks=32,
        dtype="float32",
        kv_cache_dtype="float32",
    )
    assert report.max_model_len == min(engine.runner.max_model_len, 32 * 16)  # capped by the KV cache


def test_a_creation_call_arriving_after_a_final_abort_is_refused(engine):
    # The router's abort and a late reserve/submit/prefill of the same request race through
    # different Ray call threads; what the late call would create must not be held for ever.
    worker = EngineWorker(WorkerConfig("decode-0", "decode"), engine=engine)
    try:
        assert calls.abort(worker, "gone") is False  # nothing here yet
        with pytest.raises(RequestAborted, match="gone"):
            calls.reserve(worker, "gone", prompt(40), GREEDY)
        with pytest.raises(RequestAborted, match="gone"):
            calls.submit(worker, "gone", prompt(40), GREEDY)
        with pytest.raises(RequestAborted, match="gone"):  # refused by the call itself, not in the outbox
            worker.prefill(PrefillRequest(calls.request("gone", prompt(40), GREEDY), None))
        assert engine.request_ids() == [] and worker.counters.snapshot()["prompt_tokens"] == 0
        # A cleanup abort before starting the request again here (a prefill fallback, a migration
        # back to a restarted worker) is not final: the next submit runs.
        assert calls.reserve(worker, "again", prompt(40), GREEDY) is not None
        assert calls.abort(worker, "again", final=False) is True
        calls.submit(worker, "again", prompt(40), GREEDY)
        outputs = []
        while not any(o.finished for o in outputs):
            outputs += worker.poll_outputs(5.0)
        assert sum(len(o.token_ids) for o in outputs) == 4
    finally:
        worker.shutdown()


def test_the_aborted_ids_are_bounded():
    ids = AbortedIds(capacity=3)
    for rid in "abcd":
        ids.add(rid)
    ids.refuse("a")  # the oldest was forgotten
    for rid in "bcd":
        with pytest.raises(RequestAborted):
            ids.refuse(rid)


def test_the_step_observer_sees_each_steps_chunks_and_time(engine):
    seen = []
    stop = engine.observe_steps(lambda chunks, seconds: seen.append((chunks, seconds)))
    try:
        engine.generate([prompt(100), prompt(30, base=200)], GREEDY)  # 64-token budget
    finally:
        stop()
    # (tokens computed before, tokens this step, sampled), as the scheduler's budget splits them:
    # the first prompt's chunks, then the second's beside the first's decodes.
    assert [c for c, _ in seen[:3]] == [
        [(0, 64, False)],
        [(64, 36, True), (0, 28, False)],
        [(100, 1, True), (28, 2, True)],
    ]
    assert all(s > 0 for _, s in seen)


def test_a_worker_logs_its_steps_where_the_environment_says(engine, tmp_path, monkeypatch):
    monkeypatch.setenv(STEP_LOG_ENV, str(tmp_path))
    worker = EngineWorker(WorkerConfig("prefill-0", "prefill"), engine=engine)
    try:
        calls.submit(worker, "logged", prompt(40), GREEDY)
        while not any(o.finished for o in worker.poll_outputs(5.0)):
            pass
    finally:
        worker.shutdown()  # stops logging this engine's steps
    steps = [json.loads(line) for line in (tmp_path / "prefill-0.jsonl").read_text().splitlines()]
    assert [s["chunks"] for s in steps] == [[[0, 40, True]], [[40, 1, True]], [[41, 1, True]], [[42, 1, True]]]
    assert {s["role"] for s in steps} == {"prefill"} and all(s["seconds"] > 0 for s in steps)
