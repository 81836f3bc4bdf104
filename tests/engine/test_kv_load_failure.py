"""A prefill worker whose KV pushes are faulty, and the decode worker's --kv-load-failure-policy.

Two EngineWorkers in this process (no Ray) on a tiny random Llama, KV over shared memory; the
prefill worker's transport injects one fault per request (kvtransfer.integrity.FaultPlan).
Oracle: a single engine's greedy answer for each prompt.

- recompute: every request still gets exactly the single engine's tokens, and the decode
  worker prefilled the prompt itself for every faulty one (its computed-token count shows it),
  so none was decoded from the corrupted blocks; the failures are counted by reason.
- fail: start_decode raises KVLoadFailed (retryable) naming the reason, and frees the request.
  A send that fails on the sender's side (stalled, killed) ends the prefill as PrefillFailed.
In both, every block of both workers is free at the end.
"""

from __future__ import annotations

import random

import pytest

from common.sampling_params import SamplingParams
from common.transports import KVLoadFailed
from kvtransfer.integrity import Fault, FaultKind, FaultPlan
from testkit import workers as calls
from tests.engine.helpers import save_tiny_model
from workers.build import build_engine
from workers.config import EngineConfig
from workers.models.checkpoint import iter_safetensors
from workers.models.config import ModelConfig
from workers.shell.worker import EngineWorker, WorkerConfig

pytestmark = pytest.mark.slow
CONFIG = EngineConfig(num_kv_blocks=96, max_num_batched_tokens=128)
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
# Faults the decode side sees at start_decode (shm is one-sided: the sender's copy "succeeds").
DATA_FAULTS = [
    FaultKind.FLIP,
    FaultKind.DROP,
    FaultKind.TRUNCATE,
    FaultKind.REORDER,
    FaultKind.DUPLICATE,
    FaultKind.FOREIGN_REQUEST,
    FaultKind.FOREIGN_LAYOUT,
]
REASONS = {
    FaultKind.TRUNCATE: "incomplete",
    FaultKind.FOREIGN_REQUEST: "foreign_request",
    FaultKind.FOREIGN_LAYOUT: "foreign_layout",
}


@pytest.fixture(scope="module")
def tiny_llama():
    folder, _ = save_tiny_model("llama", tie_word_embeddings=False)
    return folder


@pytest.fixture(scope="module")
def oracle(tiny_llama):
    return build_engine(ModelConfig.from_model_dir(tiny_llama), CONFIG, iter_safetensors(tiny_llama))


def workers(folder, policy):
    def make(wid, role):
        return EngineWorker(
            WorkerConfig(
                wid,
                role,
                folder,
                CONFIG,
                transport="shm",
                transfer_timeout_s=1.0,
                kv_load_failure_policy=policy,
            )
        )

    return make(f"p-{policy}", "prefill"), make(f"d-{policy}", "decode")


def prompts(seed: int, n: int) -> list[list[int]]:
    rng = random.Random(seed)  # distinct prompts: the decode worker's prefix cache never has them
    return [[rng.randrange(3, 500) for _ in range(rng.randint(33, 60))] for _ in range(n)]


def run_decode(decode, rid):
    tokens = []
    while True:
        outputs = decode.poll_outputs(10.0)
        assert outputs, "decode worker produced nothing for 10 s"
        for out in outputs:
            if out.request_id == rid:
                tokens += out.token_ids
        if any(o.finished and o.request_id == rid for o in outputs):
            return tokens


def handoff(prefill, decode, rid, prompt):
    reservation = calls.reserve(decode, rid, prompt, PARAMS)
    assert reservation is not None
    result = calls.prefill(prefill, rid, prompt, PARAMS, decode.endpoint(), reservation)
    return list(result.output.token_ids)


def all_blocks_free(*pair):
    for worker in pair:
        stats = worker.stats()
        assert stats.num_free_blocks == stats.num_blocks, (worker.worker_id, stats)
        assert worker.transport.pending_transfers() == []


def test_recompute_gives_the_engines_greedy_answers(tiny_llama, oracle):
    prefill, decode = workers(tiny_llama, "recompute")
    try:
        cases = [None] + DATA_FAULTS + [None]
        ps = prompts(1, len(cases))
        prefill.transport.set_fault_plan(
            FaultPlan({f"r{i}": Fault(k, block=1, bit=30) for i, k in enumerate(cases) if k is not None})
        )
        for i, (kind, prompt) in enumerate(zip(cases, ps)):
            [want] = oracle.generate([prompt], PARAMS)
            before = decode.engine.num_computed_tokens
            first = handoff(prefill, decode, f"r{i}", prompt)
            calls.start_decode(decode, f"r{i}", first[0])
            got = first + run_decode(decode, f"r{i}")
            assert got == want.token_ids, (kind, got, want.token_ids)
            computed = decode.engine.num_computed_tokens - before
            if kind is None:  # decoded from the pushed KV: only the new tokens were computed here
                assert computed == PARAMS.max_tokens - 1, (kind, computed)
            else:  # prompt + first token prefilled here, the pushed blocks thrown away
                assert computed >= len(prompt) + 1 + PARAMS.max_tokens - 2, (kind, computed)
        failures = decode.kv_failures.snapshot()
        assert sum(failures.values()) == len(DATA_FAULTS)
        for kind, reason in REASONS.items():
            assert failures[reason] >= 1, (kind, failures)
        assert failures["checksum"] == 4
        assert decode.kv_failures.recomputed == len(DATA_FAULTS)
        all_blocks_free(prefill, decode)
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_fail_gives_a_clean_retryable_error_and_frees_everything(tiny_llama, oracle):
    prefill, decode = workers(tiny_llama, "fail")
    try:
        cases = [FaultKind.FLIP, FaultKind.TRUNCATE, FaultKind.FOREIGN_REQUEST, None]
        ps = prompts(2, len(cases))
        prefill.transport.set_fault_plan(
            FaultPlan({f"f{i}": Fault(k, block=0, bit=30) for i, k in enumerate(cases) if k is not None})
        )
        for i, (kind, prompt) in enumerate(zip(cases, ps)):
            first = handoff(prefill, decode, f"f{i}", prompt)
            if kind is None:
                calls.start_decode(decode, f"f{i}", first[0])
                [want] = oracle.generate([prompt], PARAMS)
                assert first + run_decode(decode, f"f{i}") == want.token_ids
                continue
            with pytest.raises(KVLoadFailed) as info:
                calls.start_decode(decode, f"f{i}", first[0])
            assert info.value.reason == REASONS.get(kind, "checksum")
            assert f"f{i}" not in decode.engine.request_ids()
        all_blocks_free(prefill, decode)
        # The sender's failures (a stall past the deadline, a sender killed mid-copy) end the
        # prefill as PrefillFailed; the decode worker's reservation is then freed by the router's abort.
        for kind in (FaultKind.STALL, FaultKind.KILL):
            rid = f"late-{kind.value}"
            prefill.transport.set_fault_plan(FaultPlan({rid: Fault(kind)}))
            with pytest.raises(calls.PrefillError, match=f"the KV handoff of {rid} failed"):
                handoff(prefill, decode, rid, prompts(3, 1)[0])
            calls.abort(decode, rid, final=False)
        all_blocks_free(prefill, decode)
    finally:
        prefill.shutdown()
        decode.shutdown()
