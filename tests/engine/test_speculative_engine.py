"""Speculative decoding (n-gram, and suffix) through the engine: the tokens are those of the same engine
without speculation (the oracle), greedy and seeded, with chunked prefill, FP8 KV, preemptions,
stop tokens, stop strings, max_tokens and min_tokens; the block manager's invariants hold after
every step of a randomized run. Every test also asserts drafts were accepted, so none can pass by
never speculating. A tiny random Llama keeps these fast (its greedy answers fall into loops that
the n-gram proposer catches); the default model's test is marked slow.
"""

from __future__ import annotations

import random

import pytest

from common.sampling_params import SamplingParams
from tests.engine.helpers import save_tiny_model
from workers.build import build_engine, load_engine
from workers.config import EngineConfig
from workers.engine.llm_engine import LLMEngine
from workers.models.checkpoint import iter_safetensors
from workers.models.config import ModelConfig

NGRAM = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}'
SUFFIX = '{"method": "suffix", "num_speculative_tokens": 4}'
KV = 8 << 20


@pytest.fixture(scope="module")
def model_dir():
    folder, _ = save_tiny_model("llama")
    return folder


def passage_prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Prompts that repeat a random passage (so drafts from the prompt can be right)."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        passage = [rng.randrange(3, 512) for _ in range(rng.randrange(6, 20))]
        prompts.append([rng.randrange(3, 512) for _ in range(rng.randrange(1, 8))] + passage * rng.randrange(2, 4))
    return prompts


def toy_decode(ids: list[int]) -> str:
    """A stand-in tokenizer for stop strings: each id is one letter."""
    return "".join(chr(ord("a") + t % 26) for t in ids)


class FreeTokens:
    """A step cost where tokens cost nothing: every draft with any chance is verified
    (workers.speculative.draft_budget), so these tests exercise verification on every step they can."""

    def token_cost(self, num_decoding: int) -> float:
        return 0.0

    def observe(self, num_decoding: int, tokens: int, seconds: float) -> None:
        pass

    def draft_cost(self, num_decoding: int) -> float:
        return 0.0

    def observe_proposal(self, num_decoding: int, drafts: int, seconds: float) -> None:
        pass


def engine(model_dir, speculative: str | None, decode=None, adaptive: bool = False, **config) -> LLMEngine:
    cfg = EngineConfig(kv_cache_memory=KV, speculative_config=speculative, **config)
    eng = build_engine(ModelConfig.from_model_dir(model_dir), cfg, iter_safetensors(model_dir), decode)
    if eng.speculator is not None and not adaptive:
        eng.speculator.step_cost = FreeTokens()
    return eng


def run(eng: LLMEngine, prompts, params, check_blocks: bool = False):
    """generate(), optionally checking the block manager after every step."""
    params = params if isinstance(params, list) else [params] * len(prompts)
    ids = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
    got = {rid: [] for rid in ids}
    outs = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            got[out.request_id].extend(out.token_ids)
            if out.finished:
                outs[out.request_id] = out
        if check_blocks:
            eng.scheduler.check_invariants()
    return [(got[r], outs[r].finish_reason, outs[r].num_output_tokens) for r in ids]


def accepted(eng: LLMEngine) -> int:
    return eng.stats().spec_decode.num_accepted_tokens


GREEDY = SamplingParams(max_tokens=28, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize(
    "options",
    [
        pytest.param({}, id="plain-kv"),
        pytest.param({"max_num_batched_tokens": 16}, id="chunked-prefill"),
        pytest.param({"kv_cache_dtype": "fp8"}, id="fp8-kv"),
        pytest.param({"kernel_backend": "reference"}, id="reference-kernels"),
    ],
)
def test_greedy_tokens_are_those_without_speculation(model_dir, options):
    prompts = passage_prompts(4)
    plain = run(engine(model_dir, None, **options), prompts, GREEDY)
    spec_engine = engine(model_dir, NGRAM, **options)
    spec = run(spec_engine, prompts, GREEDY, check_blocks=True)
    assert spec == plain
    stats = spec_engine.stats().spec_decode
    assert stats.num_accepted_tokens > 0 and stats.num_drafts > 0
    assert stats.num_draft_tokens >= stats.num_accepted_tokens == sum(stats.accepted_per_pos)
    # Fewer steps than tokens: speculation did save forward passes.
    assert spec_engine.stats().num_computed_tokens > plain[0][2]


def test_penalised_greedy_rows_count_the_drafts_before_each_position(model_dir):
    prompts = passage_prompts(4, seed=8)
    params = [
        SamplingParams(max_tokens=28, temperature=0.0, ignore_eos=True, frequency_penalty=0.3, presence_penalty=0.2),
        SamplingParams(max_tokens=28, temperature=0.0, ignore_eos=True, repetition_penalty=1.2),
    ] * 2
    plain = run(engine(model_dir, None), prompts, params)
    spec_engine = engine(model_dir, NGRAM)
    assert run(spec_engine, prompts, params) == plain
    assert accepted(spec_engine) > 0


def test_each_verified_position_sees_the_drafts_before_it_as_output():
    """The sampler's row at draft position j: output + drafts[:j], and stop tokens banned while
    output + j tokens are under min_tokens (written out by hand)."""
    from workers.engine.request_state import RequestState
    from workers.engine.sequence import Sequence

    seq = Sequence("r", [1, 2, 3], SamplingParams(max_tokens=20, temperature=0.0, stop_token_ids=[7], min_tokens=4))
    seq.append_token(10)
    seq.append_token(11)
    rows = RequestState(seq, None, None).sampling_rows((12, 13, 14), {2})
    assert [r.output_token_ids for r in rows] == [[10, 11], [10, 11, 12], [10, 11, 12, 13], [10, 11, 12, 13, 14]]
    assert [set(r.banned_token_ids) for r in rows] == [{2, 7}, {2, 7}, set(), set()]


def test_preemptions_in_the_middle_change_no_token(model_dir):
    prompts = passage_prompts(8, seed=1)
    plain = run(engine(model_dir, None), prompts, GREEDY)
    # 12 blocks of 16 tokens for 8 sequences of up to ~100 tokens: the scheduler must preempt.
    small = engine(model_dir, NGRAM, num_kv_blocks=12, max_num_seqs=8)
    spec = run(small, prompts, GREEDY, check_blocks=True)
    assert small.stats().num_preemptions > 0
    assert accepted(small) > 0
    assert spec == plain


def seeded(seed: int, **extra) -> SamplingParams:
    return SamplingParams(max_tokens=32, temperature=0.7, top_p=0.9, top_k=40, seed=seed, ignore_eos=True, **extra)


def test_seeded_requests_get_the_same_tokens_alone_batched_and_without_speculation(model_dir):
    prompts = passage_prompts(4, seed=2)
    params = [seeded(10 + i, frequency_penalty=0.2 * (i % 2), min_p=0.05 * (i % 3)) for i in range(4)]
    spec_engine = engine(model_dir, NGRAM)
    alone = [run(spec_engine, [p], [sp])[0] for p, sp in zip(prompts, params)]
    mixed = prompts + passage_prompts(2, seed=3)
    batched = run(
        spec_engine, mixed, params + [SamplingParams(max_tokens=30, temperature=1.0, ignore_eos=True), GREEDY]
    )[:4]
    plain = run(engine(model_dir, None), prompts, params)
    assert accepted(spec_engine) > 0
    assert alone == batched == plain


def test_stops_end_the_reply_exactly_where_they_do_without_speculation(model_dir):
    prompts = passage_prompts(3, seed=4)
    reference = run(engine(model_dir, None), prompts, GREEDY)
    # Stop on a token each greedy reply produces in its middle, once without and once with min_tokens
    # past its first occurrence (then it is banned until min_tokens, and the reply goes elsewhere).
    params = []
    for tokens, _, _ in reference:
        stop = tokens[len(tokens) // 2]
        first = tokens.index(stop)
        params.append(SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop_token_ids=[stop]))
        params.append(
            SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop_token_ids=[stop], min_tokens=first + 2)
        )
        params.append(SamplingParams(max_tokens=first + 3, temperature=0.0, ignore_eos=True))
        params.append(
            SamplingParams(
                max_tokens=40, temperature=0.0, ignore_eos=True, stop=[toy_decode(tokens[first + 2 : first + 4])]
            )
        )
    many = [p for p in prompts for _ in range(4)]
    plain = run(engine(model_dir, None, decode=toy_decode), many, params)
    spec_engine = engine(model_dir, NGRAM, decode=toy_decode)
    spec = run(spec_engine, many, params, check_blocks=True)
    assert accepted(spec_engine) > 0
    assert spec == plain
    for (tokens, reason, usage), p in zip(spec, params):
        assert usage == len(tokens)  # usage counts the emitted tokens only
        if p.stop_token_ids and reason == "stop":
            assert tokens[-1] in p.stop_token_ids and tokens.index(tokens[-1]) == len(tokens) - 1
            assert len(tokens) > p.min_tokens


@pytest.mark.parametrize("method", [NGRAM, SUFFIX], ids=["ngram", "suffix"])
def test_block_invariants_hold_after_every_step_of_a_randomized_run(model_dir, method):
    rng = random.Random(7)
    eng = engine(model_dir, method, num_kv_blocks=24, max_num_seqs=6, max_num_batched_tokens=48)
    eng.sampler.generator.manual_seed(11)  # unseeded requests' draws too: one run, the same preemptions each time
    prompts = passage_prompts(24, seed=5)
    live: list[str] = []
    submitted = finished = 0
    while submitted < len(prompts) or eng.has_unfinished_requests():
        while submitted < len(prompts) and rng.random() < 0.5:
            temperature = rng.choice([0.0, 0.8])
            params = SamplingParams(
                max_tokens=rng.randrange(1, 40),
                temperature=temperature,
                ignore_eos=True,
                seed=rng.randrange(100) if rng.random() < 0.5 else None,
            )
            live.append(eng.add_request(prompts[submitted], params))
            submitted += 1
        for out in eng.step():
            if out.finished:
                live.remove(out.request_id)
                finished += 1
        if live and rng.random() < 0.05:
            assert eng.abort(live.pop(rng.randrange(len(live))))
        eng.scheduler.check_invariants()
    bm = eng.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert finished > 15 and accepted(eng) > 0 and eng.stats().num_preemptions > 0


def test_suffix_drafts_change_no_token_and_later_requests_draft_from_earlier_outputs(model_dir):
    prompts = passage_prompts(4, seed=3)
    plain = run(engine(model_dir, None), prompts, GREEDY)
    eng = engine(model_dir, SUFFIX, max_num_batched_tokens=16)  # chunked prefill too
    assert run(eng, prompts, GREEDY, check_blocks=True) == plain
    first = accepted(eng)
    assert first > 0
    # Asked again, each request finds its answer among the outputs this engine cached: more accepted.
    assert run(eng, prompts, GREEDY, check_blocks=True) == plain
    assert accepted(eng) - first > first


def test_no_drafts_past_the_batch_threshold(model_dir):
    many = passage_prompts(6, seed=6)
    spec = '{"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": 3}'
    eng = engine(model_dir, spec)
    run(eng, many, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, min_tokens=8))
    assert eng.stats().spec_decode.num_drafts == 0  # 6 decoding together, always over 3
    run(eng, many[:2], GREEDY)
    assert eng.stats().spec_decode.num_drafts > 0


@pytest.mark.slow
def test_default_model_repeats_a_passage_with_the_same_greedy_tokens(default_model_dir, hf_tokenizer):
    from pydoc_data.topics import topics

    passage = topics["assert"][:500]
    messages = [{"role": "user", "content": f"Repeat this passage exactly:\n\n{passage}"}]
    prompt = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    params = SamplingParams(max_tokens=48, temperature=0.0)
    plain = load_engine(default_model_dir, EngineConfig(kv_cache_memory=64 << 20))
    expected = plain.generate([prompt], params)[0]
    spec = load_engine(default_model_dir, EngineConfig(kv_cache_memory=64 << 20, speculative_config=NGRAM))
    # Verify drafts whenever there are any: this test is about exactness, not about when drafts pay
    # (on this CPU a draft costs ~0.15 of a one-sequence step, and the budget stops drafting after
    # the reply's opening words miss).
    spec.speculator.step_cost = FreeTokens()
    got = spec.generate([prompt], params)[0]
    assert accepted(spec) > 0
    assert (got.token_ids, got.text, got.finish_reason) == (expected.token_ids, expected.text, expected.finish_reason)
