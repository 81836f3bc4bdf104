"""The HTTP API with FastAPI's TestClient over the in-process FakeBackend (testkit/backend.py).

The fake only plays a token script; the text comes from Baton's own detokenizer. So these tests
check Baton's behaviour against references computed here: the full decode of the tokens the
backend produced, the spec of stop strings (cut at the first match), and streamed == non-streamed.
"""

from __future__ import annotations

import json

import pytest

from common.detokenizer import IncrementalDetokenizer
from router.protocol import ChatCompletionChunk, ChatCompletionResponse, CompletionResponse, ModelList
from testkit.backend import FakeBackend

MODEL = "SmolLM2-135M-Instruct"
USER = [{"role": "user", "content": "What is the capital of France?"}]


def parse_sse(text: str) -> list:
    """SSE body -> list of decoded chunks, '[DONE]' kept as a string; every frame must be 'data: ...\\n\\n'."""
    assert text.endswith("\n\n")
    frames = text[:-2].split("\n\n")
    out = []
    for frame in frames:
        assert frame.startswith("data: "), frame
        payload = frame[len("data: ") :]
        out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def chat_text(frames: list) -> str:
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in frames if c != "[DONE]" and c["choices"])


def stopped_reference(tokenizer, ids: list[int], stops: list[str]) -> tuple[str, int]:
    """(text, tokens generated) for stop strings, from the spec: decode the growing output and
    cut at the first match; the request ends with the token that completes the match."""
    for n in range(1, len(ids) + 1):
        text = tokenizer.decode(ids[:n])
        hits = [text.find(s) for s in stops if s in text]
        if hits:
            return text[: min(hits)], n
    raise AssertionError(f"no stop string of {stops} in the reply")


def assert_error(r, status: int, param=None, type_=None, contains=None):
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == status
    assert err["param"] == param
    assert isinstance(err["message"], str) and err["message"]
    if type_:
        assert err["type"] == type_
    if contains:
        for piece in contains:
            assert piece in err["message"], err["message"]
    assert "Traceback" not in r.text
    return err


# ----------------------------------------------------------------------------- happy paths


def test_chat_completion(client, backend, tokenizer):
    r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": USER, "temperature": 0})
    assert r.status_code == 200
    body = r.json()
    ChatCompletionResponse.model_validate(body)
    assert body["id"].startswith("chatcmpl-") and len(body["id"]) == len("chatcmpl-") + 32
    assert body["object"] == "chat.completion" and body["model"] == MODEL
    choice = body["choices"][0]
    # The answer is exactly what the backend's tokens decode to (multi-byte characters included).
    assert choice["message"] == {"role": "assistant", "content": tokenizer.decode(backend.reply_ids)}
    assert choice["finish_reason"] == "stop" and choice["logprobs"] is None
    prompt_ids = tokenizer.apply_chat_template(USER)
    n_reply = len(backend.reply_ids)
    assert body["usage"] == {
        "prompt_tokens": len(prompt_ids),
        "completion_tokens": n_reply + 1,  # + EOS
        "total_tokens": len(prompt_ids) + n_reply + 1,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    # What reached the backend: the templated prompt, greedy, the rest of the context as max_tokens.
    sent = backend.requests[-1]
    assert sent.prompt_token_ids == prompt_ids and sent.request_id == body["id"]
    assert sent.sampling_params.temperature == 0.0
    assert sent.sampling_params.max_tokens == 8192 - len(prompt_ids)
    assert r.headers["x-request-id"] == body["id"]


def test_chat_stream_with_usage(client, tokenizer):
    full = client.post("/v1/chat/completions", json={"model": MODEL, "messages": USER}).json()
    r = client.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": USER, "stream": True, "stream_options": {"include_usage": True}},
    )
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    frames = parse_sse(r.text)
    assert frames[-1] == "[DONE]"
    chunks = frames[:-1]
    for c in chunks:
        ChatCompletionChunk.model_validate(c)
        assert c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] and "usage" in c
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] > 0
    assert all(c["usage"] is None for c in chunks[:-1])
    # Streamed and non-streamed answers agree, and no chunk carries half a character.
    assert chat_text(chunks) == full["choices"][0]["message"]["content"]
    assert all("\ufffd" not in (c["choices"][0]["delta"].get("content") or "") for c in chunks[:-1])
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    # the same counts, except that the second request found the first one's prompt cached
    assert {**usage_chunk["usage"], "prompt_tokens_details": None} == {**full["usage"], "prompt_tokens_details": None}
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-2])
    u = usage_chunk["usage"]
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
    assert u["prompt_tokens"] == len(tokenizer.apply_chat_template(USER))


def test_chat_stream_without_usage_has_no_usage_key(client):
    r = client.post("/v1/chat/completions", json={"messages": USER, "stream": True, "max_tokens": 3})
    frames = parse_sse(r.text)
    assert frames[-1] == "[DONE]"
    assert all("usage" not in c and c["choices"] for c in frames[:-1])
    assert frames[-2]["choices"][0]["finish_reason"] == "length"


def test_completion_non_stream_and_stream(client, backend, tokenizer):
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "Once upon a time"})
    assert r.status_code == 200
    body = r.json()
    CompletionResponse.model_validate(body)
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion"
    # OpenAI's and vLLM's default for /v1/completions: 16 tokens.
    assert body["usage"]["completion_tokens"] == 16 and body["choices"][0]["finish_reason"] == "length"
    assert backend.requests[-1].prompt_token_ids == tokenizer.encode("Once upon a time")

    full = client.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 100}).json()
    assert full["choices"][0]["text"] == tokenizer.decode(backend.reply_ids)
    r = client.post(
        "/v1/completions",
        json={"prompt": [1, 2, 3], "max_tokens": 100, "stream": True, "stream_options": {"include_usage": True}},
    )
    frames = parse_sse(r.text)
    assert frames[-1] == "[DONE]" and frames[-2]["choices"] == []
    assert frames[-2]["usage"]["prompt_tokens"] == 3 and frames[-2]["usage"] == full["usage"]  # no whole block to cache
    assert all(c["object"] == "text_completion" and c["usage"] is None for c in frames[:-2])
    assert "".join(c["choices"][0]["text"] for c in frames[:-2]) == full["choices"][0]["text"]
    assert frames[-3]["choices"][0]["finish_reason"] == "stop"
    assert backend.requests[-1].prompt_token_ids == [1, 2, 3]
    # a one-element batch is accepted
    assert client.post("/v1/completions", json={"prompt": ["hi"], "max_tokens": 2}).status_code == 200


STOP_REPLY = "The capital of France is Paris. Ça va? 🎉 Yes, thanks."


@pytest.mark.parametrize("stop", [["Paris"], ["Paris", "France"], "s. Ç", ["va? 🎉"], ["🎉", "Ça"]])
def test_stop_strings(make_client, tokenizer, stop):
    backend = FakeBackend(tokenizer, reply=STOP_REPLY)
    client = make_client(backend)
    stops = [stop] if isinstance(stop, str) else stop
    want_text, want_tokens = stopped_reference(tokenizer, backend.reply_ids, stops)
    body = {"messages": USER, "stop": stop, "max_tokens": 50}
    r = client.post("/v1/chat/completions", json=body).json()
    assert r["choices"][0]["message"]["content"] == want_text
    assert r["choices"][0]["finish_reason"] == "stop"
    assert r["usage"]["completion_tokens"] == want_tokens
    assert backend.requests[-1].sampling_params.stop == stops
    # Streamed: the same text, and each chunk is one delta of the engine's detokenizer: a possible
    # start of a stop string is held back, never sent and then taken back.
    frames = parse_sse(client.post("/v1/chat/completions", json={**body, "stream": True}).text)
    pieces = [c["choices"][0]["delta"]["content"] for c in frames[1:-1] if c["choices"][0]["delta"].get("content")]
    detok = IncrementalDetokenizer(tokenizer.decode, stops)
    reference = []
    for n in range(1, want_tokens + 1):
        detok.add(backend.reply_ids[:n])
        reference.append(detok.take(final=n == want_tokens))
    assert pieces == [p for p in reference if p]
    assert "".join(pieces) == want_text and frames[-2]["choices"][0]["finish_reason"] == "stop"


def test_stop_string_not_in_reply_and_stop_token_ids(client, backend, tokenizer):
    r = client.post("/v1/completions", json={"prompt": "x", "stop": ["zebra"], "max_tokens": 100}).json()
    assert r["choices"][0]["text"] == tokenizer.decode(backend.reply_ids) and r["choices"][0]["finish_reason"] == "stop"
    # a stop token ends the answer with that token
    r = client.post(
        "/v1/completions", json={"prompt": "x", "stop_token_ids": [backend.reply_ids[3]], "max_tokens": 100}
    )
    assert r.json()["choices"][0]["text"].startswith(tokenizer.decode(backend.reply_ids[:3]))
    assert r.json()["usage"]["completion_tokens"] == 4 and r.json()["choices"][0]["finish_reason"] == "stop"


def test_cached_tokens(client, backend):
    long_user = [{"role": "user", "content": "word " * 40}]
    r1 = client.post("/v1/chat/completions", json={"messages": long_user, "max_tokens": 5}).json()
    assert r1["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    r2 = client.post("/v1/chat/completions", json={"messages": long_user, "max_tokens": 5}).json()
    # The same prompt again: every whole block is cached, except that the last prompt token is
    # always computed.
    n = r2["usage"]["prompt_tokens"]
    assert r2["usage"]["prompt_tokens_details"]["cached_tokens"] == (n - 1) // 16 * 16 > 0


def test_chat_logprobs(client, tokenizer):
    r = client.post(
        "/v1/chat/completions", json={"messages": USER, "max_tokens": 4, "logprobs": True, "top_logprobs": 3}
    )
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert len(content) == 4
    for entry in content:
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
        assert bytes(entry["bytes"]).decode() == entry["token"]
        assert len(entry["top_logprobs"]) == 3
        assert entry["top_logprobs"][0]["token"] == entry["token"]
        assert all(set(t) == {"token", "logprob", "bytes"} for t in entry["top_logprobs"])
    assert "".join(e["token"] for e in content) == r.json()["choices"][0]["message"]["content"]
    # streamed: each content chunk carries its token's logprobs
    r = client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 4, "logprobs": True, "stream": True})
    chunks = [c for c in parse_sse(r.text)[1:-1]]
    assert [len(c["choices"][0]["logprobs"]["content"]) for c in chunks] == [1, 1, 1, 1]
    assert all(c["choices"][0]["logprobs"]["content"][0]["top_logprobs"] == [] for c in chunks)


def test_completion_logprobs(client):
    r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 5, "logprobs": 2})
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == 5
    assert "".join(lp["tokens"]) == choice["text"]
    assert all(choice["text"].startswith(t, off) for t, off in zip(lp["tokens"], lp["text_offset"]))
    assert all(len(t) == 2 for t in lp["top_logprobs"])
    r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 5, "logprobs": 0, "stream": True})
    offsets = [c["choices"][0]["logprobs"]["text_offset"][0] for c in parse_sse(r.text)[:-1]]
    assert offsets == sorted(offsets) and offsets[0] == 0 and len(set(offsets)) == 5


def test_models_health_version(client):
    models = client.get("/v1/models").json()
    ModelList.model_validate(models)
    assert models["object"] == "list"
    (card,) = models["data"]
    assert card["id"] == MODEL and card["object"] == "model" and card["owned_by"] == "baton"
    assert card["max_model_len"] == 8192 and isinstance(card["created"], int)
    assert client.get("/health").status_code == 200
    assert isinstance(client.get("/version").json()["version"], str)


@pytest.mark.parametrize(
    "dead, missing",
    [({"prefill-0"}, ["prefill"]), ({"decode-0"}, ["decode"]), ({"prefill-0", "decode-0"}, ["prefill", "decode"])],
)
def test_health_503_names_the_missing_pool(make_client, tokenizer, dead, missing):
    client = make_client(FakeBackend(tokenizer, dead=set(dead)))
    r = client.get("/health")
    assert r.status_code == 503
    assert r.json()["missing_pools"] == missing
    assert all(pool in r.json()["message"] for pool in missing)


def test_tokenize_detokenize(client, tokenizer):
    r = client.post("/tokenize", json={"model": MODEL, "prompt": "Hello world"})
    assert r.json() == {"count": 2, "max_model_len": 8192, "tokens": tokenizer.encode("Hello world")}
    r = client.post("/tokenize", json={"messages": USER})
    assert r.json()["tokens"] == tokenizer.apply_chat_template(USER)
    assert r.json()["count"] == len(r.json()["tokens"])
    r = client.post("/detokenize", json={"tokens": tokenizer.encode("Hello world")})
    assert r.json() == {"prompt": "Hello world"}
    assert_error(client.post("/detokenize", json={"tokens": [10**9]}), 400, "tokens")
    assert_error(client.post("/tokenize", json={}), 400, "prompt")
    assert_error(client.post("/tokenize", json={"prompt": "x", "model": "nope"}), 404, "model")


def test_round_robin_through_the_api(make_client, tokenizer):
    backend = FakeBackend(tokenizer, num_prefill=2, num_decode=2)
    client = make_client(backend)
    for _ in range(4):
        assert client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}).status_code == 200
    routes = [(r.route.prefill_worker, r.route.decode_worker) for r in backend.requests]
    assert routes == [("prefill-0", "decode-0"), ("prefill-1", "decode-1")] * 2


# ----------------------------------------------------------------------------- errors


def test_malformed_json(client):
    for path in ("/v1/chat/completions", "/v1/completions", "/tokenize"):
        assert_error(
            client.post(path, content=b"{not json", headers={"content-type": "application/json"}),
            400,
            None,
            "BadRequestError",
            ["JSON"],
        )
    assert_error(client.post("/v1/completions", json=[1, 2]), 400, None, contains=["JSON object"])


@pytest.mark.parametrize(
    "body, param",
    [
        ({}, "messages"),
        ({"messages": "hello"}, "messages"),
        ({"messages": USER, "temperature": "hot"}, "temperature"),
        ({"messages": USER, "max_tokens": "ten"}, "max_tokens"),
        ({"messages": USER, "stream": "yes"}, "stream"),
        ({"messages": USER, "stop": 5}, "stop"),
        ({"messages": [{"role": "user"}]}, "messages[0].content"),
        ({"messages": [{"content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ({"messages": USER + [{"role": "function", "content": "x"}]}, "messages[1].role"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}]},
            "messages[0].content[0]",
        ),
    ],
)
def test_chat_schema_errors_are_400_with_param(client, body, param):
    assert_error(client.post("/v1/chat/completions", json=body), 400, param, "BadRequestError")


@pytest.mark.parametrize(
    "body, param",
    [
        ({}, "prompt"),
        ({"prompt": {"a": 1}}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": ["a", ""]}, "prompt"),  # a batch with an empty prompt
        ({"prompt": [[1, 2], [10**9]]}, "prompt"),  # a batch with an id outside the vocabulary
        ({"prompt": [1, 10**9]}, "prompt"),
        ({"prompt": "x", "logprobs": 21}, "logprobs"),
        ({"prompt": "x", "echo": True}, "echo"),
        ({"prompt": "x", "best_of": 3}, "best_of"),
    ],
)
def test_completion_schema_errors_are_400_with_param(client, body, param):
    assert_error(client.post("/v1/completions", json=body), 400, param)


def test_empty_messages(client):
    assert_error(client.post("/v1/chat/completions", json={"messages": []}), 400, "messages", contains=["empty"])


def test_unknown_model_is_404(client):
    err = assert_error(
        client.post("/v1/chat/completions", json={"model": "gpt-9", "messages": USER}),
        404,
        "model",
        "NotFoundError",
        ["gpt-9"],
    )
    assert MODEL in err["message"]
    assert_error(client.post("/v1/completions", json={"model": "gpt-9", "prompt": "x"}), 404, "model")


@pytest.mark.parametrize(
    "field, value, param",
    [
        ("temperature", -0.5, "temperature"),
        ("temperature", 101, "temperature"),
        ("top_p", 0, "top_p"),
        ("top_p", 1.5, "top_p"),
        ("top_k", -3, "top_k"),
        ("min_p", 1.5, "min_p"),
        ("presence_penalty", 2.5, "presence_penalty"),
        ("frequency_penalty", -2.5, "frequency_penalty"),
        ("repetition_penalty", 0, "repetition_penalty"),
        ("top_logprobs", 30, "top_logprobs"),
        ("max_tokens", 0, "max_tokens"),
        ("max_completion_tokens", -1, "max_completion_tokens"),
        ("min_tokens", 100, "min_tokens"),
        ("stop_token_ids", [-1], "stop_token_ids[0]"),
    ],
)
def test_out_of_range_sampling_values(client, field, value, param):
    body = {"messages": USER, "max_tokens": 10, "logprobs": True, field: value}
    if field == "max_completion_tokens":
        body.pop("max_tokens")
    assert_error(client.post("/v1/chat/completions", json=body), 400, param, contains=[param])


def test_choices_over_the_limit_are_refused(client):
    assert_error(
        client.post("/v1/chat/completions", json={"messages": USER, "n": 17}), 400, "n", contains=["max_choices"]
    )
    assert_error(
        client.post("/v1/completions", json={"prompt": ["x"] * 9, "n": 2}),
        400,
        "prompt",
        contains=["9 prompts", "18 choices"],
    )
    assert_error(client.post("/v1/chat/completions", json={"messages": USER, "n": 0}), 400, "n")
    assert client.post("/v1/chat/completions", json={"messages": USER, "n": 16, "max_tokens": 1}).status_code == 200


def test_context_length_errors_state_both_numbers(make_client, tokenizer):
    client = make_client(max_model_len=64)
    n_prompt = len(tokenizer.apply_chat_template(USER))
    assert_error(
        client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 60}),
        400,
        "max_tokens",
        contains=["64", str(n_prompt + 60), str(n_prompt), "60"],
    )
    assert_error(
        client.post("/v1/chat/completions", json={"messages": USER, "max_completion_tokens": 60}),
        400,
        "max_completion_tokens",
        contains=["64", str(n_prompt + 60)],
    )
    long = [{"role": "user", "content": "word " * 100}]
    assert_error(client.post("/v1/chat/completions", json={"messages": long}), 400, "messages", contains=["64"])
    assert_error(
        client.post("/v1/completions", json={"prompt": list(range(10, 80))}), 400, "prompt", contains=["64", "70"]
    )
    # Omitted max_tokens: whatever is left of the context (chat), min(16, left) (completions).
    backend = FakeBackend(tokenizer, reply="a " * 200)
    client = make_client(backend, max_model_len=64)
    r = client.post("/v1/chat/completions", json={"messages": USER})
    assert r.status_code == 200 and backend.requests[-1].sampling_params.max_tokens == 64 - n_prompt
    assert r.json()["usage"]["total_tokens"] == 64
    assert client.post("/v1/completions", json={"prompt": list(range(10, 60))}).status_code == 200
    assert backend.requests[-1].sampling_params.max_tokens == 14
    # exactly at the limit is fine
    assert client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 64 - n_prompt}).status_code == 200


def test_stream_options_without_stream(client):
    assert_error(
        client.post("/v1/chat/completions", json={"messages": USER, "stream_options": {"include_usage": True}}),
        400,
        "stream_options",
    )


@pytest.mark.parametrize("dead, pool", [({"prefill-0"}, "prefill"), ({"decode-0"}, "decode")])
def test_dead_pool_is_503_with_retry_after(make_client, tokenizer, dead, pool):
    backend = FakeBackend(tokenizer, dead=set(dead))
    client = make_client(backend)
    for stream in (False, True):
        r = client.post("/v1/chat/completions", json={"messages": USER, "stream": stream})
        assert_error(r, 503, None, "ServiceUnavailableError", [pool])
        assert int(r.headers["retry-after"]) >= 1
    assert backend.requests == []


def test_backend_failure_is_500_without_traceback(make_client, tokenizer):
    backend = FakeBackend(tokenizer, fail_after=0, fail_message="kaboom in worker")
    client = make_client(backend)
    for path, body in (("/v1/chat/completions", {"messages": USER}), ("/v1/completions", {"prompt": "x"})):
        for stream in (False, True):
            r = client.post(path, json={**body, "stream": stream})
            assert_error(r, 500, None, "InternalServerError")
    assert len(backend.aborted) == 4


def test_unexpected_exception_is_500_envelope(make_client, tokenizer):
    class Broken(FakeBackend):
        def workers(self):
            raise KeyError("secret internals")

    client = make_client(Broken(tokenizer))
    r = client.post("/v1/chat/completions", json={"messages": USER})
    err = assert_error(r, 500, None, "InternalServerError")
    assert "secret" not in err["message"]
    assert client.get("/health").status_code == 500


def test_failure_mid_stream_sends_error_frame_then_done(make_client, tokenizer):
    backend = FakeBackend(tokenizer, fail_after=3)
    client = make_client(backend)
    r = client.post("/v1/chat/completions", json={"messages": USER, "stream": True})
    assert r.status_code == 200
    frames = parse_sse(r.text)
    assert frames[-1] == "[DONE]"
    assert frames[-2]["error"]["code"] == 500 and set(frames[-2]["error"]) == {"message", "type", "param", "code"}
    assert len(backend.aborted) == 1


def test_unknown_route_and_method(client):
    assert_error(client.get("/v1/nothing"), 404, None)
    assert_error(client.get("/v1/chat/completions"), 405, None)


def test_continuous_usage_stats(client):
    r = client.post(
        "/v1/chat/completions",
        json={
            "messages": USER,
            "stream": True,
            "max_tokens": 3,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        },
    )
    chunks = parse_sse(r.text)[:-1]
    assert [c["usage"]["completion_tokens"] for c in chunks[1:-1]] == [1, 2, 3]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3


def test_developer_and_tool_roles_and_text_parts(client, backend, tokenizer):
    messages = [
        {"role": "developer", "content": "Be terse."},
        {"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]},
    ]
    r = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2})
    assert r.status_code == 200
    expected = tokenizer.apply_chat_template([messages[0], {"role": "user", "content": "Hello\nthere"}])
    assert backend.requests[-1].prompt_token_ids == expected
