"""A corpus of bad requests over every endpoint, each with the answer it must get.

Used against the router over a FakeBackend (tests/router/test_router_corpus.py, fast) and against a
real deployment (tests/hardening/test_corpus.py). Every case names the HTTP status, the envelope's
`param` (the field at fault; None where no field is) and words the message must hold (the limit).
Requests carry the server's API key unless the case is about the key.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

API_KEY = "corpus-key-5f1d0c"  # the key the corpus servers are started with
MAX_REQUEST_BODY = 64 * 1024  # the corpus servers' limits (small, so oversize cases stay cheap)
VOCAB_SIZE = 49152  # SmolLM2's
USER = [{"role": "user", "content": "Hello"}]


@dataclass(frozen=True)
class BadRequest:
    name: str
    method: str
    path: str
    body: Any = None  # JSON body (sent with content-type application/json)
    raw: bytes | None = None  # or raw bytes, sent with `headers`
    headers: dict[str, str] = field(default_factory=dict)
    status: int = 400
    param: str | None = None
    param_prefix: bool = False  # param must start with `param` (a deep path)
    contains: tuple[str, ...] = ()
    auth: str | None = API_KEY  # the bearer key to send (None: no Authorization header)


def nested(depth: int) -> Any:
    value: Any = "leaf"
    for _ in range(depth):
        value = {"a": value}
    return value


def corpus(max_model_len: int) -> list[BadRequest]:
    chat, comp = "/v1/chat/completions", "/v1/completions"
    json_type = {"content-type": "application/json"}
    long_prompt = "word " * (max_model_len + 10)
    cases = [
        # -- the body itself
        BadRequest("malformed json", "POST", chat, raw=b"{not json", headers=json_type, contains=("JSON",)),
        BadRequest("body is an array", "POST", chat, body=[1, 2], contains=("JSON object",)),
        BadRequest(
            "wrong content type",
            "POST",
            chat,
            raw=json.dumps({"messages": USER}).encode(),
            headers={"content-type": "text/plain"},
            contains=("Content-Type", "application/json"),
        ),
        BadRequest(
            "form content type",
            "POST",
            comp,
            raw=b"prompt=hi",
            headers={"content-type": "application/x-www-form-urlencoded"},
            contains=("Content-Type",),
        ),
        BadRequest(
            "latin-1 charset",
            "POST",
            chat,
            raw=json.dumps({"messages": USER}).encode(),
            headers={"content-type": "application/json; charset=latin-1"},
            contains=("UTF-8",),
        ),
        BadRequest(
            "invalid utf-8",
            "POST",
            chat,
            raw=b'{"messages":[{"role":"user","content":"caf\xe9"}]}',
            headers=json_type,
            contains=("UTF-8",),
        ),
        BadRequest(
            "body over the limit",
            "POST",
            chat,
            body={"messages": [{"role": "user", "content": "x" * (MAX_REQUEST_BODY + 1)}]},
            contains=("max_request_body", str(MAX_REQUEST_BODY)),
        ),
        BadRequest(
            "nesting too deep",
            "POST",
            chat,
            body={"messages": USER, "tools": [nested(80)]},
            param="tools[0].a",
            param_prefix=True,
            contains=("max_json_depth", "64"),
        ),
        BadRequest(
            "nesting past the parser",
            "POST",
            comp,
            raw=b'{"prompt":' + b"[" * 3000 + b"]" * 3000 + b"}",
            headers=json_type,
            contains=("max_json_depth",),
        ),
        BadRequest(
            "NaN temperature",
            "POST",
            chat,
            raw=b'{"messages":[{"role":"user","content":"hi"}],"temperature":NaN}',
            headers=json_type,
            param="temperature",
            contains=("NaN", "finite"),
        ),
        BadRequest(
            "overflowing top_p",
            "POST",
            chat,
            raw=b'{"messages":[{"role":"user","content":"hi"}],"top_p":1e999}',
            headers=json_type,
            param="top_p",
            contains=("finite",),
        ),
        BadRequest(
            "-Infinity penalty",
            "POST",
            comp,
            raw=b'{"prompt":"hi","frequency_penalty":-Infinity}',
            headers=json_type,
            param="frequency_penalty",
            contains=("finite",),
        ),
        BadRequest(
            "lone surrogate",
            "POST",
            chat,
            raw=b'{"messages":[{"role":"user","content":"a\\ud800b"}]}',
            headers=json_type,
            param="messages[0].content",
            contains=("surrogate",),
        ),
        BadRequest(
            "integer of 5000 digits",
            "POST",
            comp,
            raw=b'{"prompt":"hi","seed":' + b"7" * 5000 + b"}",
            headers=json_type,
            contains=("digits",),
        ),
        # -- chat messages
        BadRequest("no messages", "POST", chat, body={}, param="messages"),
        BadRequest("empty messages", "POST", chat, body={"messages": []}, param="messages", contains=("empty",)),
        BadRequest("messages not a list", "POST", chat, body={"messages": "hello"}, param="messages"),
        BadRequest(
            "unknown role",
            "POST",
            chat,
            body={"messages": [{"role": "wizard", "content": "x"}]},
            param="messages[0].role",
        ),
        BadRequest(
            "user without content", "POST", chat, body={"messages": [{"role": "user"}]}, param="messages[0].content"
        ),
        BadRequest(
            "image part",
            "POST",
            chat,
            body={
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}],
                    }
                ]
            },
            param="messages[0].content[0]",
            contains=("text-only",),
        ),
        BadRequest(
            "audio part",
            "POST",
            chat,
            body={
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}],
                    }
                ]
            },
            param="messages[0].content[0]",
            contains=("text-only",),
        ),
        BadRequest(
            "unknown model",
            "POST",
            chat,
            body={"model": "gpt-9", "messages": USER},
            status=404,
            param="model",
            contains=("gpt-9",),
        ),
        BadRequest(
            "prompt over the context",
            "POST",
            chat,
            body={"messages": [{"role": "user", "content": long_prompt}]},
            param="messages",
            contains=(str(max_model_len),),
        ),
        # -- sampling fields out of OpenAI's ranges
        BadRequest(
            "n over max_choices",
            "POST",
            chat,
            body={"messages": USER, "n": 17},
            param="n",
            contains=("max_choices", "16"),
        ),
        BadRequest(
            "temperature 2.5",
            "POST",
            chat,
            body={"messages": USER, "temperature": 2.5},
            param="temperature",
            contains=("2",),
        ),
        BadRequest(
            "temperature a word", "POST", chat, body={"messages": USER, "temperature": "hot"}, param="temperature"
        ),
        BadRequest("top_p 0", "POST", chat, body={"messages": USER, "top_p": 0}, param="top_p"),
        BadRequest(
            "presence_penalty 3",
            "POST",
            chat,
            body={"messages": USER, "presence_penalty": 3},
            param="presence_penalty",
            contains=("2",),
        ),
        BadRequest(
            "frequency_penalty -2.5",
            "POST",
            comp,
            body={"prompt": "hi", "frequency_penalty": -2.5},
            param="frequency_penalty",
        ),
        BadRequest(
            "repetition_penalty 0",
            "POST",
            chat,
            body={"messages": USER, "repetition_penalty": 0},
            param="repetition_penalty",
        ),
        BadRequest("top_k -5", "POST", chat, body={"messages": USER, "top_k": -5}, param="top_k"),
        BadRequest("min_p 1.5", "POST", chat, body={"messages": USER, "min_p": 1.5}, param="min_p"),
        BadRequest("seed over 64 bits", "POST", chat, body={"messages": USER, "seed": 2**64}, param="seed"),
        BadRequest("max_tokens 0", "POST", chat, body={"messages": USER, "max_tokens": 0}, param="max_tokens"),
        BadRequest("max_tokens a word", "POST", chat, body={"messages": USER, "max_tokens": "ten"}, param="max_tokens"),
        BadRequest(
            "max_tokens past the context",
            "POST",
            chat,
            body={"messages": USER, "max_tokens": max_model_len},
            param="max_tokens",
            contains=(str(max_model_len),),
        ),
        BadRequest(
            "max_completion_tokens -1",
            "POST",
            chat,
            body={"messages": USER, "max_completion_tokens": -1},
            param="max_completion_tokens",
        ),
        BadRequest(
            "min_tokens over max_tokens",
            "POST",
            chat,
            body={"messages": USER, "max_tokens": 4, "min_tokens": 9},
            param="min_tokens",
        ),
        BadRequest("stream a string", "POST", chat, body={"messages": USER, "stream": "yes"}, param="stream"),
        BadRequest(
            "stream_options without stream",
            "POST",
            chat,
            body={"messages": USER, "stream_options": {"include_usage": True}},
            param="stream_options",
        ),
        # -- stop, logprobs, logit_bias limits
        BadRequest(
            "17 stop strings",
            "POST",
            chat,
            body={"messages": USER, "stop": [f"s{i}" for i in range(17)]},
            param="stop",
            contains=("max_stop_sequences", "16"),
        ),
        BadRequest(
            "stop string too long",
            "POST",
            comp,
            body={"prompt": "hi", "stop": "x" * 300},
            param="stop",
            contains=("max_stop_length", "256"),
        ),
        BadRequest("stop a number", "POST", chat, body={"messages": USER, "stop": 5}, param="stop"),
        BadRequest("empty stop string", "POST", chat, body={"messages": USER, "stop": [""]}, param="stop"),
        BadRequest(
            "stop token outside the vocabulary",
            "POST",
            chat,
            body={"messages": USER, "stop_token_ids": [VOCAB_SIZE]},
            param="stop_token_ids",
            contains=(str(VOCAB_SIZE),),
        ),
        BadRequest(
            "17 stop token ids",
            "POST",
            comp,
            body={"prompt": "hi", "stop_token_ids": list(range(17))},
            param="stop_token_ids",
            contains=("max_stop_sequences",),
        ),
        BadRequest(
            "top_logprobs 21",
            "POST",
            chat,
            body={"messages": USER, "logprobs": True, "top_logprobs": 21},
            param="top_logprobs",
            contains=("20",),
        ),
        BadRequest(
            "top_logprobs without logprobs",
            "POST",
            chat,
            body={"messages": USER, "top_logprobs": 2},
            param="top_logprobs",
        ),
        BadRequest("completion logprobs 21", "POST", comp, body={"prompt": "hi", "logprobs": 21}, param="logprobs"),
        BadRequest(
            "logit_bias of 301 entries",
            "POST",
            chat,
            body={"messages": USER, "logit_bias": {str(i): 1 for i in range(301)}},
            param="logit_bias",
            contains=("300",),
        ),
        BadRequest(
            "logit_bias token outside the vocabulary",
            "POST",
            chat,
            body={"messages": USER, "logit_bias": {str(VOCAB_SIZE + 1): 1}},
            param="logit_bias",
            contains=(str(VOCAB_SIZE),),
        ),
        BadRequest(
            "logit_bias key not a token id",
            "POST",
            comp,
            body={"prompt": "hi", "logit_bias": {"hello": 1}},
            param="logit_bias",
        ),
        BadRequest(
            "logit_bias value 150",
            "POST",
            chat,
            body={"messages": USER, "logit_bias": {"42": 150}},
            param="logit_bias",
            contains=("100",),
        ),
        BadRequest(
            "logit_bias well formed",
            "POST",
            chat,
            body={"messages": USER, "logit_bias": {"42": 5}},
            param="logit_bias",
            contains=("not supported",),
        ),
        # -- fields Baton cannot honour, named
        BadRequest("functions", "POST", chat, body={"messages": USER, "functions": [{"name": "f"}]}, param="functions"),
        BadRequest(
            "audio output",
            "POST",
            chat,
            body={"messages": USER, "audio": {"voice": "alloy", "format": "wav"}},
            param="audio",
        ),
        BadRequest(
            "suffix",
            "POST",
            comp,
            body={"prompt": "def f(", "suffix": "return 1"},
            param="suffix",
            contains=("not supported",),
        ),
        BadRequest("echo", "POST", comp, body={"prompt": "hi", "echo": True}, param="echo"),
        BadRequest("best_of 3", "POST", comp, body={"prompt": "hi", "best_of": 3}, param="best_of"),
        # -- structured output and tools (router.structured): refused before any worker holds anything
        BadRequest(
            "json schema of an unknown type",
            "POST",
            chat,
            body={
                "messages": USER,
                "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frob"}}},
            },
            param="response_format.json_schema.schema",
            contains=("not a valid JSON schema",),
        ),
        BadRequest(
            "json schema with a bad minimum",
            "POST",
            chat,
            body={
                "messages": USER,
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "integer", "minimum": "0"}},
                },
            },
            param="response_format.json_schema.schema",
            contains=("minimum",),
        ),
        BadRequest(
            "json_schema without a schema",
            "POST",
            chat,
            body={"messages": USER, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            param="response_format.json_schema",
        ),
        BadRequest(
            "json_schema name with spaces",
            "POST",
            chat,
            body={
                "messages": USER,
                "response_format": {"type": "json_schema", "json_schema": {"name": "my schema", "schema": {}}},
            },
            param="response_format.json_schema.name",
        ),
        BadRequest(
            "response_format of an unknown type",
            "POST",
            chat,
            body={"messages": USER, "response_format": {"type": "xml"}},
            param="response_format.type",
        ),
        BadRequest(
            "response_format a string",
            "POST",
            comp,
            body={"prompt": "hi", "response_format": "json"},
            param="response_format",
        ),
        BadRequest(
            "guided_json not JSON",
            "POST",
            comp,
            body={"prompt": "hi", "guided_json": "{oops"},
            param="guided_json",
            contains=("not valid JSON",),
        ),
        BadRequest(
            "guided_regex unclosed",
            "POST",
            comp,
            body={"prompt": "hi", "guided_regex": "a(b"},
            param="guided_regex",
            contains=("regular expression",),
        ),
        BadRequest(
            "regex with lookahead",
            "POST",
            comp,
            body={"prompt": "hi", "structured_outputs": {"regex": "(?=x)x"}},
            param="structured_outputs.regex",
            contains=("lookaround",),
        ),
        BadRequest(
            "empty guided_choice", "POST", comp, body={"prompt": "hi", "guided_choice": []}, param="guided_choice"
        ),
        BadRequest(
            "grammar without root",
            "POST",
            comp,
            body={"prompt": "hi", "guided_grammar": 'start ::= "a"'},
            param="guided_grammar",
            contains=("root",),
        ),
        BadRequest(
            "grammar with an undefined rule",
            "POST",
            chat,
            body={"messages": USER, "structured_outputs": {"grammar": "root ::= item+"}},
            param="structured_outputs.grammar",
            contains=("item",),
        ),
        BadRequest(
            "two structured outputs at once",
            "POST",
            chat,
            body={"messages": USER, "response_format": {"type": "json_object"}, "guided_regex": "a+"},
            param="guided_regex",
            contains=("only one",),
        ),
        BadRequest(
            "structured_outputs with two kinds",
            "POST",
            comp,
            body={"prompt": "hi", "structured_outputs": {"regex": "a", "choice": ["b"]}},
            param="structured_outputs",
            contains=("exactly one",),
        ),
        BadRequest(
            "guided_json a number",
            "POST",
            chat,
            body={"messages": USER, "guided_json": 5},
            param="guided_json",
            contains=("JSON schema object",),
        ),
        BadRequest(
            "tool without a name",
            "POST",
            chat,
            body={"messages": USER, "tools": [{"type": "function", "function": {"parameters": {"type": "object"}}}]},
            param="tools[0].function.name",
        ),
        BadRequest(
            "tool with bad parameters",
            "POST",
            chat,
            body={
                "messages": USER,
                "tools": [
                    {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "required": "x"}}}
                ],
            },
            param="tools[0].function.parameters",
        ),
        BadRequest(
            "tool parameters not an object",
            "POST",
            chat,
            body={
                "messages": USER,
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}],
            },
            param="tools[0].function.parameters",
            contains=("object",),
        ),
        BadRequest(
            "tool of another type",
            "POST",
            chat,
            body={"messages": USER, "tools": [{"type": "retrieval"}]},
            param="tools[0]",
        ),
        BadRequest(
            "two tools of one name",
            "POST",
            chat,
            body={
                "messages": USER,
                "tools": [
                    {"type": "function", "function": {"name": "f"}},
                    {"type": "function", "function": {"name": "f"}},
                ],
            },
            param="tools[1].function.name",
            contains=("twice",),
        ),
        BadRequest(
            "tool_choice names an unknown function",
            "POST",
            chat,
            body={
                "messages": USER,
                "tools": [{"type": "function", "function": {"name": "f"}}],
                "tool_choice": {"type": "function", "function": {"name": "g"}},
            },
            param="tool_choice",
            contains=("'g'",),
        ),
        BadRequest(
            "tool_choice required without tools",
            "POST",
            chat,
            body={"messages": USER, "tool_choice": "required"},
            param="tool_choice",
            contains=("needs tools",),
        ),
        BadRequest(
            "tool_choice of an unknown word",
            "POST",
            chat,
            body={
                "messages": USER,
                "tools": [{"type": "function", "function": {"name": "f"}}],
                "tool_choice": "always",
            },
            param="tool_choice",
        ),
        BadRequest(
            "tool_choice auto without the server flag",
            "POST",
            chat,
            body={"messages": USER, "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "auto"},
            param="tool_choice",
            contains=("--enable-auto-tool-choice",),
        ),
        BadRequest(
            "forced tool with a response_format",
            "POST",
            chat,
            body={
                "messages": USER,
                "tools": [{"type": "function", "function": {"name": "f"}}],
                "tool_choice": "required",
                "response_format": {"type": "json_object"},
            },
            param="tool_choice",
        ),
        BadRequest(
            "parallel_tool_calls a string",
            "POST",
            chat,
            body={
                "messages": USER,
                "tools": [{"type": "function", "function": {"name": "f"}}],
                "parallel_tool_calls": "yes",
            },
            param="parallel_tool_calls",
        ),
        # -- completion prompts
        BadRequest("no prompt", "POST", comp, body={}, param="prompt"),
        BadRequest("prompt an object", "POST", comp, body={"prompt": {"a": 1}}, param="prompt"),
        BadRequest("empty prompt", "POST", comp, body={"prompt": ""}, param="prompt", contains=("empty",)),
        BadRequest(
            "batch times n over max_choices",
            "POST",
            comp,
            body={"prompt": ["a", "b", "c"], "n": 6},
            param="prompt",
            contains=("3 prompts", "18 choices", "max_choices"),
        ),
        BadRequest(
            "prompt token outside the vocabulary",
            "POST",
            comp,
            body={"prompt": [1, 2, VOCAB_SIZE]},
            param="prompt",
            contains=(str(VOCAB_SIZE),),
        ),
        BadRequest(
            "prompt ids over the context",
            "POST",
            comp,
            body={"prompt": [100] * (max_model_len + 1)},
            param="prompt",
            contains=(str(max_model_len),),
        ),
        # -- tokenize and detokenize
        BadRequest("tokenize nothing", "POST", "/tokenize", body={}, param="prompt"),
        BadRequest("tokenize empty messages", "POST", "/tokenize", body={"messages": []}, param="messages"),
        BadRequest(
            "tokenize add_special_tokens a number",
            "POST",
            "/tokenize",
            body={"prompt": "hi", "add_special_tokens": 1},
            param="add_special_tokens",
        ),
        BadRequest(
            "tokenize unknown model",
            "POST",
            "/tokenize",
            body={"model": "x", "prompt": "hi"},
            status=404,
            param="model",
        ),
        BadRequest(
            "tokenize malformed json",
            "POST",
            "/tokenize",
            raw=b'{"prompt": "hi"',
            headers=json_type,
            contains=("JSON",),
        ),
        BadRequest(
            "detokenize id outside the vocabulary", "POST", "/detokenize", body={"tokens": [1, -3]}, param="tokens"
        ),
        BadRequest("detokenize tokens a string", "POST", "/detokenize", body={"tokens": "1 2 3"}, param="tokens"),
        BadRequest("detokenize no tokens", "POST", "/detokenize", body={}, param="tokens"),
        # -- methods, routes, keys
        BadRequest("GET chat completions", "GET", chat, status=405),
        BadRequest("POST models", "POST", "/v1/models", body={}, status=405),
        BadRequest("DELETE health", "DELETE", "/health", status=405),
        BadRequest("POST version", "POST", "/version", body={}, status=405),
        BadRequest("POST metrics", "POST", "/metrics", body={}, status=405),
        BadRequest("PUT status", "PUT", "/v1/status", body={}, status=405),
        BadRequest("POST dashboard", "POST", "/dashboard", body={}, status=405),
        BadRequest("unknown route", "GET", "/v1/embeddings", status=404),
        BadRequest("dashboard without a key", "GET", "/dashboard", status=401, auth=None),
        BadRequest("models without a key", "GET", "/v1/models", status=401, auth=None, contains=("API key",)),
        BadRequest("chat with a wrong key", "POST", chat, body={"messages": USER}, status=401, auth="wrong-key"),
        BadRequest("tokenize without a key", "POST", "/tokenize", body={"prompt": "hi"}, status=401, auth=None),
        BadRequest("status with a wrong key", "GET", "/v1/status", status=401, auth=API_KEY + "x"),
    ]
    names = [c.name for c in cases]
    assert len(names) == len(set(names)), "corpus case names must be unique"
    return cases


def worker_refusals() -> list[BadRequest]:
    """Structured outputs the router's own checks accept (a valid JSON schema, a regex Python
    compiles, a grammar that lints) but the workers' grammar backend (xgrammar) cannot compile:
    they reach a worker, which refuses them before holding anything, and the answer is still a
    400 naming the field. Not for a FakeBackend (it compiles nothing): tests/hardening/test_corpus.py
    and tests/structured/test_reasoning_tiny.py send them to real workers."""
    chat, comp = "/v1/chat/completions", "/v1/completions"
    missing_ref = {"type": "object", "properties": {"a": {"$ref": "#/$defs/nope"}}}
    compile_words = ("does not compile",)
    cases = [
        BadRequest(
            "json schema with an unresolvable $ref",
            "POST",
            chat,
            body={
                "messages": USER,
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"$ref": "#/definitions/missing"}},
                },
            },
            param="response_format",
            contains=compile_words,
        ),
        BadRequest(
            "guided_json with minimum over maximum",
            "POST",
            comp,
            body={"prompt": "hi", "guided_json": {"type": "integer", "minimum": 5, "maximum": 1}},
            param="guided_json",
            contains=compile_words,
        ),
        BadRequest(
            "structured_outputs json with a missing $defs entry",
            "POST",
            chat,
            body={"messages": USER, "structured_outputs": {"json": missing_ref}},
            param="structured_outputs",
            contains=compile_words,
        ),
        BadRequest(
            "guided_regex with an inline flag",
            "POST",
            comp,
            body={"prompt": "hi", "guided_regex": "(?i)abc"},
            param="guided_regex",
            contains=compile_words,
        ),
        BadRequest(
            "regex with a word boundary",
            "POST",
            chat,
            body={"messages": USER, "structured_outputs": {"regex": "\\bword\\b"}},
            param="structured_outputs",
            contains=compile_words,
        ),
        BadRequest(
            "regex with an open lower repetition bound",
            "POST",
            comp,
            body={"prompt": "hi", "structured_outputs": {"regex": "a{,3}"}},
            param="structured_outputs",
            contains=compile_words,
        ),
        BadRequest(
            "grammar with an invalid escape",
            "POST",
            comp,
            body={"prompt": "hi", "guided_grammar": 'root ::= "\\q"'},
            param="guided_grammar",
            contains=compile_words,
        ),
        BadRequest(
            "required tool whose parameters hold a missing $ref",
            "POST",
            chat,
            body={
                "messages": USER,
                "tools": [{"type": "function", "function": {"name": "f", "parameters": missing_ref}}],
                "tool_choice": "required",
            },
            param="tools",
            contains=compile_words,
        ),
        BadRequest(
            "streamed json schema with an unresolvable $ref",
            "POST",
            chat,
            body={
                "messages": USER,
                "stream": True,
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"$ref": "#/definitions/missing"}},
                },
            },
            param="response_format",
            contains=compile_words,
        ),
    ]
    names = [c.name for c in cases]
    assert len(names) == len(set(names)), "corpus case names must be unique"
    return cases


def send(client, case: BadRequest):
    """Send `case` with an httpx-like client (httpx.Client or Starlette's TestClient)."""
    headers = dict(case.headers)
    if case.auth is not None:
        headers["Authorization"] = f"Bearer {case.auth}"
    if case.raw is not None:
        return client.request(case.method, case.path, content=case.raw, headers=headers)
    if case.body is not None:
        return client.request(case.method, case.path, json=case.body, headers=headers)
    return client.request(case.method, case.path, headers=headers)


def check_answer(case: BadRequest, response) -> None:
    """The status, the OpenAI envelope, the field named and the words of the message."""
    assert response.status_code == case.status, (case.name, response.status_code, response.text[:300])
    body = response.json()
    assert set(body) == {"error"}, (case.name, body)
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, (case.name, error)
    assert error["code"] == case.status and isinstance(error["message"], str) and error["type"], (case.name, error)
    if case.param_prefix:
        assert (error["param"] or "").startswith(case.param), (case.name, error)
    else:
        assert error["param"] == case.param, (case.name, error)
    for words in case.contains:
        assert words in error["message"], (case.name, words, error["message"])
    if case.status == 401:
        assert response.headers.get("www-authenticate"), case.name
