"""Request limits: what a request body may be before any model work, and the checks that need the
server's configuration or the vocabulary.

`read_json` reads a body within `max_request_body` bytes, accepts only JSON (Content-Type
application/json, or none), in UTF-8, nested at most `max_json_depth` deep, with finite numbers
and strings that are valid Unicode (no lone surrogates, which the tokenizer cannot encode).
`check_unsupported` names OpenAI fields Baton cannot honour instead of ignoring them (after
holding logit_bias to OpenAI's size and range rules, so a malformed one is named as such), and
`check_limits` holds stop strings, stop token ids and logprobs to the configured limits and the
vocabulary. Every refusal is an `APIError` 400 naming the field (param) and the limit.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

from fastapi import Request

from router.config import ServerConfig
from router.protocol import APIError, ChatCompletionRequest, CompletionRequest

__all__ = ["check_limits", "check_unsupported", "read_json"]

JSON_TYPES = ("application/json",)
LOGIT_BIAS_MAX_ENTRIES = 300  # OpenAI's limit
LOGIT_BIAS_RANGE = (-100.0, 100.0)  # OpenAI's range


class _NonFinite:
    """Stands in for NaN, Infinity or a float literal too large for a double while parsing, so the
    walk below can name where it was."""

    def __init__(self, text: str) -> None:
        self.text = text


def _parse_float(text: str) -> float | _NonFinite:
    value = float(text)
    return value if math.isfinite(value) else _NonFinite(text)


def _path(parts: tuple) -> str | None:
    out = ""
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else (("." if out else "") + str(part))
    return out or None


def check_content_type(content_type: str | None) -> None:
    if content_type is None or not content_type.strip():
        return  # as FastAPI does: a body without a type is read as JSON
    media, _, params = content_type.partition(";")
    media = media.strip().lower()
    if media not in JSON_TYPES and not (media.startswith("application/") and media.endswith("+json")):
        raise APIError(f"Content-Type must be application/json, got {content_type!r}", 400, None)
    for param in params.split(";"):
        name, _, value = param.partition("=")
        if name.strip().lower() == "charset" and value.strip().strip('"').lower() not in ("utf-8", "utf8"):
            raise APIError(f"request bodies must be UTF-8 JSON, got charset {value.strip()!r}", 400, None)


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused as soon as it is known to exceed `limit` bytes (before reading it all)."""
    too_large = f"the request body exceeds the limit of {limit} bytes (max_request_body)"
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.strip().isdigit():
            raise APIError(f"Content-Length must be a byte count, got {declared!r}", 400, None)
        if int(declared) > limit:
            raise APIError(f"{too_large}: Content-Length is {int(declared)}", 400, None)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise APIError(too_large, 400, None)
    return bytes(body)


def _walk(value: Any, max_depth: int, check_strings: bool) -> None:
    """Depth, non-finite numbers and (when the text has \\u escapes) lone surrogates, with the path."""
    stack: list[tuple[Any, tuple, int]] = [(value, (), 1)]
    while stack:
        node, path, depth = stack.pop()
        if isinstance(node, (dict, list)):
            if depth > max_depth:
                where = _path(path)
                raise APIError(
                    f"the request body nests JSON objects and arrays deeper than {max_depth} levels "
                    f"(max_json_depth){' at ' + where if where else ''}",
                    400,
                    where,
                )
            items = node.items() if isinstance(node, dict) else enumerate(node)
            for key, item in items:
                if check_strings and isinstance(key, str):
                    _check_string(key, path + (key,))
                if isinstance(item, (dict, list, _NonFinite)) or (check_strings and isinstance(item, str)):
                    stack.append((item, path + (key,), depth + 1))
        elif isinstance(node, _NonFinite):
            where = _path(path)
            raise APIError(f"{where or 'the request body'}: {node.text} is not a finite number", 400, where)
        elif isinstance(node, str):
            _check_string(node, path)


def _check_string(text: str, path: tuple) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        where = _path(path)
        raise APIError(
            f"{where or 'the request body'}: the string holds an unpaired surrogate escape "
            f"(\\u{ord(text[e.start]):04x}), which is not valid Unicode",
            400,
            where,
        ) from None


def parse_json(body: bytes, max_depth: int) -> Any:
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(f"the request body is not valid UTF-8 (byte {e.start}): JSON must be UTF-8", 400, None) from None
    try:
        value = json.loads(text, parse_constant=_NonFinite, parse_float=_parse_float)
    except RecursionError:
        raise APIError(
            f"the request body nests JSON objects and arrays deeper than {max_depth} levels (max_json_depth)", 400, None
        ) from None
    except json.JSONDecodeError as e:
        raise APIError(f"request body is not valid JSON: {e}", 400, None) from None
    except ValueError:  # an integer literal longer than Python converts (4,300 digits)
        raise APIError("request body holds an integer with too many digits", 400, None) from None
    _walk(value, max_depth, check_strings="\\u" in text or "\\U" in text)
    return value


async def read_json(request: Request, config: ServerConfig) -> Any:
    check_content_type(request.headers.get("content-type"))
    return parse_json(await read_body(request, config.max_request_body), config.max_json_depth)


# --------------------------------------------------------------------------- unsupported fields


def _absent(*defaults: Any) -> Callable[[Any], bool]:
    return lambda value: value is None or any(value == d and type(value) is type(d) for d in defaults)


# field -> (the values Baton honours, why anything else is refused). Unknown fields are still
# ignored (as vLLM does), so clients sending newer fields work; these are known and not served.
# Structured output, tools and tool_choice are served (router.structured checks them).
_TOOLS = "use tools and tool_choice instead"
_COMMON: dict[str, tuple[Callable[[Any], bool], str]] = {
    "logit_bias": (_absent({}), "logit_bias is not supported by Baton's sampler yet"),
}
UNSUPPORTED: dict[type, dict[str, tuple[Callable[[Any], bool], str]]] = {
    ChatCompletionRequest: {
        **_COMMON,
        "functions": (_absent(), "functions (deprecated) are not supported; " + _TOOLS),
        "function_call": (_absent("none", "auto"), "function_call (deprecated) is not supported; " + _TOOLS),
        "audio": (_absent(), "audio output is not supported: this is a text model"),
        "modalities": (lambda v: v is None or v == ["text"], "only the text modality is supported"),
        "prediction": (_absent(), "predicted outputs are not supported"),
        "web_search_options": (_absent(), "web search is not supported"),
        "echo": (_absent(False), "echo is not supported"),
    },
    CompletionRequest: {
        **_COMMON,
        "suffix": (_absent(""), "suffix (insertion) is not supported"),
        "echo": (_absent(False), "echo is not supported"),
        "best_of": (_absent(1), "best_of other than 1 is not supported"),
    },
}


def check_unsupported(body: dict, schema: type, vocab_size: int) -> None:
    check_logit_bias(body.get("logit_bias"), vocab_size)
    for name, (honoured, why) in UNSUPPORTED.get(schema, {}).items():
        if name in body and not honoured(body[name]):
            raise APIError(f"{name}={json.dumps(body[name])[:80]}: {why}", 400, name)


# --------------------------------------------------------------------------- limits on fields


def check_logit_bias(bias: Any, vocab_size: int) -> None:
    """OpenAI's rules: at most 300 entries, keys token ids in the vocabulary, values in [-100, 100]."""
    if bias is None:
        return
    if not isinstance(bias, dict):
        raise APIError("logit_bias must be an object mapping token ids to biases", 400, "logit_bias")
    if len(bias) > LOGIT_BIAS_MAX_ENTRIES:
        raise APIError(
            f"logit_bias has {len(bias)} entries; at most {LOGIT_BIAS_MAX_ENTRIES} are allowed", 400, "logit_bias"
        )
    low, high = LOGIT_BIAS_RANGE
    for key, value in bias.items():
        token = int(key) if isinstance(key, str) and key.strip().lstrip("-").isdigit() else None
        if token is None or not 0 <= token < vocab_size:
            raise APIError(f"logit_bias key {key!r} is not a token id in [0, {vocab_size})", 400, "logit_bias")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
            raise APIError(
                f"logit_bias[{key!r}] must be a number in [{low:g}, {high:g}], got {value!r}", 400, "logit_bias"
            )


def check_limits(req: ChatCompletionRequest | CompletionRequest, config: ServerConfig, vocab_size: int) -> None:
    """The configured limits and the vocabulary, on fields the schema alone cannot bound."""
    prompts = len(req.prompts()) if isinstance(req, CompletionRequest) else 1
    if req.n * prompts > config.max_choices:
        field_name, what = ("n", f"n={req.n}") if prompts == 1 else ("prompt", f"{prompts} prompts x n={req.n}")
        raise APIError(
            f"{what} asks for {req.n * prompts} choices; at most {config.max_choices} are allowed per "
            f"request (max_choices)",
            400,
            field_name,
        )
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stop) > config.max_stop_sequences:
        raise APIError(
            f"stop has {len(stop)} sequences; at most {config.max_stop_sequences} are allowed (max_stop_sequences)",
            400,
            "stop",
        )
    for s in stop:
        if len(s) > config.max_stop_length:
            raise APIError(
                f"a stop sequence has {len(s)} characters; at most {config.max_stop_length} are allowed "
                f"(max_stop_length)",
                400,
                "stop",
            )
    ids = req.stop_token_ids or []
    if len(ids) > config.max_stop_sequences:
        raise APIError(
            f"stop_token_ids has {len(ids)} ids; at most {config.max_stop_sequences} are allowed (max_stop_sequences)",
            400,
            "stop_token_ids",
        )
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise APIError(f"stop_token_ids: token id {bad} is out of range [0, {vocab_size})", 400, "stop_token_ids")
    if isinstance(req, ChatCompletionRequest):
        name, count = "top_logprobs", (req.top_logprobs if req.logprobs else None)
    else:
        name, count = "logprobs", req.logprobs
    if count is not None and count > config.max_logprobs:
        raise APIError(f"{name}={count} is over this server's limit of {config.max_logprobs} (max_logprobs)", 400, name)
