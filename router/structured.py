"""Structured output and forced tool calls: a request's fields -> one checked `StructuredOutput`.

The fields (OpenAI's `response_format`; vLLM's `structured_outputs` extra body and its older
`guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`; `tool_choice` "required" or a
named function) are read here, at most one constraint per request, and checked without torch
(the router never imports it, and xgrammar does): JSON schemas against their metaschema
(jsonschema), regular expressions by Python's parser less what xgrammar does not support
(lookaround, backreferences), EBNF grammars by a lint of their rules (every rule referenced is
defined, `root` exists, brackets and quotes close), each within a size limit. The worker compiles
(workers.engine.grammar) within a time limit. Every refusal is an `APIError` 400 naming the field; one
by the workers (common.protocol.GrammarCompileError: a feature xgrammar lacks, a compile over its
limit) is answered by router.serving as a 400 naming `Constraints.param`. With a reasoning parser
the grammar constrains the answer only: the workers hold it back until `</think>`
(`Constraints.after_reasoning`, router.reasoning.grammar_start_token_ids).
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from typing import Any

import jsonschema

from common.sampling_params import StructuredOutput
from router.config import ServerConfig
from router.formatting import ReplyShape
from router.protocol import APIError
from router.tool_parsers import default_parser

__all__ = [
    "MAX_SPEC_CHARS",
    "Constraints",
    "ToolSpec",
    "check_tools",
    "forced_tool_schema",
    "request_constraints",
    "structured_output",
]

MAX_SPEC_CHARS = 64 * 1024  # a schema, regex or grammar longer than this is refused
MAX_CHOICES = 1024
TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names


def _bad(message: str, param: str) -> APIError:
    return APIError(message, 400, param)


def _canonical(value: Any, param: str) -> str:
    text = json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    if len(text) > MAX_SPEC_CHARS:
        raise _bad(f"{param} is {len(text)} characters; at most {MAX_SPEC_CHARS} are allowed", param)
    return text


def check_json_schema(schema: Any, param: str) -> str:
    """The schema as canonical JSON text, after checking it against its metaschema."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise _bad(f"{param} is not valid JSON: {e}", param) from None
    if not isinstance(schema, dict):
        raise _bad(f"{param} must be a JSON schema object, got {type(schema).__name__}", param)
    canonical = _canonical(schema, param)
    problem = _metaschema_problem(canonical)
    if problem is not None:
        raise _bad(f"{param} is not a valid JSON schema{problem}", param)
    return canonical


@functools.lru_cache(maxsize=256)
def _metaschema_problem(canonical: str) -> str | None:
    """None when the schema (canonical JSON text) passes its metaschema, else the message's tail.
    Memoised on the text: applications send the same few schemas again and again, and the check
    costs a millisecond or two of the router's event loop each time."""
    schema = json.loads(canonical)
    try:
        jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator).check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/".join(str(p) for p in e.path)
        return f"{' at ' + where if where else ''}: {e.message}"
    except Exception as e:  # a $schema or keyword the validator cannot even read (e.g. $schema: 5)
        return f": {type(e).__name__}: {e}"
    return None


_UNSUPPORTED_REGEX = [
    (re.compile(r"\(\?<?[=!]"), "lookaround"),
    (re.compile(r"\\[1-9]"), "backreferences"),
    (re.compile(r"\(\?P=|\\k<"), "backreferences"),
]


def check_regex(pattern: Any, param: str) -> str:
    if not isinstance(pattern, str) or not pattern:
        raise _bad(f"{param} must be a non-empty regular expression string", param)
    if len(pattern) > MAX_SPEC_CHARS:
        raise _bad(f"{param} is {len(pattern)} characters; at most {MAX_SPEC_CHARS} are allowed", param)
    try:
        re.compile(pattern)
    except re.error as e:
        raise _bad(f"{param} is not a valid regular expression: {e}", param) from None
    for finder, what in _UNSUPPORTED_REGEX:
        if finder.search(pattern):
            raise _bad(f"{param}: {what} are not supported in structured-output regular expressions", param)
    return pattern


def check_choice(choices: Any, param: str) -> str:
    if not isinstance(choices, list) or not choices or len(choices) > MAX_CHOICES:
        raise _bad(f"{param} must be a list of 1 to {MAX_CHOICES} strings", param)
    if any(not isinstance(c, str) or not c for c in choices):
        raise _bad(f"{param} must hold non-empty strings only", param)
    return _canonical(choices, param)


_EBNF_STRIP = re.compile(r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]|#[^\n]*')
_EBNF_RULE = re.compile(r"(?m)^\s*([A-Za-z_][A-Za-z0-9_.-]*)\s*::=")
_EBNF_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*")


def check_grammar(grammar: Any, param: str) -> str:
    """A lint of an EBNF grammar (xgrammar's GBNF dialect): rules, references, brackets."""
    if not isinstance(grammar, str) or not grammar.strip():
        raise _bad(f"{param} must be a non-empty EBNF grammar string", param)
    if len(grammar) > MAX_SPEC_CHARS:
        raise _bad(f"{param} is {len(grammar)} characters; at most {MAX_SPEC_CHARS} are allowed", param)
    body = _EBNF_STRIP.sub(" ", grammar)
    if '"' in body:
        raise _bad(f"{param}: a string literal is not closed", param)
    defined = set(_EBNF_RULE.findall(body))
    if "root" not in defined:
        raise _bad(f"{param} must define a `root ::= ...` rule", param)
    depth = 0
    for ch in body:
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth < 0:
            break
    if depth != 0:
        raise _bad(f"{param}: parentheses do not balance", param)
    referenced = set(_EBNF_NAME.findall(_EBNF_RULE.sub(" ", body)))
    missing = sorted(referenced - defined)
    if missing:
        raise _bad(f"{param}: rule {missing[0]!r} is used but not defined", param)
    return grammar


def _from_response_format(value: Any) -> StructuredOutput | None:
    if not isinstance(value, dict) or "type" not in value:
        raise _bad(
            "response_format must be an object with a type (text, json_object or json_schema)", "response_format"
        )
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput("json_object")
    if kind == "json_schema":
        inner = value.get("json_schema")
        if not isinstance(inner, dict) or "schema" not in inner and "json_schema" not in inner:
            raise _bad("response_format.json_schema must be an object with a schema", "response_format.json_schema")
        name = inner.get("name")
        if name is not None and (not isinstance(name, str) or not TOOL_NAME.match(name)):
            raise _bad(
                "response_format.json_schema.name must be 1 to 64 letters, digits, _ or -",
                "response_format.json_schema.name",
            )
        schema = inner.get("schema", inner.get("json_schema"))
        return StructuredOutput("json_schema", check_json_schema(schema, "response_format.json_schema.schema"))
    raise _bad(f"response_format.type must be text, json_object or json_schema, got {kind!r}", "response_format.type")


# vLLM's extra body: structured_outputs keys, and the older guided_* fields.
_KEYS = {
    "json": "json_schema",
    "regex": "regex",
    "choice": "choice",
    "grammar": "grammar",
    "json_object": "json_object",
}
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def _checked(kind: str, value: Any, param: str) -> StructuredOutput:
    if kind == "json_schema":
        return StructuredOutput(kind, check_json_schema(value, param))
    if kind == "regex":
        return StructuredOutput(kind, check_regex(value, param))
    if kind == "choice":
        return StructuredOutput(kind, check_choice(value, param))
    if kind == "grammar":
        return StructuredOutput(kind, check_grammar(value, param))
    if value is not True:
        raise _bad(f"{param} must be true", param)
    return StructuredOutput("json_object")


def structured_output(body: dict) -> StructuredOutput | None:
    """The request's constraint from whichever one field sets it (a 400 when two do)."""
    found = _structured_field(body)
    return found[1] if found is not None else None


def _structured_field(body: dict) -> tuple[str, StructuredOutput] | None:
    """(the field that sets the request's constraint, the constraint), or None."""
    found: list[tuple[str, StructuredOutput | None]] = []
    if body.get("response_format") is not None:
        found.append(("response_format", _from_response_format(body["response_format"])))
    so = body.get("structured_outputs")
    if so is not None:
        if not isinstance(so, dict):
            raise _bad("structured_outputs must be an object", "structured_outputs")
        keys = [k for k in _KEYS if so.get(k) is not None and so.get(k) is not False]
        if len(keys) != 1:
            raise _bad(
                f"structured_outputs must set exactly one of {sorted(_KEYS)}, got {sorted(keys)}", "structured_outputs"
            )
        found.append(("structured_outputs", _checked(_KEYS[keys[0]], so[keys[0]], f"structured_outputs.{keys[0]}")))
    for name, key in _GUIDED.items():
        if body.get(name) is not None:
            found.append((name, _checked(_KEYS[key], body[name], name)))
    real = [(name, spec) for name, spec in found if spec is not None]
    if len(real) > 1:
        raise _bad(f"only one structured output may be given; got {', '.join(n for n, _ in real)}", real[1][0])
    return real[0] if real else None


# --------------------------------------------------------------------------- tools


@dataclass(frozen=True)
class ToolSpec:
    """What a request asks of tools: the functions offered (name -> parameters schema) and the choice."""

    functions: dict[str, dict]
    choice: str  # "none", "auto", "required" or "named"
    named: str | None = None
    parallel: bool = True


def check_tools(body: dict, auto_enabled: bool) -> ToolSpec | None:
    """The request's tools and tool_choice, checked; None when it offers no tools."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is None:
        if choice not in (None, "none"):
            raise _bad("tool_choice needs tools", "tool_choice")
        return None
    if not isinstance(tools, list) or not tools:
        raise _bad("tools must be a non-empty list of functions", "tools")
    functions: dict[str, dict] = {}
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if (
            not isinstance(tool, dict)
            or tool.get("type", "function") != "function"
            or not isinstance(tool.get("function"), dict)
        ):
            raise _bad(f"{where} must be {{'type': 'function', 'function': {{...}}}}", where)
        fn = tool["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not TOOL_NAME.match(name):
            raise _bad(
                f"{where}.function.name must be 1 to 64 letters, digits, _ or -, got {name!r}", f"{where}.function.name"
            )
        if name in functions:
            raise _bad(f"{where}.function.name {name!r} is given twice", f"{where}.function.name")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        check_json_schema(params, f"{where}.function.parameters")
        if params.get("type", "object") != "object":
            raise _bad(
                f"{where}.function.parameters must describe an object (type object)", f"{where}.function.parameters"
            )
        functions[name] = params
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise _bad("parallel_tool_calls must be a boolean", "parallel_tool_calls")
    if choice is None:
        return ToolSpec(functions, "auto" if auto_enabled else "none", parallel=parallel)
    if choice in ("none", "required"):
        return ToolSpec(functions, choice, parallel=parallel)
    if choice == "auto":
        if not auto_enabled:
            raise _bad(
                'tool_choice "auto" needs the server started with --enable-auto-tool-choice and --tool-call-parser',
                "tool_choice",
            )
        return ToolSpec(functions, "auto", parallel=parallel)
    if isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in functions:
            raise _bad(f"tool_choice names function {name!r}, which is not in tools", "tool_choice")
        return ToolSpec(functions, "named", named=name, parallel=parallel)
    raise _bad(
        "tool_choice must be none, auto, required or {'type': 'function', 'function': {'name': ...}}", "tool_choice"
    )


def forced_tool_schema(tools: ToolSpec) -> StructuredOutput:
    """The grammar forcing a tool call: a named function's arguments, or for required a list of
    {name, parameters} calls of the offered functions (one when parallel calls are off)."""
    if tools.choice == "named":
        assert tools.named is not None  # check_tools names the function of every "named" choice
        return StructuredOutput("json_schema", _canonical(tools.functions[tools.named], "tools"))
    calls = {
        "anyOf": [
            {
                "type": "object",
                "properties": {"name": {"type": "string", "enum": [name]}, "parameters": params},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for name, params in tools.functions.items()
        ]
    }
    schema: dict[str, Any] = {"type": "array", "items": calls, "minItems": 1}
    if not tools.parallel:
        schema["maxItems"] = 1
    return StructuredOutput("json_schema", _canonical(schema, "tools"))


# --------------------------------------------------------------------------- one request's constraints


@dataclass(frozen=True)
class Constraints:
    """What a request's fields ask of its reply: the grammar the workers apply, and how the
    router reads the reply (reasoning, tool calls)."""

    structured: StructuredOutput | None
    shape: ReplyShape
    kind: str  # for metrics: none, a StructuredOutput kind, or tool_required / tool_named
    # The field a refusal of `structured` by the workers is blamed on (response_format, guided_json, tools, ...).
    param: str | None = None

    @property
    def after_reasoning(self) -> bool:
        """The grammar applies to the answer only, after the reasoning's `</think>` (--reasoning-parser)."""
        return self.structured is not None and self.shape.reasoning_parser is not None


def request_constraints(body: dict, chat: bool, config: ServerConfig, chat_template: str | None) -> Constraints:
    found = _structured_field(body)
    param, structured = found if found is not None else (None, None)
    tools = check_tools(body, config.enable_auto_tool_choice) if chat else None
    reasoning = config.reasoning_parser if chat else None
    kind = structured.kind if structured is not None else "none"
    shape = ReplyShape(reasoning_parser=reasoning)
    if tools is not None and tools.choice in ("required", "named"):
        if structured is not None:
            raise _bad(f"tool_choice {tools.choice} cannot be combined with a structured output", "tool_choice")
        structured, kind, param = forced_tool_schema(tools), f"tool_{tools.choice}", "tools"
        shape = ReplyShape(reasoning_parser=reasoning, forced=True, named=tools.named)
    elif tools is not None and tools.choice == "auto":
        parser = config.tool_call_parser or default_parser(chat_template)
        if parser is None:
            raise _bad(
                "tool_choice auto: this model's chat template shows no tool-call syntax; start the server "
                "with --tool-call-parser",
                "tool_choice",
            )
        shape = ReplyShape(reasoning_parser=reasoning, tool_parser=parser)
    # With a reasoning parser the workers hold the grammar back until `</think>` (Constraints.after_reasoning).
    return Constraints(structured, shape, kind, param)
