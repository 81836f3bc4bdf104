"""What bench/ and tests/ both need to run Baton on this machine (not used in serving): a free
port, polling until something holds, `baton serve` in a subprocess until /health answers, and a
FastAPI app served by uvicorn in a thread. No Ray here: `testkit.cluster.serving` deploys the
pools and runs the router in a thread on top of `serve_app`.

    with baton_serve(["--kv-cache-memory", "32MiB"]) as server:   # a real `baton serve`
        httpx.get(server.base_url + "/v1/models")
    with serve_app(app) as server:                                  # any app, in this process
        httpx.get(server.base_url + "/health")
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from common.envs import ensure_private_ray_env
from common.net import free_port
from router.app import make_server

__all__ = ["BatonProcess", "ServedApp", "baton_serve", "free_port", "healthy", "serve_app", "wait_until"]

T = TypeVar("T")


def wait_until(predicate: Callable[[], T], timeout_s: float, what: str, every_s: float = 0.1) -> T:
    """predicate()'s first truthy value, polled every `every_s`; TimeoutError naming `what` after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(every_s)


def healthy(base_url: str, timeout_s: float = 2.0) -> bool:
    """GET base_url/health answers 200."""
    try:
        with urllib.request.urlopen(base_url + "/health", timeout=timeout_s) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


@dataclass
class BatonProcess:
    """A running `baton serve`: its process (leader of its own process group), URL and log file."""

    process: subprocess.Popen
    port: int
    log_path: Path
    started_at: float  # time.monotonic() at launch
    healthy_after_s: float | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.exists() else ""


def stop_process(process: subprocess.Popen, timeout_s: float = 60.0) -> None:
    """SIGTERM to the server alone (it stops its workers and its private Ray: a group-wide signal
    would stop those first and the shutdown then waits on them), SIGKILL after `timeout_s`; then
    whatever is left of its process group is killed, so nothing outlives it."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)


@contextlib.contextmanager
def baton_serve(
    flags: Sequence[str] = (),
    *,
    port: int | None = None,
    ready_timeout_s: float = 300.0,
    log_path: str | Path | None = None,
    env: dict[str, str] | None = None,
    stop_timeout_s: float = 60.0,
) -> Iterator[BatonProcess]:
    """`baton serve --host 127.0.0.1 --port PORT FLAGS` (the venv's `baton`) in its own process
    group, yielded once /health answers 200; stopped with `stop_process` after the block. Output
    goes to `log_path` (default: a new file in the temporary directory, removed after a block that
    ended without an exception). RuntimeError when it exits or stays unhealthy for `ready_timeout_s`."""
    port = port or free_port()
    temporary_log = log_path is None
    if log_path is None:
        log_path = tempfile.mkstemp(prefix="baton-serve-", suffix=".log")[1]
    log_path = Path(log_path)
    command = [
        str(Path(sys.executable).with_name("baton")),
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *flags,
    ]
    full_env = dict(os.environ, **(env or {}))
    ensure_private_ray_env(full_env)
    with log_path.open("w") as log:
        started = time.monotonic()
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=full_env)
        server = BatonProcess(process, port, log_path, started)
        try:
            while not healthy(server.base_url):
                if process.poll() is not None:
                    raise RuntimeError(
                        f"baton serve exited with {process.returncode} (log {log_path}):\n{server.log_tail()}"
                    )
                if time.monotonic() - started > ready_timeout_s:
                    raise RuntimeError(f"baton serve not healthy after {ready_timeout_s:.0f} s (log {log_path})")
                time.sleep(0.25)
            server.healthy_after_s = time.monotonic() - started
            yield server
        finally:
            stop_process(process, stop_timeout_s)
    if temporary_log:  # only reached without an exception: a failure's log stays for its reader
        log_path.unlink(missing_ok=True)


class ServerDidNotStart(RuntimeError):
    """uvicorn ended before it served (serve_app)."""


@dataclass
class ServedApp:
    """An app served by uvicorn in a thread of this process."""

    server: Any  # uvicorn.Server
    thread: threading.Thread
    port: int

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@contextlib.contextmanager
def serve_app(
    app,
    port: int | None = None,
    log_level: str = "warning",
    start_timeout_s: float = 30.0,
    before_start: Callable[[Any], None] | None = None,
    **kwargs: Any,
) -> Iterator[ServedApp]:
    """Serve `app` (router.app.make_server) on 127.0.0.1:PORT (default: a free one) in a daemon
    thread for the block; `before_start(server)` runs once uvicorn's Config exists (it sets up its
    loggers), before the thread starts."""
    port = port or free_port()
    server = make_server(app, host="127.0.0.1", port=port, log_level=log_level, **kwargs)
    if before_start is not None:
        before_start(server)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        wait_until(lambda: server.started or not thread.is_alive(), start_timeout_s, "uvicorn to start", every_s=0.01)
        if not server.started:
            raise ServerDidNotStart("uvicorn exited before it started (its log says why: a port in use, ...)")
        yield ServedApp(server, thread, port)
    finally:
        server.should_exit = True
        thread.join(timeout=15)
