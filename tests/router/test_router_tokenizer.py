"""router.tokenizer against transformers (the oracle) on the default model."""

from __future__ import annotations

import pytest

from common.detokenizer import IncrementalDetokenizer
from router.tokenizer import ChatTemplateError, Tokenizer

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a pirate."}, {"role": "user", "content": "Hi there!"}],
    [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And times 3?"},
    ],
    [
        {"role": "user", "content": "Write a haiku about GPUs."},
        {"role": "assistant", "content": "Silicon rivers\nflowing with warm tensors—\nthe fans hum softly."},
        {"role": "user", "content": "Now in français, s'il vous plaît 🙂"},
    ],
    [{"role": "user", "content": "  leading and trailing spaces \n\n"}],
    [{"role": "user", "content": "text with <|im_end|> a special token inside"}],
    [{"role": "user", "content": ""}],
]

TEXTS = [
    "Hello world",
    " leading space",
    "héllo wörld 日本語 🎉 ok",
    "<|im_start|>user\nhi<|im_end|>\n",
    "def f(x):\n\treturn x  # tabs and  spaces\n",
    "",
]


@pytest.fixture(scope="module")
def hf_tokenizer(model_dir):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(model_dir))


@pytest.mark.parametrize("index", range(len(CONVERSATIONS)))
def test_chat_template_ids_match_transformers(tokenizer, hf_tokenizer, index):
    messages = CONVERSATIONS[index]
    expected = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(expected, dict) or hasattr(expected, "keys"):  # transformers 5 returns a BatchEncoding
        expected = expected["input_ids"]
    assert tokenizer.apply_chat_template(messages, add_generation_prompt=True) == list(expected)
    text = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == text


def test_chat_template_without_generation_prompt(tokenizer, hf_tokenizer):
    messages = CONVERSATIONS[2]
    text = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
    assert tokenizer.render_chat(messages, add_generation_prompt=False) == text


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_transformers(tokenizer, hf_tokenizer, text):
    for add in (True, False):
        assert tokenizer.encode(text, add_special_tokens=add) == hf_tokenizer.encode(text, add_special_tokens=add)
    ids = hf_tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == hf_tokenizer.decode(ids, skip_special_tokens=True)
    assert tokenizer.decode(ids, skip_special_tokens=False) == hf_tokenizer.decode(ids, skip_special_tokens=False)


def test_special_tokens_and_sizes(tokenizer, hf_tokenizer):
    assert tokenizer.bos_token == hf_tokenizer.bos_token
    assert tokenizer.eos_token == hf_tokenizer.eos_token
    assert tokenizer.eos_token_id == hf_tokenizer.eos_token_id == 2
    assert tokenizer.eos_token_ids == [2]
    assert tokenizer.vocab_size == len(hf_tokenizer)


def test_template_helpers(tokenizer):
    raising = (
        "{% if messages|length > 1 %}{{ raise_exception('only one message') }}{% endif %}{{ messages[0]['content'] }}"
    )
    assert tokenizer.render_chat([{"role": "user", "content": "a"}], chat_template=raising) == "a"
    with pytest.raises(ChatTemplateError, match="only one message"):
        tokenizer.render_chat([{"role": "user", "content": "a"}] * 2, chat_template=raising)
    as_json = "{{ messages[0] | tojson }}"
    assert (
        tokenizer.render_chat([{"role": "user", "content": "<é>"}], chat_template=as_json)
        == '{"role": "user", "content": "<é>"}'
    )
    with pytest.raises(ChatTemplateError):
        tokenizer.render_chat([])
    # The sandbox refuses attribute escapes.
    with pytest.raises(ChatTemplateError):
        tokenizer.render_chat([{"role": "user", "content": "a"}], chat_template="{{ ''.__class__.__mro__ }}")


def test_tokenizer_without_template(model_dir, tmp_path):
    import shutil

    shutil.copy(model_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    tok = Tokenizer.from_model_dir(tmp_path)
    assert tok.chat_template is None
    with pytest.raises(ChatTemplateError, match="no chat template"):
        tok.render_chat([{"role": "user", "content": "a"}])


def test_engine_detokenizer_with_this_tokenizer_matches_full_decode(tokenizer):
    # The one detokenizer (the engine's), driven with this tokenizer's decode as workers drive it.
    text = "héllo wörld 日本語 🎉 ok, and some more words: naïve café."
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer.decode)
    pieces = []
    for n in range(1, len(ids) + 1):
        detok.add(ids[:n])
        pieces.append(detok.take(final=n == len(ids)))
    assert "".join(pieces) == tokenizer.decode(ids) == text
    assert all("\ufffd" not in p for p in pieces)


def test_token_bytes_rebuild_the_text(tokenizer):
    text = "naïve 日本語 🎉"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert b"".join(tokenizer.token_bytes(t) for t in ids).decode("utf-8") == text
    assert tokenizer.token_bytes(tokenizer.eos_token_id) == b"<|im_end|>"
