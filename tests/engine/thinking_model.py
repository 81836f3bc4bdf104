"""A tiny random Qwen3 that thinks: its tokenizer (the default model's byte-level BPE) has `<think>`
and `</think>` as tokens of their own, and its chat template opens `<think>\\n` at the generation
prompt, as Qwen3's thinking templates and DeepSeek-R1's do. For the reasoning tests (tests/engine,
tests/structured), with transformers' greedy generation on the same folder as the oracle.

`save_thinking_model(think_end_at=None)`: random weights never produce `</think>` on their own (a
49k vocabulary, a flat distribution). With `think_end_at=k` the lm_head row of `</think>` is made
a slightly scaled copy of the row of the token the model greedily produces at step k: wherever
that token would win (with a positive logit), `</think>` wins instead, so the answer to QUESTION
closes its reasoning at step k at the latest (transformers' greedy run on the saved folder says
where; the tests read it from there).
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from tests.engine.helpers import save_tiny_model

THINK_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n<think>\\n' }}"
    "{% endif %}"
)
QUESTION = [{"role": "user", "content": "Is the sky blue? Answer in JSON."}]


def thinking_tokenizer():
    """The default model's tokenizer with `<think>` and `</think>` added (not special: they stay in the text)."""
    from transformers import AutoTokenizer

    from workers.models.files import resolve_model_dir

    tok = AutoTokenizer.from_pretrained(str(resolve_model_dir(quiet=True)))
    tok.add_tokens(["<think>", "</think>"])
    tok.chat_template = THINK_TEMPLATE
    return tok


def prompt_ids(tok, messages=QUESTION) -> list[int]:
    return tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]


def hf_greedy_ids(model, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy tokens, EOS not stopping them (the engine runs with ignore_eos too)."""
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=n,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


@functools.cache
def save_thinking_model(think_end_at: int | None, new_tokens: int = 24) -> tuple[str, torch.nn.Module, object]:
    """(folder, the transformers model, its tokenizer); see the module docstring. Built once per
    process and arguments (the tests only read the folder and run the model)."""
    tok = thinking_tokenizer()
    folder, model = save_tiny_model(
        "qwen3",
        vocab_size=len(tok),
        tie_word_embeddings=False,
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.bos_token_id,
    )
    think_end = tok.convert_tokens_to_ids("</think>")
    if think_end_at is not None:
        replaced = hf_greedy_ids(model, prompt_ids(tok), think_end_at + 1)[think_end_at]
        with torch.no_grad():
            model.lm_head.weight[think_end] = model.lm_head.weight[replaced] * 1.05
        model.save_pretrained(folder)
    tok.save_pretrained(folder)
    greedy = hf_greedy_ids(model, prompt_ids(tok), new_tokens)
    if think_end_at is None:
        assert think_end not in greedy, "the random tiny model emits </think> by itself"
    else:
        assert think_end in greedy[: think_end_at + 1], f"</think> is not among the first {think_end_at + 1} tokens"
    assert (Path(folder) / "tokenizer.json").is_file()
    return folder, model, tok
