"""Fixtures of the healing and scaling tests; the helpers they use are in tests/healing/helpers.py."""

from __future__ import annotations

import pytest

from tests.healing.helpers import Expected, session_oracle


@pytest.fixture(scope="session")
def reference_engine(request):
    """The engine alone, greedy float32: the oracle (loaded once a session, helpers.session_oracle)."""
    return session_oracle(request.config).engine


@pytest.fixture(scope="session")
def clear_prompt_set(request, reference_engine, tokenizer):
    """A function (n, max_tokens) -> n prompts with clear greedy answers (helpers.clear_prompts), cached."""
    oracle = session_oracle(request.config)

    def get(n: int, max_tokens: int) -> list[Expected]:
        return oracle.clear_prompts(tokenizer, n, max_tokens)

    return get
