"""Structured output after the reasoning, in the engine: the grammar's phase (REASONING ->
CONSTRAINED -> DONE) follows the tokens only, across the prefill -> decode handoff and a migrated
request's replay. On tiny random Qwen3 models that think (tests/engine/thinking_model.py): one
whose greedy reply closes its reasoning at step 0 (the prefill worker's token is `</think>`), one
at step 2 (the decode worker sees it), one never.

Oracles: transformers' greedy tokens for the free (reasoning) part, jsonschema for the answer,
hand-built token sequences for the phase machine, and the same engine run whole for the handoff
and the replays (greedy: the tokens must be the same)."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from common.protocol import ResumeState
from common.sampling_params import SamplingParams, StructuredOutput
from tests.engine.helpers import handoff, worker_pair
from tests.engine.thinking_model import hf_greedy_ids, prompt_ids, save_thinking_model
from workers.build import load_engine
from workers.config import EngineConfig
from workers.engine.grammar import GrammarPhase
from workers.engine.sampler import SamplingRow, sample

CONFIG = EngineConfig(num_kv_blocks=64, max_num_batched_tokens=64)
NEW_TOKENS = 24
ANSWER = {
    "type": "object",
    "properties": {"sky_is_blue": {"type": "boolean"}},
    "required": ["sky_is_blue"],
    "additionalProperties": False,
}
SPEC = StructuredOutput("json_schema", json.dumps(ANSWER))


@pytest.fixture(scope="module", params=[0, 2, None], ids=["ends-at-0", "ends-at-2", "never-ends"])
def model(request):
    return save_thinking_model(request.param, NEW_TOKENS)


@pytest.fixture(scope="module")
def quiet_model():
    return save_thinking_model(None, NEW_TOKENS)


def params_for(tok) -> SamplingParams:
    return SamplingParams(
        max_tokens=NEW_TOKENS,
        temperature=0.0,
        structured_output=SPEC,
        reasoning_end_token_ids=(tok.convert_tokens_to_ids("</think>"),),
    )


def run_whole(engine, prompt, params, request_id="whole") -> tuple[list[int], list[int], str]:
    """(tokens, characters of text streamed after each token, finish reason), one step at a time."""
    engine.add_request(prompt, params, request_id)
    tokens, chars, finish = [], [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += out.token_ids
            chars.append((chars[-1] if chars else 0) + len(out.text))
            finish = out.finish_reason if out.finished else finish
    return tokens, chars, finish


def check_reply(tok, hf, tokens: list[int], finish: str) -> None:
    """Free reasoning (transformers' own tokens) up to </think>, then an answer that validates."""
    think_end = tok.convert_tokens_to_ids("</think>")
    greedy = hf_greedy_ids(hf, prompt_ids(tok), NEW_TOKENS)
    if think_end not in greedy:
        assert tokens == greedy and finish == "length"  # never constrained
        return
    end = greedy.index(think_end)
    assert tokens[: end + 1] == greedy[: end + 1]
    jsonschema.validate(json.loads(tok.decode(tokens[end + 1 :], skip_special_tokens=True)), ANSWER)
    assert finish == "stop"


def test_phases_follow_the_tokens(quiet_model):
    folder, _, tok = quiet_model
    engine = load_engine(folder, CONFIG)
    a = tok.encode(" ok", add_special_tokens=False)[:1]
    end = (tok.convert_tokens_to_ids("<think>"), tok.convert_tokens_to_ids("</think>"))  # a two-token end, by hand
    state = engine.grammars.state(StructuredOutput("choice", '["yes"]'), end)
    assert state.phase is GrammarPhase.REASONING and not state.constraining
    yes = tok.encode("yes", add_special_tokens=False)
    for token in [*a, end[0], *a, end[1], end[1]]:  # the pieces of the end, but never in a row
        assert state.accept(token) and state.phase is GrammarPhase.REASONING
    assert state.accept(end[0]) and state.accept(end[1]) and state.phase is GrammarPhase.CONSTRAINED
    assert not state.accept(tok.encode("no", add_special_tokens=False)[0])  # the grammar now decides
    for token in yes:
        assert state.accept(token)
    assert state.accept(engine.model_config.eos_token_ids[0]) and state.terminated
    assert state.phase is GrammarPhase.DONE and not state.accept(yes[0])
    assert engine.grammars.state(StructuredOutput("choice", '["yes"]')).phase is GrammarPhase.CONSTRAINED


def test_a_reasoning_row_is_left_unmasked_beside_a_constrained_one(quiet_model):
    folder, _, tok = quiet_model
    engine = load_engine(folder, CONFIG)
    vocab = engine.model_config.vocab_size
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(0))
    spec = StructuredOutput("choice", '["yes","no"]')
    reasoning = engine.grammars.state(spec, (tok.convert_tokens_to_ids("</think>"),))
    rows = [
        SamplingRow(SamplingParams(temperature=0.0), [], [1], None, grammar=reasoning),
        SamplingRow(SamplingParams(temperature=0.0), [], [1], None, grammar=engine.grammars.state(spec)),
    ]
    tokens, _ = sample(logits.clone(), rows)
    assert tokens[0] == int(logits[0].argmax())
    allowed = {tok.encode(w, add_special_tokens=False)[0] for w in ("yes", "no")}
    assert tokens[1] in allowed and tokens[1] == max(allowed, key=lambda t: float(logits[1, t]))


@pytest.mark.slow  # three tiny models, each run whole, handed off and replayed
def test_whole_and_handed_off_replies_reason_freely_then_validate(model):
    folder, hf, tok = model
    prompt, params = prompt_ids(tok), params_for(tok)
    tokens, _, finish = run_whole(load_engine(folder, CONFIG), prompt, params)
    check_reply(tok, hf, tokens, finish)
    with worker_pair(folder, CONFIG) as (prefill, decode):
        # The prefill worker samples the first token (inside the reasoning, or </think> itself).
        handed, result, _, handed_finish = handoff(prefill, decode, "r0", prompt, params)
        assert handed == tokens and handed_finish == finish
        assert result.output.token_ids == tokens[:1]
        for w in (prefill, decode):
            assert w.engine.block_manager.num_free_blocks == w.engine.block_manager.num_blocks


@pytest.mark.slow  # three tiny models, each run whole, handed off and replayed
def test_a_migrated_reply_replays_into_the_same_phase_at_every_cut(model):
    """Cut the reply at every token (in the reasoning, right before and after </think>, inside the
    answer): the new engine, given prompt + head, goes on exactly as the whole run did."""
    folder, _, tok = model
    prompt, params = prompt_ids(tok), params_for(tok)
    engine = load_engine(folder, CONFIG)
    tokens, chars, finish = run_whole(engine, prompt, params)
    for cut in range(1, len(tokens)):
        rid = f"resumed-{cut}"
        engine.resume_request(prompt, params, rid, ResumeState(tuple(tokens[:cut]), chars[cut - 1]))
        rest, last = [], None
        while engine.has_unfinished_requests():
            for out in engine.step():
                rest += out.token_ids
                last = out.finish_reason if out.finished else last
        assert tokens[:cut] + rest == tokens and last == finish, cut


def test_compile_time_histogram_counts_by_hand():
    from common.protocol import COMPILE_SECONDS_BUCKETS
    from workers.engine.grammar import GrammarStats

    stats = GrammarStats()
    for seconds in (0.003, 0.02, 0.02, 20.0):  # 20 s: past the last bound, only in +Inf (compiles)
        stats.record_compile(seconds)
    counts = stats.counts()
    by_bound = dict(zip(COMPILE_SECONDS_BUCKETS, counts.compile_buckets))
    assert (by_bound[0.0025], by_bound[0.005], by_bound[0.01], by_bound[0.025], by_bound[10.0]) == (0, 1, 1, 3, 3)
    assert counts.compiles == 4 and counts.compile_seconds_sum == pytest.approx(20.043)
