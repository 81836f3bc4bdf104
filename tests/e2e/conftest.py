"""A real deployment for end-to-end tests: Ray on 127.0.0.1, one prefill and one decode actor, the router on a free port."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(predicate, timeout_s: float, what: str):
    """predicate()'s first truthy value, polled every 0.1 s; AssertionError naming `what` after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.1)


class RunningServer:
    def __init__(self, deployment, server, thread, port):
        self.deployment = deployment
        self.server = server
        self.thread = thread
        self.base_url = f"http://127.0.0.1:{port}"

    def stats(self) -> dict:
        import ray

        return {wid: ray.get(h.stats.remote(), timeout=30) for wid, _, h in self.deployment.workers}

    def wait_idle(self, timeout_s: float = 30.0) -> dict:
        """Stats once every worker has no request and no referenced block (or the last stats seen)."""
        deadline = time.monotonic() + timeout_s
        while True:
            stats = self.stats()
            if all(s.num_running == 0 and s.num_waiting == 0 and s.num_free_blocks == s.num_blocks for s in stats.values()):
                return stats
            if time.monotonic() > deadline:
                return stats
            time.sleep(0.2)


@contextlib.contextmanager
def serving(config, actor_name_prefix: str = "baton"):
    """Deploy `config` (its port free, see free_port) and run its router in a thread for the block."""
    from cluster.launcher import build_app, deploy
    from router.app import make_server

    deployment = deploy(config, actor_name_prefix=actor_name_prefix)
    http = make_server(build_app(deployment), port=config.server.port)
    thread = threading.Thread(target=http.run, daemon=True)
    thread.start()
    try:
        wait_until(lambda: http.started, 30, "the router to start")
        yield RunningServer(deployment, http, thread, config.server.port)
    finally:
        http.should_exit = True
        thread.join(timeout=10)
        deployment.shutdown()


@pytest.fixture(scope="module")
def server():
    from cluster.config import BatonConfig

    # local_prefill_threshold=0: these tests check the prefill -> decode handoff, so every request
    # goes through it (the kv-aware default would prefill their short prompts on the decode worker).
    config = BatonConfig.from_options(port=free_port(), kv_cache_memory="192MiB", max_num_seqs=64, local_prefill_threshold=0)
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
