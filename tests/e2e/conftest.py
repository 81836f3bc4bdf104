"""A real deployment for end-to-end tests: Ray on 127.0.0.1, one prefill and one decode actor, the router on a free port."""

from __future__ import annotations

import pytest

from cluster.harness import free_port
from cluster.testing import leave_ray, serving


@pytest.fixture(scope="module")
def server():
    from cluster.config import BatonConfig

    # local_prefill_threshold=0: these tests check the prefill -> decode handoff, so every request
    # goes through it (the kv-aware default would prefill their short prompts on the decode worker).
    config = BatonConfig.from_options(port=free_port(), kv_cache_memory="192MiB", max_num_seqs=64, local_prefill_threshold=0)
    leave_ray()  # a private Ray of this module's own, which the deployment shuts down after it
    with serving(config) as running:
        yield running


@pytest.fixture(scope="session")
def reference_engine():
    """The engine alone, in this process: what every HTTP answer must equal (greedy)."""
    from workers.config import EngineConfig
    from workers.engine import LLMEngine

    return LLMEngine.from_model_dir(None, EngineConfig(kv_cache_memory=192 << 20))


@pytest.fixture(scope="session")
def tokenizer():
    from router.tokenizer import Tokenizer
    from workers.model_files import resolve_model_dir

    return Tokenizer.from_model_dir(resolve_model_dir(quiet=True))
