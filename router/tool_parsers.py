"""Tool calls out of a model's text, and the OpenAI shapes they are answered in.

`--tool-call-parser` (vLLM's names) picks how a model writes calls when tool_choice is auto:
`hermes` (Hermes, Qwen 2.5/3: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any
number), `llama3_json` (Llama 3.x: a reply that is `{"name": ..., "parameters": {...}}`, calls
separated by `;`, optionally after `<|python_tag|>`) and `mistral` (`[TOOL_CALLS][{"name": ...,
"arguments": {...}}, ...]`). Without the flag it is guessed from the chat template. Text before the
first call is content. With tool_choice required or a named function the reply is constrained by a
grammar (router.structured) and read by `forced_calls` instead: it always parses.

Streamed, text is sent as content until a call's opening marker appears (a marker split across
increments is held back); the calls are sent when the reply ends, each as OpenAI sends one: a
delta with its index, id, type and name and empty arguments, then one with the arguments.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

__all__ = ["TOOL_CALL_PARSERS", "ToolCall", "ToolCallParser", "default_parser", "forced_calls"]

TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral")
_MARKERS = {"hermes": "<tool_call>", "llama3_json": "<|python_tag|>", "mistral": "[TOOL_CALLS]"}
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def message(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}

    def deltas(self, index: int) -> list[dict]:
        return [
            {"index": index, "id": self.id, "type": "function", "function": {"name": self.name, "arguments": ""}},
            {"index": index, "function": {"arguments": self.arguments}},
        ]


def default_parser(chat_template: str | None) -> str | None:
    """The parser a chat template's own tool-call syntax implies (None: it shows none)."""
    template = chat_template or ""
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3_json"
    return None


def _call(obj: Any, args_key: str) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def _all_parsed(calls: list[ToolCall | None]) -> list[ToolCall] | None:
    """The calls when there are some and every one parsed, else None."""
    parsed = [c for c in calls if c is not None]
    return parsed if parsed and len(parsed) == len(calls) else None


def parse_calls(parser: str, text: str) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a whole reply; a reply whose calls do not parse is all content."""
    if parser == "hermes":
        start = text.find("<tool_call>")
        if start < 0:
            return text, []
        calls = [_call(_loads(m), "arguments") for m in _HERMES.findall(text[start:])]
        parsed = _all_parsed(calls)
        return (text[:start].strip(), parsed) if parsed else (text, [])
    if parser == "mistral":
        start = text.find("[TOOL_CALLS]")
        if start < 0:
            return text, []
        found = _loads(text[start + len("[TOOL_CALLS]") :].strip())
        found = found if isinstance(found, list) else [found]
        calls = [_call(c, "arguments") for c in found]
        parsed = _all_parsed(calls)
        return (text[:start].strip(), parsed) if parsed else (text, [])
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return text, []
    calls = [_call(_loads(part), "parameters") for part in body.split(";") if part.strip()]
    parsed = _all_parsed(calls)
    return ("", parsed) if parsed else (text, [])


def forced_calls(text: str, named: str | None) -> list[ToolCall]:
    """The calls of a grammar-forced reply: a named function's arguments, or required's list."""
    if named is not None:
        return [ToolCall(named, text.strip())]
    found = _loads(text)
    calls = [_call(c, "parameters") for c in found] if isinstance(found, list) else []
    return [c for c in calls if c is not None]


@dataclass
class ToolCallParser:
    """A reply's stream, split into content sent as it comes and calls sent at the end."""

    parser: str
    _text: str = ""  # everything from the first possible marker on
    _calling: bool = False

    def __post_init__(self) -> None:
        if self.parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"tool call parser must be one of {TOOL_CALL_PARSERS}, got {self.parser!r}")

    def _start(self, text: str) -> int:
        """Where a call may begin in `text` (len(text): nowhere); a partial marker at the end counts."""
        marker = _MARKERS[self.parser]
        at = text.find(marker)
        if at >= 0:
            return at
        if self.parser == "llama3_json" and not self._text and text.lstrip().startswith("{"):
            return 0
        for n in range(min(len(marker) - 1, len(text)), 0, -1):
            if text.endswith(marker[:n]):
                return len(text) - n
        return len(text)

    def feed(self, text: str) -> str:
        """Content to send now."""
        if self._calling:
            self._text += text
            return ""
        text = self._text + text
        at = self._start(text)
        self._text = text[at:]
        self._calling = bool(self._text) and (
            self._text.startswith(_MARKERS[self.parser])
            or (self.parser == "llama3_json" and self._text.lstrip().startswith("{"))
        )
        return text[:at]

    def finish(self) -> tuple[str, list[ToolCall]]:
        """(content held back, calls) at the end of the reply."""
        content, calls = parse_calls(self.parser, self._text) if self._text else ("", [])
        self._text = ""
        return (content if not calls else ""), calls
