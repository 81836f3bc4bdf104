"""Fixtures for engine tests: the default model, its prompts and transformers' greedy answers."""

from __future__ import annotations

import pytest
import torch

from tests.engine.helpers import hf_greedy
from workers.evaluation import PROMPTS

NEW_TOKENS = 64

# The first 19 evaluation prompts and, in chat_prompts, a long document: 20 prompts, one over 1,000 tokens.
QUESTIONS = PROMPTS[:19]


def long_document(tokenizer, min_tokens: int = 1100) -> str:
    """Offline English text from the standard library's pydoc topics, at least min_tokens long."""
    from pydoc_data.topics import topics

    text = ""
    for key in sorted(topics):
        text += topics[key]
        if len(tokenizer(text)["input_ids"]) > min_tokens:
            return text
    raise AssertionError("pydoc topics too short")


@pytest.fixture(scope="session")
def default_model_dir():
    from workers.model_files import resolve_model_dir

    return resolve_model_dir(quiet=True)


@pytest.fixture(scope="session")
def hf_tokenizer(default_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_dir)


@pytest.fixture(scope="session")
def hf_model(default_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def chat_prompts(hf_tokenizer) -> list[list[int]]:
    doc = long_document(hf_tokenizer)
    messages = [[{"role": "user", "content": q}] for q in QUESTIONS]
    messages.append([{"role": "user", "content": doc + "\n\nSummarize the text above in one sentence."}])
    prompts = [hf_tokenizer.apply_chat_template(m, add_generation_prompt=True, return_dict=True)["input_ids"] for m in messages]
    assert max(len(p) for p in prompts) > 1000
    return prompts


@pytest.fixture(scope="session")
def hf_references(hf_model, chat_prompts):
    eos = hf_model.generation_config.eos_token_id
    with torch.inference_mode():
        return [hf_greedy(hf_model, p, NEW_TOKENS, eos_token_id=eos) for p in chat_prompts]
