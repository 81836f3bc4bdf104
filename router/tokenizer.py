"""Tokenization and chat templates for the router, with `tokenizers` + `jinja2` only (no torch, no transformers).

`Tokenizer.from_model_dir(path)` reads a Hugging Face folder (tokenizer.json, tokenizer_config.json,
chat_template.jinja, generation_config.json, config.json). `apply_chat_template` renders the template
the way transformers does (sandboxed jinja2, trim_blocks + lstrip_blocks, `raise_exception`,
`strftime_now`, a non-escaping `tojson`, the special tokens as variables) and tokenizes the result
without adding special tokens, so the ids equal `AutoTokenizer.apply_chat_template(...)`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _HFTokenizer

__all__ = ["ChatTemplateError", "Tokenizer"]

_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


class ChatTemplateError(ValueError):
    """The chat template could not render these messages (or the model has no template)."""


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys: bool = False
) -> str:
    # Like transformers: jinja's own tojson escapes HTML characters, which changes the prompt.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def _compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def _token_content(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte <-> printable character map used by ByteLevel BPE vocabularies."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


_BYTE_DECODER = {c: b for b, c in _bytes_to_unicode().items()}


def _drop_none(value: Any) -> Any:
    # transformers drops message keys whose value is None before rendering.
    if isinstance(value, Mapping):
        return {k: _drop_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, (list, tuple)):
        return [_drop_none(v) for v in value]
    return value


class Tokenizer:
    """Encode, decode and chat-template for one model; cheap to share between requests."""

    def __init__(
        self,
        tokenizer: _HFTokenizer,
        *,
        chat_template: str | None = None,
        special_tokens: Mapping[str, str] | None = None,
        eos_token_ids: Sequence[int] = (),
    ) -> None:
        self._tok = tokenizer
        self.chat_template = chat_template
        self.special_tokens: dict[str, str] = dict(special_tokens or {})
        ids: list[int] = []
        for t in eos_token_ids:
            if t not in ids:
                ids.append(int(t))
        eos = self.special_tokens.get("eos_token")
        if eos is not None:
            eos_id = tokenizer.token_to_id(eos)
            if eos_id is not None and eos_id not in ids:
                ids.append(eos_id)
        self.eos_token_ids: list[int] = ids
        self.vocab_size: int = tokenizer.get_vocab_size(with_added_tokens=True)
        self._byte_level = type(tokenizer.decoder).__name__ == "ByteLevel" if tokenizer.decoder is not None else False
        self._special_ids = {
            i for i, tok in tokenizer.get_added_tokens_decoder().items() if getattr(tok, "special", False)
        }
        self._token_text_cache: dict[int, str] = {}
        self._token_bytes_cache: dict[int, bytes] = {}

    # ---------------------------------------------------------------- loading
    @classmethod
    def from_model_dir(cls, path: str | Path) -> Tokenizer:
        path = Path(path)
        tok = _HFTokenizer.from_file(str(path / "tokenizer.json"))
        config: dict = {}
        if (path / "tokenizer_config.json").is_file():
            config = json.loads((path / "tokenizer_config.json").read_text())
        special = {}
        for key in _SPECIAL_TOKEN_KEYS:
            content = _token_content(config.get(key))
            if content is not None:
                special[key] = content
        template: str | None = None
        if (path / "chat_template.jinja").is_file():
            template = (path / "chat_template.jinja").read_text()
        elif (path / "chat_template.json").is_file():
            template = json.loads((path / "chat_template.json").read_text()).get("chat_template")
        else:
            raw = config.get("chat_template")
            if isinstance(raw, list):  # named templates: [{"name": "default", "template": ...}, ...]
                named = {t.get("name"): t.get("template") for t in raw if isinstance(t, Mapping)}
                raw = named.get("default") or next(iter(named.values()), None)
            template = raw if isinstance(raw, str) else None
        eos_ids: list[int] = []
        if (path / "generation_config.json").is_file():
            gen = json.loads((path / "generation_config.json").read_text())
            eos = gen.get("eos_token_id")
            eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        if not eos_ids and (path / "config.json").is_file():
            eos = json.loads((path / "config.json").read_text()).get("eos_token_id")
            eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        return cls(tok, chat_template=template, special_tokens=special, eos_token_ids=eos_ids)

    # ---------------------------------------------------------------- basics
    @property
    def bos_token(self) -> str | None:
        return self.special_tokens.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens.get("eos_token")

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    def is_valid_id(self, token_id: int) -> bool:
        return isinstance(token_id, int) and 0 <= token_id < self.vocab_size

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """One token decoded on its own (special tokens kept), as shown in logprobs."""
        text = self._token_text_cache.get(token_id)
        if text is None:
            text = self._tok.decode([token_id], skip_special_tokens=False)
            self._token_text_cache[token_id] = text
        return text

    def token_bytes(self, token_id: int) -> bytes:
        """The raw UTF-8 bytes of one token (a token may hold part of a character)."""
        raw = self._token_bytes_cache.get(token_id)
        if raw is None:
            piece = self._tok.id_to_token(token_id)
            if piece is None:
                raw = b""
            elif self._byte_level and token_id not in self._special_ids and all(c in _BYTE_DECODER for c in piece):
                raw = bytes(_BYTE_DECODER[c] for c in piece)
            else:
                raw = self.token_text(token_id).encode("utf-8")
            self._token_bytes_cache[token_id] = raw
        return raw

    # ---------------------------------------------------------------- chat template
    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> str:
        """Render messages to the prompt text exactly as transformers' apply_chat_template(tokenize=False)."""
        source = chat_template or self.chat_template
        if source is None:
            raise ChatTemplateError("this model has no chat template; use /v1/completions with a plain prompt")
        if not messages:
            raise ChatTemplateError("messages must not be empty")
        template = _compile_template(source)
        variables = {**self.special_tokens, **kwargs}
        try:
            return template.render(
                messages=_drop_none(list(messages)),
                tools=_drop_none(tools),
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except jinja2.exceptions.TemplateError as e:  # includes raise_exception(...) and undefined values
            raise ChatTemplateError(f"chat template error: {e}") from e
        except (TypeError, ValueError, KeyError, AttributeError) as e:
            raise ChatTemplateError(f"chat template error: {e}") from e

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tokenize: bool = True,
        **kwargs: Any,
    ) -> list[int] | str:
        """Token ids (or text with tokenize=False) of the templated conversation; no extra special tokens."""
        text = self.render_chat(messages, add_generation_prompt=add_generation_prompt, **kwargs)
        if not tokenize:
            return text
        return self.encode(text, add_special_tokens=False)
