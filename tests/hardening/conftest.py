"""One real deployment for the hardening tests: Ray on 127.0.0.1, a prefill and a decode worker, the
router on a free port with an API key and small body limit, and every log record captured.

The deployment lives while tests/hardening runs (package scope; `__init__.py` makes the folder a
package, so it is stopped before another folder's tests start their own Ray). The router's log
records (baton.*, uvicorn's error and access logs, the root logger) are kept in `LogCapture` for
as long, at debug level for Baton's loggers, so tests can check that a key or a prompt never
reaches them; Ray's log files are searched too.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import httpx
import pytest

from testkit.cluster import leave_ray, serving
from testkit.harness import free_port
from tests.hardening.corpus import API_KEY, MAX_REQUEST_BODY

GOOD_MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
GOOD_MAX_TOKENS = 8
GOOD_ANSWER = "The capital of France is Paris."  # 7 tokens, then EOS
LOGGERS = ("", "baton", "uvicorn", "uvicorn.error", "uvicorn.access", "ray")


class LogCapture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = record.getMessage()
        except Exception:  # a bad format string is still a record: keep its raw parts
            text = f"{record.msg} {record.args}"
        if record.exc_info:
            text += "\n" + logging.Formatter().formatException(record.exc_info)
        self.lines.append(f"{record.name} {record.levelname} {text}")

    def text(self) -> str:
        return "\n".join(self.lines)


class Hardened:
    """The running deployment (a testkit.cluster.RunningServer: worker stats, waiting for idle), auth
    headers and captured logs."""

    def __init__(self, running, logs: LogCapture) -> None:
        self.running = running
        self.deployment = running.deployment
        self.server = running.server
        self.base_url = running.base_url
        self.stats, self.wait_idle = running.stats, running.wait_idle
        self.logs = logs
        self.auth = {"Authorization": f"Bearer {API_KEY}"}

    def client(self, **kwargs) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, headers=self.auth, timeout=120, **kwargs)

    def ray_log_files(self) -> list[Path]:
        import ray._private.worker as ray_worker

        node = getattr(ray_worker.global_worker, "node", None)
        if node is None:
            return []
        return [p for p in Path(node.get_logs_dir_path()).rglob("*") if p.is_file()]


@contextlib.contextmanager
def hardened_deployment():
    from cluster.config import BatonConfig

    port = free_port()
    config = BatonConfig.from_options(
        port=port, kv_cache_memory="192MiB", max_num_seqs=32, api_key=API_KEY, max_request_body=MAX_REQUEST_BODY
    )
    logs = LogCapture()
    baton_logger = logging.getLogger("baton")
    old_level = baton_logger.level

    def capture_logs(server) -> None:  # after uvicorn's Config set up its loggers
        for name in LOGGERS:
            logging.getLogger(name).addHandler(logs)
        baton_logger.setLevel(logging.DEBUG)

    try:
        leave_ray()  # a private Ray of this deployment's own, which it shuts down after it
        with serving(config, actor_name_prefix="hardening", log_level="info", before_start=capture_logs) as running:
            yield Hardened(running, logs)
        # Whatever the session's tests sent, the key reached no log record.
        assert API_KEY not in logs.text(), "the API key appeared in a log record"
    finally:
        for name in LOGGERS:
            logging.getLogger(name).removeHandler(logs)
        baton_logger.setLevel(old_level)


@pytest.fixture(scope="package")  # tests/hardening is a package: stopped when its last test ends
def hardened():
    with hardened_deployment() as running:
        yield running


@pytest.fixture(scope="session")
def good_answer() -> str:
    """What the good request must answer: the model's greedy answer, which tests/e2e checks the
    engine alone gives (and tests/engine that transformers gives on the same weights)."""
    return GOOD_ANSWER


def ask_good(client: httpx.Client) -> httpx.Response:
    return client.post(
        "/v1/chat/completions", json={"messages": GOOD_MESSAGES, "max_tokens": GOOD_MAX_TOKENS, "temperature": 0}
    )
