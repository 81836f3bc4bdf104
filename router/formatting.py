"""One response formatter for both generation endpoints: stream chunks (SSE frames) and full answers.

`ResponseFormat` owns everything the two endpoints share: the envelope (id, object, created,
model), usage, finish reasons, which outputs are worth a chunk, and the SSE framing with its
prebuilt prefix (the per-token fast path: only the choice is serialized per chunk). `ChatFormat`
and `CompletionFormat` supply only what differs: object names, where the text goes (`delta` /
`message` or `text`), the first chunk, and the shape of logprobs. A chat reply with a `ReplyShape`
(reasoning parser, tool calls) goes through a per-choice `ShapedReply`: reasoning into
`reasoning_content`, calls into `tool_calls` (finish_reason "tool_calls"), the rest into `content`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from common.protocol import RequestOutput, TokenLogprob
from router.reasoning import ReasoningSplitter, split_reasoning
from router.tokenizer import Tokenizer
from router.tool_parsers import ToolCall, ToolCallParser, forced_calls, parse_calls

__all__ = [
    "Accumulator",
    "ChatFormat",
    "Choices",
    "CompletionFormat",
    "ReplyShape",
    "ResponseFormat",
    "ShapedReply",
    "dumps",
]


def dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


@dataclass
class Accumulator:
    """What a request produced so far: for usage and for non-streamed answers."""

    num_prompt_tokens: int
    # Another choice has the same prompt (n > 1): usage counts a prompt once, as OpenAI does.
    shares_prompt: bool = False
    completion_tokens: int = 0
    cached_tokens: int = 0
    text_parts: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None

    def add(self, out: RequestOutput, keep: bool) -> None:
        """Count `out`; with keep, also keep its text and logprobs (for a full answer)."""
        self.completion_tokens += len(out.token_ids)
        if out.num_cached_tokens > self.cached_tokens:
            self.cached_tokens = out.num_cached_tokens
        if keep:
            if out.text:
                self.text_parts.append(out.text)
            if out.logprobs:
                self.logprobs.extend(out.logprobs)
        if out.finished:
            self.finish_reason = out.finish_reason or "stop"


@dataclass(frozen=True)
class ReplyShape:
    """How a chat reply's text is read: reasoning first (a parser name or None), then tool calls:
    parsed out of text (`tool_parser`, tool_choice auto), or the whole reply forced by a grammar
    (`forced`: tool_choice required, or a named function with `named`)."""

    reasoning_parser: str | None = None
    tool_parser: str | None = None
    forced: bool = False
    named: str | None = None

    @property
    def plain(self) -> bool:
        return self.reasoning_parser is None and self.tool_parser is None and not self.forced


class ShapedReply:
    """One choice's reply as it streams: deltas with reasoning_content, content and tool_calls."""

    def __init__(self, shape: ReplyShape) -> None:
        self.shape = shape
        self.reasoning = ReasoningSplitter(shape.reasoning_parser) if shape.reasoning_parser else None
        self.tools = ToolCallParser(shape.tool_parser) if shape.tool_parser else None
        self.forced_text = ""
        self.num_calls = 0
        self.named_started = False

    def _content(self, text: str, final: bool) -> tuple[str, list[dict]]:
        calls: list[ToolCall] = []
        deltas: list[dict] = []
        if self.shape.forced and self.shape.named is not None:
            # A named call's arguments stream as they come (the grammar makes them its parameters).
            if not self.named_started:
                self.named_started = True
                head = ToolCall(self.shape.named, "")
                deltas.append(head.deltas(0)[0])
                self.num_calls = 1
            if text:
                deltas.append({"index": 0, "function": {"arguments": text}})
            return "", deltas
        if self.shape.forced:
            self.forced_text += text
            if final:
                calls = forced_calls(self.forced_text, None)
            content = ""
        elif self.tools is not None:
            content = self.tools.feed(text)
            if final:
                held, calls = self.tools.finish()
                content += held
        else:
            content = text
        for call in calls:
            deltas.extend(call.deltas(self.num_calls))
            self.num_calls += 1
        return content, deltas

    def delta(self, text: str, final: bool) -> dict:
        """The chunk delta for new `text` (empty dict: nothing to send)."""
        reasoning, rest = self.reasoning.feed(text, final) if self.reasoning else ("", text)
        if self.reasoning is not None and self.reasoning.in_reasoning and not final:
            rest = ""
        content, calls = self._content(rest, final) if rest or final else ("", [])
        delta: dict = {}
        if reasoning:
            delta["reasoning_content"] = reasoning
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = calls
        return delta

    @staticmethod
    def message(shape: ReplyShape, text: str) -> dict:
        """The full answer's message for the whole reply `text`."""
        reasoning, content = split_reasoning(shape.reasoning_parser, text) if shape.reasoning_parser else (None, text)
        calls: list[ToolCall] = []
        if shape.forced:
            calls, content = forced_calls(content, shape.named), ""
        elif shape.tool_parser is not None:
            content, calls = parse_calls(shape.tool_parser, content)
        message: dict = {"role": "assistant", "content": content or (None if calls else "")}
        if reasoning is not None:
            message["reasoning_content"] = reasoning
        if calls:
            message["tool_calls"] = [c.message() for c in calls]
        return message


@dataclass
class Choices:
    """A request's choices (one per prompt of a batch, times n), each with its accumulator."""

    accs: list[Accumulator]

    def usage(self) -> dict:
        prompt = sum(a.num_prompt_tokens for a in self.accs if not a.shares_prompt)
        completion = sum(a.completion_tokens for a in self.accs)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(a.cached_tokens for a in self.accs if not a.shares_prompt)},
        }


class ResponseFormat:
    """Chunks and the full response of one request; subclasses fill in the endpoint's pieces."""

    object_full: str
    object_chunk: str

    def __init__(
        self,
        tokenizer: Tokenizer,
        request_id: str,
        model: str,
        created: int,
        include_usage: bool,
        continuous_usage: bool,
        logprobs: bool,
    ) -> None:
        self.tok = tokenizer
        self.request_id = request_id
        self.model = model
        self.created = created
        self.include_usage = include_usage
        self.continuous_usage = continuous_usage and include_usage
        self.want_logprobs = logprobs
        self._text_offsets: dict[int, int] = {}  # per choice: text_offset of its next token (completions)
        # Everything before the choices is the same in every chunk: build it once.
        self._prefix = (
            f'data: {{"id":{dumps(request_id)},"object":"{self.object_chunk}","created":{created},'
            f'"model":{dumps(model)},"choices":['
        )
        self._suffix = '],"usage":null}\n\n' if include_usage else "]}\n\n"

    # -- the endpoint's pieces
    def _delta(self, text: str, finished: bool) -> tuple[str, Any]:
        """(key, value) holding a chunk's new text."""
        raise NotImplementedError

    def _message(self, text: str) -> tuple[str, Any]:
        """(key, value) holding the full answer's text."""
        raise NotImplementedError

    def _logprobs_body(self, lps: list[TokenLogprob], index: int) -> dict:
        raise NotImplementedError

    def first_frame(self, index: int, choices: Choices) -> str | None:
        """A frame sent before choice `index`'s first token (None: none)."""
        return None

    # -- shared
    def _logprobs(self, lps: list[TokenLogprob] | None, index: int) -> dict | None:
        return self._logprobs_body(lps or [], index) if self.want_logprobs else None

    def _frame(self, choice: dict, choices: Choices) -> str:
        suffix = f'],"usage":{dumps(choices.usage())}}}\n\n' if self.continuous_usage else self._suffix
        return self._prefix + dumps(choice) + suffix

    def usage_frame(self, choices: Choices) -> str:
        """The extra chunk before [DONE] with `choices: []` and the whole request's usage."""
        return self._prefix + '],"usage":' + dumps(choices.usage()) + "}\n\n"

    def chunk(self, out: RequestOutput, index: int, choices: Choices) -> str | None:
        """The frame for one backend output of choice `index`, or None when it has nothing to
        show (half a character)."""
        if not out.text and not out.finished and not (self.want_logprobs and out.logprobs):
            return None
        key, value = self._delta(out.text, out.finished)
        choice = {
            "index": index,
            key: value,
            "logprobs": self._logprobs(out.logprobs, index) if out.logprobs else None,
            "finish_reason": (out.finish_reason or "stop") if out.finished else None,
        }
        return self._frame(choice, choices)

    def full(self, choices: Choices) -> dict:
        answers = []
        for index, acc in enumerate(choices.accs):
            key, value = self._message("".join(acc.text_parts))
            answers.append(
                {
                    "index": index,
                    key: value,
                    "logprobs": self._logprobs(acc.logprobs, index),
                    "finish_reason": acc.finish_reason,
                }
            )
        return {
            "id": self.request_id,
            "object": self.object_full,
            "created": self.created,
            "model": self.model,
            "choices": answers,
            "usage": choices.usage(),
        }


class ChatFormat(ResponseFormat):
    object_full = "chat.completion"
    object_chunk = "chat.completion.chunk"
    shape: ReplyShape = ReplyShape()

    def shaped(self, shape: ReplyShape) -> ChatFormat:
        """This format reading replies with `shape` (reasoning, tool calls)."""
        self.shape = shape
        self._replies: dict[int, ShapedReply] = {}
        return self

    def chunk(self, out: RequestOutput, index: int, choices: Choices) -> str | None:
        if self.shape.plain:
            return super().chunk(out, index, choices)
        reply = self._replies.setdefault(index, ShapedReply(self.shape))
        delta = reply.delta(out.text, out.finished)
        if not delta and not out.finished and not (self.want_logprobs and out.logprobs):
            return None
        reason = None
        if out.finished:
            reason = out.finish_reason or "stop"
            reason = "tool_calls" if reply.num_calls and reason == "stop" else reason
        choice = {
            "index": index,
            "delta": delta,
            "logprobs": self._logprobs(out.logprobs, index) if out.logprobs else None,
            "finish_reason": reason,
        }
        return self._frame(choice, choices)

    def full(self, choices: Choices) -> dict:
        answer = super().full(choices)
        if not self.shape.plain:
            for choice, acc in zip(answer["choices"], choices.accs):
                choice["message"] = ShapedReply.message(self.shape, "".join(acc.text_parts))
                if choice["message"].get("tool_calls") and choice["finish_reason"] == "stop":
                    choice["finish_reason"] = "tool_calls"
        return answer

    def _delta(self, text: str, finished: bool) -> tuple[str, Any]:
        return "delta", ({"content": text} if text or not finished else {})

    def _message(self, text: str) -> tuple[str, Any]:
        return "message", {"role": "assistant", "content": text}

    def first_frame(self, index: int, choices: Choices) -> str:
        choice = {
            "index": index,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        return self._frame(choice, choices)

    def _entry(self, token_id: int, logprob: float) -> dict:
        return {
            "token": self.tok.token_text(token_id),
            "logprob": logprob,
            "bytes": list(self.tok.token_bytes(token_id)),
        }

    def _logprobs_body(self, lps: list[TokenLogprob], index: int) -> dict:
        return {
            "content": [
                {
                    **self._entry(lp.token_id, lp.logprob),
                    "top_logprobs": [self._entry(t, logprob) for t, logprob in lp.top],
                }
                for lp in lps
            ]
        }


class CompletionFormat(ResponseFormat):
    object_full = "text_completion"
    object_chunk = "text_completion"

    def _delta(self, text: str, finished: bool) -> tuple[str, Any]:
        return "text", text

    def _message(self, text: str) -> tuple[str, Any]:
        return "text", text

    def _logprobs_body(self, lps: list[TokenLogprob], index: int) -> dict:
        tok = self.tok
        tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
        offset = self._text_offsets.get(index, 0)  # across the choice's stream chunks
        for lp in lps:
            text = tok.token_text(lp.token_id)
            tokens.append(text)
            token_logprobs.append(lp.logprob)
            top_logprobs.append({tok.token_text(t): logprob for t, logprob in lp.top})
            text_offset.append(offset)
            offset += len(text)
        self._text_offsets[index] = offset
        return {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": top_logprobs,
            "text_offset": text_offset,
        }
