"""Several router processes over one deployment (`baton serve --api-server-count N`).

The launcher (cluster.launcher.serve) starts Ray and the pools once and serves as router 0
itself; `RouterProcesses` runs routers 1..N-1 as child processes (`python -m
cluster.router_main`, which serves one router) and restarts one that dies. Each child joins the same Ray as a driver
(`ray.init(address=..., namespace=...)`), finds the worker actors by their names
(`<prefix>-<role>-<index>`, cluster.placement) instead of starting any, and serves the same port:
every process binds its own socket with SO_REUSEPORT (router.app.bind_socket), so the kernel
spreads connections over the live ones and a dead one's share goes to the others at once.

Each router has its own prefix index (every worker keeps one KV-event queue per router), its own
long-polls (each worker keeps one outbox per router) and its share of the admission limits
(router.admission.share_of). Its id names it to the workers and in each response's x-baton-router
header: `router-<index>.<incarnation>` for the children (a restarted one is a new router with a new
lease; the requests of the one that died end when its lease runs out on every worker), the fixed
`router-0` for the launcher's.

Router 0 alone owns the pools: the admin endpoint, the autoscaler and healing run there. The
children follow its changes (workers added by `baton scale`, the admin endpoint or the autoscaler,
drained, removed or replaced) through the worker directory it publishes (cluster.membership), and
forward every `/admin/...` request they receive to router 0 over a private loopback port that
router 0 listens on too (`RouterSpec.admin_port`; router.admin.install_admin_forwarding), after the
same admin checks router 0 applies. The autoscaler stays single: router 0's, which sees only its own
share of the traffic (the routers split it evenly) and scales the pools all routers use.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("baton")

__all__ = ["RouterSpec", "RouterProcesses", "child_router_id"]


def child_router_id(index: int, incarnation: int) -> str:
    return f"router-{index}.{incarnation}"


@dataclass(frozen=True)
class RouterSpec:
    """What a router process needs to join a running deployment (a JSON file the launcher writes)."""

    config_file: str  # the effective BatonConfig as YAML (`baton config show`)
    ray_address: str  # the GCS address, HOST:PORT
    namespace: str
    workers: list[tuple[str, str, str]]  # (worker id, role, Ray actor name)
    model_dir: str
    model_name: str
    max_model_len: int
    block_size: int
    count: int  # router processes in all (api_server_count)
    metrics_dir: str | None = None  # where each router leaves its metrics for the others' /metrics
    actor_name_prefix: str = "baton"  # the workers' and the worker directory's names (cluster.membership)
    admin_port: int | None = None  # router 0's private loopback port for forwarded admin requests

    def write(self, path: Path) -> None:
        path.write_text(json.dumps(dataclasses.asdict(self)))

    @classmethod
    def read(cls, path: str | os.PathLike) -> RouterSpec:
        data = json.loads(Path(path).read_text())
        data["workers"] = [tuple(w) for w in data["workers"]]
        return cls(**data)


class RouterProcesses:
    """Routers 1..count-1 as child processes, each restarted when it dies (until `stop`)."""

    def __init__(self, spec_file: Path, count: int, check_every_s: float = 0.5) -> None:
        self.spec_file = spec_file
        self.count = count
        self.check_every_s = check_every_s
        self.restarts = 0
        self._procs: dict[int, subprocess.Popen] = {}
        self._incarnation: dict[int, int] = {}
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._watcher = threading.Thread(target=self._watch, name="baton-router-supervisor", daemon=True)

    def start(self) -> None:
        with self._lock:
            for index in range(1, self.count):
                self._launch(index)
        self._watcher.start()

    def pids(self) -> dict[int, int]:
        """Router index -> the pid of its live process."""
        with self._lock:
            return {i: p.pid for i, p in self._procs.items() if p.poll() is None}

    def _launch(self, index: int) -> None:
        incarnation = self._incarnation.get(index, -1) + 1
        self._incarnation[index] = incarnation
        router_id = child_router_id(index, incarnation)
        command = [
            sys.executable,
            "-m",
            "cluster.router_main",
            "--spec",
            str(self.spec_file),
            "--index",
            str(index),
            "--router-id",
            router_id,
            "--parent-pid",
            str(os.getpid()),
        ]
        self._procs[index] = subprocess.Popen(command)
        log.info("router %s started (pid %d)", router_id, self._procs[index].pid)

    def _watch(self) -> None:
        while not self._stopping.wait(self.check_every_s):
            with self._lock:
                for index, proc in list(self._procs.items()):
                    if proc.poll() is not None and not self._stopping.is_set():
                        log.warning(
                            "router %s exited with %s; restarting it",
                            child_router_id(index, self._incarnation[index]),
                            proc.returncode,
                        )
                        self.restarts += 1
                        self._launch(index)

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stopping.set()
        with self._lock:
            procs = list(self._procs.values())
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + timeout_s
        for proc in procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
