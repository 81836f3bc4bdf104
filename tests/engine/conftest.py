"""Fixtures for engine tests: the default model, its prompts and transformers' greedy answers."""

from __future__ import annotations

import subprocess

import pytest
import torch

from tests.engine import references as refs
from tests.engine.references import NEW_TOKENS, QUESTIONS, long_document  # noqa: F401 (re-exported: the tests' names)

BACKGROUND_WAIT_S = 900  # for the background computation of hf_references (refs.start_in_background)


@pytest.fixture(scope="session")
def default_model_dir():
    from workers.models.files import resolve_model_dir

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
    return refs.chat_prompt_ids(hf_tokenizer)


@pytest.fixture(scope="session")
def hf_references(request, chat_prompts, default_model_dir):
    """transformers' greedy answers (tokens and logits per step) to chat_prompts.

    Computed once per machine and kept under pytest's cache (`--cache-clear` drops it), keyed by
    everything the numbers depend on (tests/engine/references.py), possibly by the background
    process the session started for them; the model loads here only when neither left them."""
    from transformers import GenerationConfig

    eos = GenerationConfig.from_pretrained(default_model_dir).eos_token_id
    cache = getattr(request.config, "cache", None)  # None under -p no:cacheprovider
    if cache is None:
        return refs.compute(request.getfixturevalue("hf_model"), chat_prompts, eos)
    path = cache.mkdir(refs.CACHE_FOLDER) / f"{refs.reference_key(default_model_dir, chat_prompts, NEW_TOKENS, eos)}.pt"
    background = request.config.stash.get(refs.BACKGROUND, None)
    if background is not None and not path.exists():
        try:
            background.wait(BACKGROUND_WAIT_S)
        except subprocess.TimeoutExpired:
            background.kill()
    kept = refs.load(path)
    if kept is not None:
        return kept
    references = refs.compute(request.getfixturevalue("hf_model"), chat_prompts, eos)
    refs.store(path, references)
    return references
