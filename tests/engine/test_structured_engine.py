"""Structured output in the engine: the grammar's bitmask in the batched sampler, the first token
handed from a prefill worker to a decode worker, a migrated request's tokens replayed into a fresh
matcher, and compile errors. The oracle is jsonschema (and re.fullmatch) on the decoded text."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from bench.structured_load import PROMPTS, SCHEMAS
from common.protocol import ResumeState
from common.sampling_params import SamplingParams, StructuredOutput
from router.tokenizer import Tokenizer
from tests.engine.helpers import handoff, worker_pair
from workers.build import load_engine
from workers.config import EngineConfig
from workers.engine.llm_engine import LLMEngine
from workers.engine.sampler import SamplingRow, sample

pytestmark = pytest.mark.slow
CONFIG = EngineConfig(kv_cache_memory=48 << 20)


def schema_spec(name: str) -> StructuredOutput:
    return StructuredOutput("json_schema", json.dumps(SCHEMAS[name]))


@pytest.fixture(scope="module")
def tok(default_model_dir) -> Tokenizer:
    return Tokenizer.from_model_dir(default_model_dir)


@pytest.fixture(scope="module")
def engine(default_model_dir) -> LLMEngine:
    return load_engine(default_model_dir, CONFIG)


def chat(tok: Tokenizer, text: str) -> list[int]:
    return tok.encode(tok.render_chat([{"role": "user", "content": text}]), add_special_tokens=False)


def test_batched_schemas_greedy_and_sampled_all_validate(engine, tok):
    names = list(SCHEMAS) * 2
    params = [
        SamplingParams(max_tokens=96, temperature=0.0 if i < 5 else 0.9, seed=i, structured_output=schema_spec(n))
        for i, n in enumerate(names)
    ]
    # A free-running row in the same batch is left as it would be alone.
    free = SamplingParams(max_tokens=12, temperature=0.0)
    done = engine.generate([chat(tok, PROMPTS[n]) for n in names] + [chat(tok, "Say hi")], params + [free])
    for name, completion in zip(names, done):
        assert completion.finish_reason == "stop", completion
        jsonschema.validate(json.loads(completion.text), SCHEMAS[name])
    [alone] = engine.generate([chat(tok, "Say hi")], free)
    assert done[-1].token_ids == alone.token_ids


def test_regex_choice_grammar_and_json_mode(engine, tok):
    specs = [
        StructuredOutput("regex", r"[A-Z][a-z]{2,6} [0-9]{1,3}"),
        StructuredOutput("choice", '["yes","no","maybe"]'),
        StructuredOutput("grammar", 'root ::= "(" num ("," num)* ")"\nnum ::= [0-9]+'),
        StructuredOutput("json_object"),
    ]
    prompt = chat(tok, "Answer briefly: is the sky blue?")
    for seed in range(3):
        params = [SamplingParams(max_tokens=48, temperature=1.0, seed=seed, structured_output=s) for s in specs]
        regex, choice, grammar, json_mode = engine.generate([prompt] * 4, params)
        assert re.fullmatch(r"[A-Z][a-z]{2,6} [0-9]{1,3}", regex.text), regex.text
        assert choice.text in ("yes", "no", "maybe")
        assert re.fullmatch(r"\(\d+(,\d+)*\)", grammar.text), grammar.text
        if json_mode.finish_reason == "stop":
            assert isinstance(json.loads(json_mode.text), (dict, list))


def test_the_bitmask_leaves_unconstrained_rows_untouched_and_masks_the_others(engine):
    vocab = engine.model_config.vocab_size
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(0))
    grammar = engine.grammars.state(StructuredOutput("choice", '["yes","no"]'))
    rows = [
        SamplingRow(SamplingParams(temperature=0.0), [], [1], None),
        SamplingRow(SamplingParams(temperature=0.0), [], [1], None, grammar=grammar),
        SamplingRow(SamplingParams(temperature=0.0), [], [1], None),
    ]
    tokens, _ = sample(logits.clone(), rows)
    assert tokens[0] == int(logits[0].argmax()) and tokens[2] == int(logits[2].argmax())
    bitmask = torch.zeros(1, (vocab + 31) // 32, dtype=torch.int32)
    grammar.fill_bitmask(bitmask, 0)
    allowed = [t for t in range(vocab) if (int(bitmask[0, t // 32]) >> (t % 32)) & 1]
    assert tokens[1] == max(allowed, key=lambda t: float(logits[1, t]))


def test_a_resumed_request_replays_its_tokens_into_the_grammar(engine, tok):
    prompt, spec = chat(tok, PROMPTS["order"]), schema_spec("order")
    [whole] = engine.generate([prompt], SamplingParams(max_tokens=96, temperature=0.0, structured_output=spec))
    cut = len(whole.token_ids) // 2
    head = whole.token_ids[:cut]
    text = tok.decode(head)
    engine.resume_request(
        prompt,
        SamplingParams(max_tokens=96, temperature=0.0, structured_output=spec),
        "resumed",
        ResumeState(tuple(head), len(text)),
    )
    rest = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            rest += out.token_ids
    assert head + rest == whole.token_ids
    jsonschema.validate(json.loads(tok.decode(head + rest)), SCHEMAS["order"])
    bad = tok.encode("hello", add_special_tokens=False)  # not how any JSON object starts
    with pytest.raises(ValueError, match="not allowed by its structured output"):
        engine.resume_request(
            prompt, SamplingParams(max_tokens=96, structured_output=spec), "bad", ResumeState(tuple(bad), len("hello"))
        )
    assert "bad" not in engine.request_ids()


def test_bad_specs_are_refused_and_compiles_are_cached(engine, tok):
    for spec in (
        StructuredOutput("regex", "a(b"),
        StructuredOutput("grammar", "root ::= missing"),
        StructuredOutput("json_schema", '{"type": "frob"}'),
    ):
        with pytest.raises(ValueError, match="does not compile"):
            engine.add_request([1, 2, 3], SamplingParams(structured_output=spec))
    assert not engine.has_unfinished_requests()
    stats = engine.grammars.stats
    before = stats.cache_hits
    engine.grammars.state(schema_spec("flag"))
    engine.grammars.state(schema_spec("flag"))
    assert stats.cache_hits >= before + 1 and stats.compile_seconds


def test_prefill_workers_first_token_continues_under_the_grammar_on_the_decode_worker(default_model_dir, engine, tok):
    alone = engine  # the oracle: the same engine configuration, one process, no handoff
    with worker_pair(default_model_dir, CONFIG) as (prefill, decode):
        # Two schemas unlike each other (a pattern-constrained string; nested numbers): the grammar's
        # hand-over does not depend on the schema, test_batched_schemas_... covers all five.
        for i, name in enumerate(("order", "address")):
            params = SamplingParams(max_tokens=96, temperature=0.0, structured_output=schema_spec(name))
            prompt = chat(tok, PROMPTS[name])
            [want] = alone.generate([prompt], params)
            tokens, _, _, finish_reason = handoff(prefill, decode, f"r{i}", prompt, params)
            assert finish_reason == "stop"  # the grammar completed
            assert tokens == want.token_ids
            jsonschema.validate(json.loads(tok.decode(tokens)), SCHEMAS[name])


def test_the_tokenizer_info_is_cached_and_equals_a_fresh_one(default_model_dir, tmp_path, monkeypatch):
    import transformers
    import xgrammar as xgr

    from workers.engine.grammar import tokenizer_info

    monkeypatch.setenv("BATON_CACHE_DIR", str(tmp_path))
    config = json.loads((default_model_dir / "config.json").read_text())
    vocab_size, stops = config["vocab_size"], [config["eos_token_id"]]
    fresh = xgr.TokenizerInfo.from_huggingface(
        transformers.AutoTokenizer.from_pretrained(str(default_model_dir)), vocab_size=vocab_size, stop_token_ids=stops
    )
    first = tokenizer_info(default_model_dir, vocab_size, stops)
    assert len(list((tmp_path / "xgrammar").glob("tokenizer-info-*.json"))) == 1

    def no_tokenizer(*args, **kwargs):
        raise AssertionError("the cached tokenizer info was not used")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", no_tokenizer)
    cached = tokenizer_info(default_model_dir, vocab_size, stops)
    for info in (first, cached):
        assert (
            info.vocab_size,
            info.vocab_type,
            info.add_prefix_space,
            info.stop_token_ids,
            info.special_token_ids,
        ) == (fresh.vocab_size, fresh.vocab_type, fresh.add_prefix_space, fresh.stop_token_ids, fresh.special_token_ids)
        assert info.decoded_vocab == fresh.decoded_vocab
    # The same grammar compiled from either allows the same tokens at its start.
    masks = []
    for info in (fresh, cached):
        compiled = xgr.GrammarCompiler(info, max_threads=1).compile_json_schema(json.dumps(SCHEMAS["order"]))
        mask = xgr.allocate_token_bitmask(1, vocab_size)
        xgr.GrammarMatcher(compiled).fill_next_token_bitmask(mask)
        masks.append(mask)
    assert torch.equal(*masks)
    # Other stop tokens are another entry: built afresh, not read from this one.
    with pytest.raises(AssertionError, match="was not used"):
        tokenizer_info(default_model_dir, vocab_size, stops + [0])


def test_min_tokens_does_not_hold_a_complete_grammar_open(engine, tok):
    spec = StructuredOutput("choice", '["yes","no"]')
    [done] = engine.generate(
        [chat(tok, "Yes or no?")], SamplingParams(max_tokens=40, min_tokens=30, temperature=0.0, structured_output=spec)
    )
    assert done.text in ("yes", "no") and done.finish_reason == "stop"
