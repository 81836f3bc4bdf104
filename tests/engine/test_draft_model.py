"""The draft_model method through the engine: the tokens are those of the same engine without
speculation (the oracle), greedy and seeded, with chunked prefill, FP8 KV, preemptions, a migration
and a remote prefill whose KV arrived over shared memory. A model drafting for itself must have
(nearly) every greedy draft accepted: that checks the draft's own KV (its catch-up after a remote
prefill, a preemption or a migration, its scratch blocks, what it keeps after a verification),
because a draft reading wrong KV guesses wrong. A smaller draft (one layer, other weights) checks
exactness when drafts are often wrong.
"""

from __future__ import annotations

import dataclasses
import json
import random

import pytest

from common.protocol import ResumeState
from common.sampling_params import SamplingParams
from testkit import workers as calls
from tests.engine.helpers import save_tiny_model
from tests.engine.test_speculative_engine import GREEDY, FreeTokens, accepted, engine, passage_prompts, run
from workers.config import EngineConfig, SpeculativeConfig


def draft_config(folder: str, k: int = 4) -> str:
    return json.dumps({"method": "draft_model", "model": str(folder), "num_speculative_tokens": k})


@pytest.fixture(scope="module")
def target_dir():
    folder, _ = save_tiny_model("llama")
    return folder


@pytest.fixture(scope="module")
def small_draft_dir():
    folder, _ = save_tiny_model(
        "llama", num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1
    )
    return folder


def acceptance(eng) -> float:
    stats = eng.stats().spec_decode
    return stats.num_accepted_tokens / max(stats.num_draft_tokens, 1)


@pytest.mark.parametrize(
    "options",
    [
        pytest.param({}, id="plain-kv"),
        pytest.param({"max_num_batched_tokens": 16}, id="chunked-prefill"),
        pytest.param({"kv_cache_dtype": "fp8"}, id="fp8-kv"),
    ],
)
def test_a_model_drafting_for_itself_has_its_greedy_drafts_accepted(target_dir, options):
    prompts = passage_prompts(4)
    plain = run(engine(target_dir, None, **options), prompts, GREEDY)
    spec_engine = engine(target_dir, draft_config(target_dir), **options)
    assert run(spec_engine, prompts, GREEDY, check_blocks=True) == plain
    stats = spec_engine.stats().spec_decode
    assert stats.num_draft_tokens > 40
    # FP8 KV: the target reads quantized KV, the draft float; a near tie may then go the other way.
    assert acceptance(spec_engine) >= (0.9 if options.get("kv_cache_dtype") == "fp8" else 0.97)


def test_a_smaller_draft_changes_no_token(target_dir, small_draft_dir):
    prompts = passage_prompts(6, seed=1)
    plain = run(engine(target_dir, None), prompts, GREEDY)
    spec_engine = engine(target_dir, draft_config(small_draft_dir))
    assert run(spec_engine, prompts, GREEDY, check_blocks=True) == plain
    assert spec_engine.stats().spec_decode.num_draft_tokens > 0


def test_preemptions_leave_the_draft_nothing_stale(target_dir):
    prompts = passage_prompts(8, seed=1)
    plain = run(engine(target_dir, None), prompts, GREEDY)
    small = engine(target_dir, draft_config(target_dir), num_kv_blocks=12, max_num_seqs=8)
    assert run(small, prompts, GREEDY, check_blocks=True) == plain
    assert small.stats().num_preemptions > 0
    assert acceptance(small) >= 0.97


def test_seeded_requests_get_the_same_tokens_with_a_draft(target_dir, small_draft_dir):
    prompts = passage_prompts(4, seed=2)
    params = [SamplingParams(max_tokens=32, temperature=0.7, top_p=0.9, seed=10 + i, ignore_eos=True) for i in range(4)]
    plain = run(engine(target_dir, None), prompts, params)
    for draft in (target_dir, small_draft_dir):
        spec_engine = engine(target_dir, draft_config(draft))
        assert run(spec_engine, prompts, params) == plain
        assert spec_engine.stats().spec_decode.num_draft_tokens > 0


SAMPLED = [
    SamplingParams(max_tokens=32, temperature=1.0, ignore_eos=True),
    SamplingParams(max_tokens=32, temperature=0.8, top_p=0.9, top_k=50, ignore_eos=True),
    SamplingParams(max_tokens=32, temperature=1.2, min_p=0.01, frequency_penalty=0.5, ignore_eos=True),
]


@pytest.mark.parametrize("seeded", [True, False], ids=["seeded", "unseeded"])
def test_sampled_drafts_are_drawn_with_the_verifications_keys(target_dir, seeded):
    """At temperature 1 the tiny random model spreads its probability thin, so a draft that guessed its
    own argmax would be accepted about as often as that one token is drawn. Drawn from the draft's
    distribution with the key the verification draws that position with, a model drafting for itself
    is accepted nearly always (oracle: the acceptance, and a point-mass proposer's on the same
    requests); seeded requests still get exactly the tokens of the engine without speculation."""
    prompts = passage_prompts(6, seed=5)
    params = [dataclasses.replace(SAMPLED[i % 3], seed=100 + i if seeded else None) for i in range(6)]
    spec_engine = engine(target_dir, draft_config(target_dir))
    got = run(spec_engine, prompts, params)
    if seeded:
        assert got == run(engine(target_dir, None), prompts, params)
    assert spec_engine.stats().spec_decode.num_draft_tokens > 100
    assert acceptance(spec_engine) >= 0.9
    argmax_drafts = engine(target_dir, draft_config(target_dir))
    run_without_keys(argmax_drafts, prompts, params)
    assert acceptance(argmax_drafts) < 0.5


def run_without_keys(eng, prompts, params):
    """run() with the draft model proposing without the verification's keys (its argmax)."""
    proposer = eng.speculator.proposer
    plain = proposer.propose_many
    proposer.propose_many = lambda seqs, limits, generators=None: plain(seqs, limits)
    return run(eng, prompts, params)


def test_a_migrated_request_drafts_from_its_new_worker(target_dir):
    prompt = passage_prompts(1, seed=3)[0]
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    [(want, _, _)] = run(engine(target_dir, None), [prompt], params)
    spec_engine = engine(target_dir, draft_config(target_dir))
    spec_engine.resume_request(prompt, params, "moved", ResumeState(tuple(want[:10]), 0))
    got = list(want[:10])
    while spec_engine.has_unfinished_requests():
        for out in spec_engine.step():
            got += out.token_ids
    assert got == want
    assert acceptance(spec_engine) >= 0.97 and accepted(spec_engine) > 0


def draft_tokens(eng) -> int:
    """Tokens run through the engine's draft model since it started."""
    return eng.speculator.proposer.num_computed_tokens


def test_a_remote_prefill_carries_the_drafts_kv_and_the_decode_worker_runs_only_new_tokens(target_dir):
    """The prefill worker's draft runs over exactly the prompt tokens its target runs, and its KV travels
    with the target's. The oracle for the decode worker's draft: a local engine's draft, given the same
    requests one at a time, runs each prompt at its first proposal, or beside the target's prefill past
    a prefix it finds cached in blocks its draft filled; the decode worker's runs the same less the
    prompts whose draft KV it has: those it received whole, and one whose prefix it found in its
    prefix cache in blocks its draft had filled (a follow-up turn), but not one whose prefix was
    computed here by the target alone (a local request that never drafted). It drafts as well as the
    local engine: a model drafting for itself from wrong KV would guess wrong."""
    from workers.shell.worker import EngineWorker, WorkerConfig

    first, local_only, other = passage_prompts(3, seed=4)
    extra = [7, 8, 9, 10, 11]
    local = engine(target_dir, draft_config(target_dir))
    one = SamplingParams(max_tokens=1, temperature=0.0)
    config = EngineConfig(kv_cache_memory=8 << 20, speculative_config=draft_config(target_dir))
    prefill = EngineWorker(WorkerConfig("p0", "prefill", target_dir, config, transport="shm"))
    decode = EngineWorker(WorkerConfig("d0", "decode", target_dir, config, transport="shm"))
    decode.engine.speculator.step_cost = FreeTokens()  # verify drafts on every step (see engine())

    def remote(rid: str, prompt: list[int]) -> tuple[list[int], int]:
        """The request through the handoff: its tokens, and the prompt tokens the decode worker had cached."""
        reservation = calls.reserve(decode, rid, prompt, GREEDY)
        result = calls.prefill(prefill, rid, prompt, GREEDY, decode.endpoint(), reservation)
        tokens = list(result.output.token_ids)
        calls.start_decode(decode, rid, tokens[0])
        return tokens + collect(rid, GREEDY.max_tokens - 1), reservation.num_cached_tokens

    def collect(rid: str, count: int) -> list[int]:
        tokens: list[int] = []
        while len(tokens) < count:
            outputs = decode.poll_outputs(5.0)
            assert outputs, "the decode worker produced nothing for 5 s"
            tokens += [t for out in outputs if out.request_id == rid for t in out.token_ids]
        return tokens

    try:
        assert prefill.connect_peer(decode.endpoint()) == "shm"
        want = run(local, [first], GREEDY)[0][0]
        assert remote("r0", first) == (want, 0)
        follow_up = first + want + extra  # its prefix is r0's prompt and reply, cached on the decode worker
        want = run(local, [follow_up], GREEDY)[0][0]
        got, follow_up_cached = remote("r1", follow_up)
        assert got == want and follow_up_cached >= len(first)
        run(local, [local_only], one)
        calls.submit(decode, "r2", local_only, one)  # prefilled here by the target alone; too short to draft
        assert len(collect("r2", 1)) == 1
        beside = local_only + extra
        want = run(local, [beside], GREEDY)[0][0]
        got, cached = remote("r3", beside)
        assert got == want and cached >= len(local_only) - len(local_only) % 16 > 0
        assert draft_tokens(prefill.engine) == prefill.engine.stats().num_computed_tokens
        # The local engine's draft ran r0's prompt at its first proposal, and r1's past the prefix it
        # found cached in blocks its draft had filled (beside the target's prefill, Speculator.prefill_kv).
        assert draft_tokens(decode.engine) == draft_tokens(local) - len(first) - (len(follow_up) - follow_up_cached)
        assert acceptance(decode.engine) >= 0.97 and accepted(decode.engine) == accepted(local)
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_a_pair_that_disagrees_on_the_draft_model_is_refused_at_connect(target_dir, small_draft_dir):
    from common.protocol import KVLayoutMismatch
    from workers.shell.worker import EngineWorker, WorkerConfig

    def worker(name: str, role: str, draft: str | None) -> EngineWorker:
        spec = draft_config(draft) if draft is not None else None
        return EngineWorker(
            WorkerConfig(name, role, target_dir, EngineConfig(kv_cache_memory=4 << 20, speculative_config=spec))
        )

    decode = worker("d0", "decode", target_dir)
    try:
        for draft, error in (
            (None, "this prefill worker runs no draft model but the decode worker it connects to does"),
            (small_draft_dir, r"draft model's cache \(speculative_config.model\): KV layout mismatch"),
        ):
            prefill = worker("p0", "prefill", draft)
            try:
                with pytest.raises(KVLayoutMismatch, match=error):
                    prefill.connect_peer(decode.endpoint())
            finally:
                prefill.shutdown()
    finally:
        decode.shutdown()


def test_block_invariants_hold_with_a_draft_in_a_randomized_run(target_dir, small_draft_dir):
    rng = random.Random(7)
    eng = engine(target_dir, draft_config(small_draft_dir), num_kv_blocks=24, max_num_seqs=6, max_num_batched_tokens=48)
    eng.sampler.generator.manual_seed(11)
    prompts = passage_prompts(16, seed=5)
    live: list[str] = []
    submitted = 0
    while submitted < len(prompts) or eng.has_unfinished_requests():
        while submitted < len(prompts) and rng.random() < 0.5:
            params = SamplingParams(
                max_tokens=rng.randrange(1, 40), temperature=rng.choice([0.0, 0.8]), ignore_eos=True
            )
            live.append(eng.add_request(prompts[submitted], params))
            submitted += 1
        for out in eng.step():
            if out.finished:
                live.remove(out.request_id)
        if live and rng.random() < 0.05:
            assert eng.abort(live.pop(rng.randrange(len(live))))
        eng.scheduler.check_invariants()
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
    assert eng.stats().spec_decode.num_draft_tokens > 0 and not eng.speculator.proposer._cached


def test_bad_draft_configs_name_the_key(target_dir, tmp_path):
    with pytest.raises(ValueError, match="speculative_config.model must name"):
        SpeculativeConfig("draft_model", 4)
    with pytest.raises(ValueError, match="speculative_config.model is for method 'draft_model'"):
        SpeculativeConfig("ngram", 4, model=str(target_dir))
    with pytest.raises(ValueError, match="draft_tensor_parallel_size 2 is not yet supported"):
        SpeculativeConfig("draft_model", 4, model=str(target_dir), draft_tensor_parallel_size=2)
    with pytest.raises(ValueError, match="not a model folder"):
        engine(target_dir, draft_config(tmp_path))
    other_vocab, _ = save_tiny_model("llama", vocab_size=256)
    with pytest.raises(ValueError, match="vocabulary of 256 tokens"):
        engine(target_dir, draft_config(other_vocab))
