"""Fixtures of the healing and scaling tests; the helpers they use are in tests/healing/helpers.py."""

from __future__ import annotations

import pytest

from tests.healing.helpers import Expected, clear_prompts


@pytest.fixture(scope="session")
def reference_engine():
    """The engine alone, greedy float32: the oracle."""
    from workers.config import EngineConfig
    from workers.engine import LLMEngine

    return LLMEngine.from_model_dir(None, EngineConfig(kv_cache_memory=64 << 20))


@pytest.fixture(scope="session")
def clear_prompt_set(reference_engine, tokenizer):
    """A function (n, max_tokens) -> n prompts with clear greedy answers (helpers.clear_prompts), cached."""
    cache: dict[tuple[int, int], list[Expected]] = {}

    def get(n: int, max_tokens: int) -> list[Expected]:
        if (n, max_tokens) not in cache:
            cache[n, max_tokens] = clear_prompts(reference_engine, tokenizer, n, max_tokens)
        return cache[n, max_tokens]

    return get
