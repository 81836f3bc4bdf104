"""Structured output, tool calls and reasoning through the router, over a FakeBackend that replies
a fixed text: which constraint reaches the workers, what is refused, and how replies are shaped."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from common.sampling_params import StructuredOutput
from router.app import build_app
from router.config import ServerConfig
from router.reasoning import ReasoningSplitter, grammar_start_token_ids, split_reasoning
from router.tool_parsers import ToolCallParser, default_parser, parse_calls
from testkit.backend import FakeBackend
from tests.router.conftest import MAX_MODEL_LEN, MODEL_NAME

USER = [{"role": "user", "content": "hi"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


def client_for(tokenizer, reply: str = "ok", **server) -> tuple[TestClient, FakeBackend]:
    backend = FakeBackend(tokenizer, reply=reply)
    app = build_app(backend, tokenizer, MODEL_NAME, MAX_MODEL_LEN, None, ServerConfig(**server))
    return TestClient(app, raise_server_exceptions=False), backend


def sse(response) -> list[dict]:
    return [
        json.loads(line[6:])
        for line in response.text.splitlines()
        if line.startswith("data: ") and line != "data: [DONE]"
    ]


@pytest.mark.parametrize(
    "path,body,kind,spec",
    [
        ("/v1/chat/completions", {"response_format": {"type": "json_object"}}, "json_object", ""),
        (
            "/v1/chat/completions",
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "p",
                        "schema": {"type": "object", "properties": {"a": {"type": "integer"}}},
                        "strict": True,
                    },
                }
            },
            "json_schema",
            '{"properties":{"a":{"type":"integer"}},"type":"object"}',
        ),
        ("/v1/completions", {"structured_outputs": {"regex": "[ab]+"}}, "regex", "[ab]+"),
        ("/v1/completions", {"structured_outputs": {"choice": ["yes", "no"]}}, "choice", '["yes","no"]'),
        (
            "/v1/chat/completions",
            {"structured_outputs": {"grammar": 'root ::= "x" tail\ntail ::= [0-9]+'}},
            "grammar",
            'root ::= "x" tail\ntail ::= [0-9]+',
        ),
        ("/v1/completions", {"guided_json": {"type": "string"}}, "json_schema", '{"type":"string"}'),
        ("/v1/completions", {"guided_choice": ["a"]}, "choice", '["a"]'),
        ("/v1/completions", {"guided_regex": "\\d+"}, "regex", "\\d+"),
        (
            "/v1/chat/completions",
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
            "json_schema",
            '{"properties":{"city":{"type":"string"}},"required":["city"],"type":"object"}',
        ),
    ],
)
def test_each_field_reaches_the_workers_as_one_spec(tokenizer, path, body, kind, spec):
    client, backend = client_for(tokenizer)
    base = {"messages": USER} if "chat" in path else {"prompt": "hi"}
    r = client.post(path, json={**base, **body, "max_tokens": 4})
    assert r.status_code == 200, r.text
    assert backend.requests[-1].sampling_params.structured_output == StructuredOutput(kind, spec)


def test_text_response_format_and_no_tools_leave_the_reply_free(tokenizer):
    client, backend = client_for(tokenizer)
    r = client.post("/v1/chat/completions", json={"messages": USER, "response_format": {"type": "text"}})
    assert r.status_code == 200 and backend.requests[-1].sampling_params.structured_output is None


@pytest.mark.parametrize(
    "body,param,words",
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frob"}}}},
            "response_format.json_schema.schema",
            "not a valid JSON schema",
        ),
        ({"response_format": {"type": "xml"}}, "response_format.type", "json_schema"),
        ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs.regex", "regular expression"),
        ({"structured_outputs": {"regex": "(?=a)b"}}, "structured_outputs.regex", "lookaround"),
        ({"structured_outputs": {"grammar": "root ::= item\n"}}, "structured_outputs.grammar", "item"),
        ({"structured_outputs": {"grammar": 'start ::= "a"'}}, "structured_outputs.grammar", "root"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "list"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
        ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
        ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex", "only one"),
        ({"tools": [{"type": "function", "function": {"parameters": {}}}]}, "tools[0].function.name", "name"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}]},
            "tools[0].function.parameters",
            "JSON schema",
        ),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "nope",
        ),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tools": [WEATHER], "tool_choice": "auto"}, "tool_choice", "--enable-auto-tool-choice"),
    ],
)
def test_bad_constraints_are_400_naming_the_field_and_reach_no_worker(tokenizer, body, param, words):
    client, backend = client_for(tokenizer)
    r = client.post("/v1/chat/completions", json={"messages": USER, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error
    assert backend.requests == []


def test_named_tool_choice_answers_a_tool_call_streamed_and_not(tokenizer):
    client, _ = client_for(tokenizer, reply='{"city": "Paris"}')
    body = {
        "messages": USER,
        "tools": [WEATHER, TIME],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
    }
    full = client.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert full["finish_reason"] == "tool_calls" and full["message"]["content"] is None
    (call,) = full["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'} and call["type"] == "function"
    chunks = sse(client.post("/v1/chat/completions", json={**body, "stream": True}))
    deltas = [d for c in chunks for d in c["choices"][0]["delta"].get("tool_calls", [])]
    assert deltas[0]["function"]["name"] == "get_weather" and deltas[0]["id"].startswith("call_")
    assert "".join(d["function"]["arguments"] for d in deltas) == '{"city": "Paris"}'
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_required_tool_choice_reads_the_forced_list(tokenizer):
    reply = '[{"name": "get_time", "parameters": {}}, {"name": "get_weather", "parameters": {"city": "Oslo"}}]'
    client, backend = client_for(tokenizer, reply=reply)
    r = client.post(
        "/v1/chat/completions",
        json={"messages": USER, "tools": [WEATHER, TIME], "tool_choice": "required", "parallel_tool_calls": False},
    )
    schema = json.loads(backend.requests[-1].sampling_params.structured_output.spec)
    assert schema["maxItems"] == 1 and schema["minItems"] == 1
    calls = r.json()["choices"][0]["message"]["tool_calls"]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_time", {}),
        ("get_weather", {"city": "Oslo"}),
    ]


def test_auto_tool_choice_parses_hermes_calls_and_streams_content_first(tokenizer):
    reply = 'Let me look.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    client, backend = client_for(tokenizer, reply=reply, enable_auto_tool_choice=True, tool_call_parser="hermes")
    body = {"messages": USER, "tools": [WEATHER]}
    message = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    assert message["content"] == "Let me look." and backend.requests[-1].sampling_params.structured_output is None
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"city": "Rome"}
    chunks = sse(client.post("/v1/chat/completions", json={**body, "stream": True}))
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert content == "Let me look."
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_tool_messages_round_trip_into_the_prompt(tokenizer):
    client, backend = client_for(tokenizer)
    messages = USER + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 24 C"},
    ]
    r = client.post("/v1/chat/completions", json={"messages": messages, "tools": [WEATHER]})
    assert r.status_code == 200, r.text
    assert "sunny, 24 C" in tokenizer.decode(backend.requests[-1].prompt_token_ids, skip_special_tokens=False)


def test_reasoning_content_full_and_streamed(tokenizer):
    client, _ = client_for(tokenizer, reply="<think>2 and 2 make 4</think>\n\nFour.", reasoning_parser="qwen3")
    message = client.post("/v1/chat/completions", json={"messages": USER}).json()["choices"][0]["message"]
    assert message["reasoning_content"] == "2 and 2 make 4" and message["content"] == "Four."
    chunks = sse(client.post("/v1/chat/completions", json={"messages": USER, "stream": True}))
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == "2 and 2 make 4"
    assert "".join(d.get("content") or "" for d in deltas) == "Four."


def test_reasoning_with_structured_output_holds_the_grammar_back_until_think_end(tokenizer):
    """The workers get the tokens of `</think>` (the grammar starts after them); the reply is split."""
    client, backend = client_for(tokenizer, reply='plan it</think>{"a": 1}', reasoning_parser="deepseek_r1")
    r = client.post("/v1/chat/completions", json={"messages": USER, "response_format": {"type": "json_object"}})
    assert r.status_code == 200, r.text
    params = backend.requests[-1].sampling_params
    assert params.structured_output == StructuredOutput("json_object")
    assert tokenizer.decode(list(params.reasoning_end_token_ids)) == "</think>"
    message = r.json()["choices"][0]["message"]
    assert (message["reasoning_content"], json.loads(message["content"])) == ("plan it", {"a": 1})
    # Without a reasoning parser the grammar applies from the first token.
    client, backend = client_for(tokenizer)
    client.post("/v1/chat/completions", json={"messages": USER, "response_format": {"type": "json_object"}})
    assert backend.requests[-1].sampling_params.reasoning_end_token_ids == ()


def test_a_prompt_that_closed_the_thinking_starts_the_grammar_at_once(tokenizer):
    """A template with thinking off writes `<think>\n\n</think>\n\n` itself: no `</think>` will follow."""
    closed = tokenizer.encode("<|im_start|>assistant\n<think>\n\n</think>\n\n", add_special_tokens=False)
    opened = tokenizer.encode("<|im_start|>assistant\n<think>\n", add_special_tokens=False)
    assert grammar_start_token_ids(tokenizer, closed) == ()
    assert tokenizer.decode(list(grammar_start_token_ids(tokenizer, opened))) == "</think>"


@pytest.mark.parametrize(
    "parser,text,reasoning,content",
    [
        ("deepseek_r1", "thinking hard</think>The answer.", "thinking hard", "The answer."),
        ("deepseek_r1", "<think>a</think>b", "a", "b"),
        ("deepseek_r1", "still thinking", "still thinking", ""),
        ("qwen3", "<think>x < y</think>yes", "x < y", "yes"),
        ("qwen3", "no thinking here", None, "no thinking here"),
    ],
)
def test_reasoning_split_is_the_same_at_every_split_point(parser, text, reasoning, content):
    assert split_reasoning(parser, text) == (reasoning, content)
    for cut in range(len(text) + 1):
        for second in range(cut, len(text) + 1):
            splitter = ReasoningSplitter(parser)
            parts = [
                splitter.feed(text[:cut]),
                splitter.feed(text[cut:second]),
                splitter.feed(text[second:], final=True),
            ]
            assert "".join(p[0] for p in parts) == (reasoning or "")
            assert "".join(p[1] for p in parts) == content


@pytest.mark.parametrize(
    "parser,text,content,calls",
    [
        (
            "hermes",
            'Sure.<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call><tool_call>{"name": "g", '
            '"arguments": {}}</tool_call>',
            "Sure.",
            [("f", {"x": 1}), ("g", {})],
        ),
        (
            "llama3_json",
            '{"name": "f", "parameters": {"x": 2}}; {"name": "g", "parameters": {}}',
            "",
            [("f", {"x": 2}), ("g", {})],
        ),
        ("llama3_json", '<|python_tag|>{"name": "f", "parameters": {}}', "", [("f", {})]),
        ("mistral", 'ok [TOOL_CALLS][{"name": "f", "arguments": {"y": "z"}}]', "ok", [("f", {"y": "z"})]),
        ("hermes", "no calls at all", "no calls at all", []),
        ("hermes", "<tool_call>{broken json</tool_call>", "<tool_call>{broken json</tool_call>", []),
    ],
)
def test_tool_call_parsers_whole_and_streamed(parser, text, content, calls):
    got_content, got = parse_calls(parser, text)
    assert (got_content, [(c.name, json.loads(c.arguments)) for c in got]) == (content, calls)
    for cut in range(len(text) + 1):
        stream = ToolCallParser(parser)
        sent = stream.feed(text[:cut]) + stream.feed(text[cut:])
        held, streamed_calls = stream.finish()
        assert [(c.name, json.loads(c.arguments)) for c in streamed_calls] == calls
        assert (sent + held).strip() == (content if calls else text).strip()


def test_default_parser_from_the_chat_template():
    assert default_parser("{% if tools %}<tool_call>{% endif %}") == "hermes"
    assert default_parser("[TOOL_CALLS]") == "mistral"
    assert default_parser("<|python_tag|>") == "llama3_json"
    assert default_parser("plain") is None


def test_the_workers_grammar_counts_are_exposed_per_worker(tokenizer):
    """A worker's GrammarCounts (as its heartbeat carries them) -> baton:structured_output_* series,
    read back with prometheus' own parser."""
    from dataclasses import replace

    from prometheus_client.parser import text_string_to_metric_families

    from common.protocol import COMPILE_SECONDS_BUCKETS, GrammarCounts

    client, backend = client_for(tokenizer)
    cumulative = tuple(0 if bound < 0.01 else 2 if bound < 1.0 else 3 for bound in COMPILE_SECONDS_BUCKETS)
    counts = GrammarCounts(
        cache_hits=7, cache_misses=4, compiles=4, compile_seconds_sum=12.5, compile_buckets=cumulative
    )
    real = backend.workers
    backend.workers = lambda: [replace(w, grammar=counts) if w.worker_id == "decode-0" else w for w in real()]
    families = {f.name: f for f in text_string_to_metric_families(client.get("/metrics").text)}
    series = {
        (s.name, s.labels["worker"], s.labels.get("le")): s.value
        for name in (
            "baton:structured_output_cache_hits",
            "baton:structured_output_cache_misses",
            "baton:structured_output_compile_seconds",
        )
        for s in families[name].samples
    }
    assert series[("baton:structured_output_cache_hits_total", "decode-0", None)] == 7
    assert series[("baton:structured_output_cache_misses_total", "decode-0", None)] == 4
    assert series[("baton:structured_output_cache_hits_total", "prefill-0", None)] == 0
    assert series[("baton:structured_output_compile_seconds_bucket", "decode-0", "0.005")] == 0
    assert series[("baton:structured_output_compile_seconds_bucket", "decode-0", "0.01")] == 2
    assert series[("baton:structured_output_compile_seconds_bucket", "decode-0", "+Inf")] == 4
    assert series[("baton:structured_output_compile_seconds_count", "decode-0", None)] == 4
    assert series[("baton:structured_output_compile_seconds_sum", "decode-0", None)] == 12.5


@pytest.mark.parametrize(
    "field,value",
    [
        ("guided_json", {"type": "object"}),
        ("structured_outputs", {"regex": "[a-z]+"}),
        ("tools", None),  # forced by tool_choice "required": blamed on the tools
    ],
)
def test_a_grammar_the_workers_refuse_is_400_naming_the_field(tokenizer, field, value):
    from common.protocol import GrammarCompileError

    class Refusing(FakeBackend):
        async def generate(self, request):
            raise GrammarCompileError("structured output (json_schema) does not compile: unsupported")
            yield  # an async generator, as the real backends are

    backend = Refusing(tokenizer)
    client = TestClient(
        build_app(backend, tokenizer, MODEL_NAME, MAX_MODEL_LEN, None, ServerConfig()), raise_server_exceptions=False
    )
    body = (
        {"messages": USER, field: value}
        if value is not None
        else {"messages": USER, "tools": [WEATHER], "tool_choice": "required"}
    )
    for stream in (False, True):
        r = client.post("/v1/chat/completions", json={**body, "stream": stream})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == field and "does not compile" in r.json()["error"]["message"]


def test_the_request_trace_names_the_constraint_kind(tokenizer):
    client, _ = client_for(tokenizer)
    free = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    bound = client.post(
        "/v1/completions", json={"prompt": "hi", "max_tokens": 2, "structured_outputs": {"regex": "[ab]+"}}
    )
    assert free.status_code == bound.status_code == 200
    recent = {r["request_id"]: r for r in client.get("/v1/status").json()["recent"]}
    kinds = [r["structured_output"] for r in recent.values()]
    assert sorted(kinds, key=str) == [None, "regex"], kinds
