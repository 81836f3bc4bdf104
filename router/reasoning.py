"""Reasoning output: split a thinking model's `<think>...</think>` from its answer.

`--reasoning-parser` (vLLM's name) picks the rule: `deepseek_r1` starts in reasoning (its chat
template opens `<think>` in the prompt; an opening tag in the output is dropped) and everything
before `</think>` is reasoning; `qwen3` reasons only when the output opens with `<think>` (its
template may turn thinking off, and then the whole reply is the answer). `ReasoningSplitter` takes
the text as it streams and returns (reasoning, content) increments; a tag split across two
increments is held back until it is known, so no tag text ever leaks into either part.

A structured output with a reasoning parser constrains the answer only: `grammar_start_token_ids`
gives the workers the token sequence of `</think>` (SamplingParams.reasoning_end_token_ids), and
their matcher stays inactive until the output holds it (workers.engine.grammar.GrammarState).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["REASONING_PARSERS", "ReasoningSplitter", "grammar_start_token_ids", "split_reasoning"]

REASONING_PARSERS = ("deepseek_r1", "qwen3")
OPEN, CLOSE = "<think>", "</think>"


def _held_prefix(text: str, tag: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


@dataclass
class ReasoningSplitter:
    parser: str
    _state: str = "start"  # start -> reasoning -> content
    _held: str = ""
    _after_close: bool = False  # newlines right after </think> still to drop (they may come later)

    def __post_init__(self) -> None:
        if self.parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning parser must be one of {REASONING_PARSERS}, got {self.parser!r}")

    @property
    def in_reasoning(self) -> bool:
        return self._state != "content"

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """(reasoning, content) new in `text`; with final, also what was held back."""
        text = self._held + text
        self._held = ""
        reasoning = content = ""
        if self._state == "start":
            stripped = text.lstrip()
            if len(stripped) < len(OPEN) and OPEN.startswith(stripped) and not final:
                self._held = text  # too short to tell whether it opens with <think>
                return "", ""
            if stripped.startswith(OPEN):
                text, self._state = stripped[len(OPEN) :], "reasoning"
            else:
                self._state = "reasoning" if self.parser == "deepseek_r1" else "content"
        if self._state == "reasoning":
            end = text.find(CLOSE)
            if end < 0:
                keep = 0 if final else _held_prefix(text, CLOSE)
                self._held = text[len(text) - keep :] if keep else ""
                return text[: len(text) - keep], ""
            reasoning, text = text[:end], text[end + len(CLOSE) :]
            self._state, self._after_close = "content", True
        if self._after_close:
            text = text.lstrip("\n")
            self._after_close = not text
        content = text
        return reasoning, content


def split_reasoning(parser: str, text: str) -> tuple[str | None, str]:
    """(reasoning or None, content) of a whole reply."""
    splitter = ReasoningSplitter(parser)
    reasoning, content = splitter.feed(text, final=True)
    return (reasoning if reasoning or splitter.in_reasoning or CLOSE in text else None), content


def grammar_start_token_ids(tokenizer, prompt_ids: list[int]) -> tuple[int, ...]:
    """The tokens after which a reasoning reply's grammar applies: `</think>` as `tokenizer` (a
    router.tokenizer.Tokenizer) writes it. Empty (the grammar applies from the first token) when
    the prompt already closed the thinking, as a template with thinking turned off does
    (`<think>\n\n</think>\n\n` at the generation prompt): then no `</think>` will come."""
    tail = tokenizer.decode(prompt_ids[-16:], skip_special_tokens=False)
    if tail.rstrip().endswith(CLOSE):
        return ()
    return tuple(tokenizer.encode(CLOSE, add_special_tokens=False))
