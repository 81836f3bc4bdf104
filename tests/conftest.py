"""Session environment for every test, and the default model's tokenizer (tests/e2e and
tests/router bring their own variants)."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The private Rays of the tests run without token auth, as testkit.cluster.FakeCluster's cluster
# does: a private `ray.init()` otherwise turns token mode on for the rest of this process, and a
# FakeCluster started after it (tests/e2e, then tests/cluster) sees every actor die at start.
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
# Triton fixes interpreter mode when it is first imported, and the engine imports it early: set it
# for the whole session so the kernel tests can run their kernels on CPU tensors. The GPU script
# sets TRITON_INTERPRET=0 to compile them instead.
os.environ.setdefault("TRITON_INTERPRET", "1")


# Fixtures that start Ray or load the default model: a test that uses one is marked `slow` here, so
# `make test-fast` (-m "not slow and not gpu") never starts Ray or loads the model. Tests that do
# either in their own body carry the mark themselves (pytestmark or @pytest.mark.slow); those of
# tests/kvtransfer that need Ray through a parameter are marked in its conftest.
SLOW_FIXTURES = frozenset(
    {
        "fake_cluster",
        "spare_cluster",  # tests/cluster: a FakeCluster (`ray start` and its nodes)
        "ray_sides",  # tests/kvtransfer: a private Ray with two actors
        "hardened",  # tests/hardening: a deployment on a private Ray
        "reference_engine",
        "hf_model",
        "hf_references",  # the default model in this process
    }
)


def pytest_configure(config):
    from tests.beside import Beside

    config.pluginmanager.register(Beside(config), "baton-tests-beside")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if SLOW_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


def pytest_collection_finish(session):
    # transformers' answers that tests/engine compares with take about a minute of CPU when pytest's
    # cache does not keep them: computed meanwhile at idle priority (tests/engine/references.py).
    cache = getattr(session.config, "cache", None)
    if (
        cache is None
        or session.config.option.collectonly
        or not any("hf_references" in getattr(item, "fixturenames", ()) for item in session.items)
    ):
        return
    from tests.engine import references

    session.config.stash[references.BACKGROUND] = references.start_in_background(cache.mkdir(references.CACHE_FOLDER))


def pytest_sessionfinish(session, exitstatus):
    from tests.engine import references

    background = session.config.stash.get(references.BACKGROUND, None)
    if background is not None and background.poll() is None:  # the run ended before it was needed
        background.kill()
        background.wait()
    # The fault tests SIGKILL workers, which cannot unlink their shared-memory KV segments; a
    # worker started later sweeps them, but the test run leaves none behind either.
    from kvtransfer.shm import sweep_stale_segments

    sweep_stale_segments()


@pytest.fixture
def native_kernels_off(monkeypatch):
    """For one test, the native CPU kernels are as on a machine without a C++ compiler: no library
    loads, so kernel_ops() and the KV block copy fall back to PyTorch."""
    from kernels import cpu_native

    monkeypatch.setattr(cpu_native, "load", lambda name: None)
    monkeypatch.setattr(cpu_native, "function", lambda name, symbol, argtypes: None)


@pytest.fixture(scope="session")
def tokenizer():
    from router.tokenizer import Tokenizer
    from workers.models.files import resolve_model_dir

    try:
        return Tokenizer.from_model_dir(resolve_model_dir(None, quiet=True))
    except Exception as e:  # pragma: no cover - depends on the machine
        pytest.skip(f"default model not available: {e}")
