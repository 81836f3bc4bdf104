"""The engine side of a migration: `LLMEngine.resume_request` continues a request from its prompt
and the tokens a dead worker already produced, as if nothing had happened.

Oracle: the same engine's undisturbed greedy run of the same request (its per-step outputs). A
resumed run from any point must produce exactly the remaining tokens and text (no token or
character repeated or lost), count usage for the whole request, finish for the same reason, and
find a stop string that spans the seam.
"""

from __future__ import annotations

import pytest

from common.protocol import ResumeState
from common.sampling_params import SamplingParams
from tests.healing.helpers import session_oracle

pytestmark = pytest.mark.slow

QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "Why is the sky blue?"]


@pytest.fixture(scope="module")
def engine(request):
    """The engine alone (64 MiB of KV cache), the session's one (tests/healing/helpers.session_oracle)."""
    engine = session_oracle(request.config).engine
    assert not engine.has_unfinished_requests()
    return engine


def chat_ids(tokenizer, question: str) -> list[int]:
    text = tokenizer.render_chat([{"role": "user", "content": question}], add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def run_all(engine) -> dict[str, list]:
    """Step until every request finishes (batched, as a worker runs them); outputs by request id."""
    outs: dict[str, list] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    assert all(o[-1].finished for o in outs.values())
    return outs


def resume(engine, prompt, params, rid, outs, k):
    """Resume after the first k outputs (one token each) reached the client."""
    tokens = [t for o in outs[:k] for t in o.token_ids]
    chars = sum(len(o.text) for o in outs[:k])
    engine.resume_request(prompt, params, rid, ResumeState(tuple(tokens), chars))


def test_resumed_greedy_continuation_equals_the_undisturbed_run(engine, tokenizer):
    params = SamplingParams(max_tokens=20, temperature=0)
    prompts = [chat_ids(tokenizer, q) for q in QUESTIONS]
    for qi, prompt in enumerate(prompts):
        engine.add_request(prompt, params, f"u{qi}")
    first = run_all(engine)
    points = {}
    for qi, prompt in enumerate(prompts):
        outs = first[f"u{qi}"]
        assert len(outs) == sum(len(o.token_ids) for o in outs)  # one token per step: any k is reachable
        for k in sorted({1, 2, len(outs) // 2, len(outs) - 1}):
            resume(engine, prompt, params, f"r{qi}-{k}", outs, k)
            points[f"r{qi}-{k}"] = (outs, k)
    second = run_all(engine)
    for rid, (outs, k) in points.items():
        rest = second[rid]
        got_tokens = [t for o in outs[:k] for t in o.token_ids] + [t for o in rest for t in o.token_ids]
        got_text = "".join(o.text for o in outs[:k]) + "".join(o.text for o in rest)
        assert got_tokens == [t for o in outs for t in o.token_ids], rid
        assert got_text == "".join(o.text for o in outs), rid
        assert rest[-1].finish_reason == outs[-1].finish_reason
        assert rest[-1].num_output_tokens == outs[-1].num_output_tokens  # usage counts the whole request
        assert rest[-1].num_prompt_tokens == outs[-1].num_prompt_tokens
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_stop_string_across_the_seam_and_nothing_to_resume(engine, tokenizer):
    prompt = chat_ids(tokenizer, QUESTIONS[0])
    engine.add_request(prompt, SamplingParams(max_tokens=16, temperature=0), "plain")
    plain = run_all(engine)["plain"]
    texts = [o.text for o in plain]
    # A stop string made of the end of output 4's text and the start of output 6's: it spans the
    # outputs 4-6, so a resume after output 5 has part of it held back, unsent.
    start = sum(map(len, texts[:4])) + len(texts[4]) - 2
    full = "".join(texts)
    stop = full[start : start + 2 + len(texts[5]) + 2]
    assert len(stop) >= 4 and full.find(stop) == start
    params = SamplingParams(max_tokens=16, temperature=0, stop=[stop])
    engine.add_request(prompt, params, "stop-u")
    outs = run_all(engine)["stop-u"]
    assert outs[-1].finish_reason == "stop" and "".join(o.text for o in outs) == full[:start]
    for k in (4, 5, 6):
        resume(engine, prompt, params, f"stop-r{k}", outs, k)
    rest = run_all(engine)
    for k in (4, 5, 6):
        assert "".join(o.text for o in outs[:k]) + "".join(o.text for o in rest[f"stop-r{k}"]) == full[:start], k
        assert rest[f"stop-r{k}"][-1].finish_reason == "stop"

    with pytest.raises(ValueError, match="max_tokens"):
        engine.resume_request(prompt, SamplingParams(max_tokens=2, temperature=0), "done", ResumeState((1, 2), 0))
    with pytest.raises(ValueError, match="characters"):
        engine.resume_request(
            prompt,
            SamplingParams(max_tokens=24, temperature=0),
            "bad-chars",
            ResumeState(tuple(plain[0].token_ids), len(plain[0].text) + 3),
        )
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
