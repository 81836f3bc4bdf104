"""A Ray cluster of several simulated nodes on this machine, and a deployment with its router in
a thread (`serving`), for tests and benchmarks (not used in serving).

`FakeCluster` runs Ray's fake multi-node provider: `RAY_FAKE_CLUSTER=1 ray start --head
--autoscaling-config=FILE --block` in its own process group, where FILE declares node types
(`NodeType`: resources such as CPU, GPU, `baton_prefill`; labels) with `min_workers`; the
autoscaler then starts one raylet per simulated node, each with its own Ray node id, all on
127.0.0.1. Everything Ray writes (sessions, logs, `ray_current_cluster`) goes under the
cluster's own temporary folder (`RAY_TMPDIR`), so another Ray on the machine is never
touched, and `stop()` ends exactly the processes it started, by process group.

    with FakeCluster([NodeType("prefill", 2, {"CPU": 1, "baton_prefill": 1})]) as cluster:
        ...  # this process is a driver on it (ray.init(address=cluster.address))
        cluster.node_ids("prefill")  # Ray node ids of that node type
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from common.envs import ensure_private_ray_env

# Ray reads this when it is imported: its drivers then talk to 127.0.0.1, not the machine's
# interface address (which no simulated node listens on).
ensure_private_ray_env()

import ray  # noqa: E402 (Ray reads its RAY_* variables at import: set them first)

from cluster.launcher import build_app, deploy  # noqa: E402 (may import Ray: env set first)
from common.worker_client import WorkerClient  # noqa: E402 (imports Ray's types: env set first)
from testkit.harness import ServedApp, ServerDidNotStart, free_port, serve_app  # noqa: E402 (may import Ray: env set first)

REPO = Path(__file__).resolve().parents[1]
# Ray caps each simulated node's object store; they share /dev/shm with everything else here.
OBJECT_STORE_BYTES = 128 << 20
# Ray's own timing knobs for the fake cluster's processes, shorter than Ray's defaults so tests wait
# less: the autoscaler launches the nodes after 1 s instead of 5 s, and the GCS takes a node whose
# raylet stopped answering for dead after 3 failed checks 1 s apart (default 5, 3 s apart: 15 s).
# A check still waits Ray's default 10 s for an answer, so a slow but live node is not taken for dead.
FAST_RAY_ENV = {
    "AUTOSCALER_UPDATE_INTERVAL_S": "1",
    "RAY_health_check_period_ms": "1000",
    "RAY_health_check_failure_threshold": "3",
}


def leave_ray() -> bool:
    """End this process's Ray driver connection if an earlier user left one (True then): a private
    Ray this process started (`ray.init(address="local")`) ends with it, a cluster it had joined
    keeps running. Test suites call it before they start the Ray they need, so none depends on
    what a suite before it left running; nothing else on the machine is touched."""
    if not ray.is_initialized():
        return False
    ray.shutdown()
    return True


@contextlib.contextmanager
def private_ray(**init_kwargs) -> Iterator[None]:
    """A private Ray on 127.0.0.1 (`ray.init(address="local", ...)`, no dashboard) with this
    process as its driver for the block, after `leave_ray()`; shut down after the block."""
    leave_ray()
    ray.init(address="local", **{"include_dashboard": False, **init_kwargs})
    try:
        yield
    finally:
        ray.shutdown()


class RunningServer:
    """A deployment with its router served in a thread of this process (`serving`)."""

    def __init__(self, deployment, served: ServedApp) -> None:
        self.deployment = deployment
        self.served = served
        self.server = served.server
        self.thread = served.thread
        self.port = served.port
        self.base_url = served.base_url

    def stats(self) -> dict:
        return {w.worker_id: ray.get(w.client.stats(), timeout=30) for w in self.deployment.workers}

    def wait_idle(self, timeout_s: float = 30.0) -> dict:
        """Worker stats once nothing runs and no block is referenced (or the last seen at timeout)."""
        deadline = time.monotonic() + timeout_s
        while True:
            stats = self.stats()
            if (
                all(
                    s.num_running == 0 and s.num_waiting == 0 and s.num_free_blocks == s.num_blocks
                    for s in stats.values()
                )
                or time.monotonic() > deadline
            ):
                return stats
            time.sleep(0.2)

    def killer_mid_reply(self, worker_id: str, running: int = 3):
        """An async function that SIGKILLs `worker_id`'s process once it runs `running` requests
        (a worker dying mid-reply; Ray restarts it)."""
        handle = next(w.handle for w in self.deployment.workers if w.worker_id == worker_id)
        pid = ray.get(WorkerClient(handle).stats(), timeout=60).pid

        async def kill() -> None:
            while (await WorkerClient(handle).stats()).num_running < running:
                await asyncio.sleep(0.005)
            os.kill(pid, signal.SIGKILL)

        return kill


@contextlib.contextmanager
def serving(config, actor_name_prefix: str = "baton", app=None, **serve_kwargs) -> Iterator[RunningServer]:
    """Deploy `config` (cluster.launcher.deploy; its server.port free, see free_port), run its
    router (`app(deployment)`, default cluster.launcher.build_app) in a uvicorn thread for the
    block, then stop both. `serve_kwargs` go to testkit.harness.serve_app."""
    deployment = deploy(config, actor_name_prefix=actor_name_prefix)
    try:
        with contextlib.ExitStack() as stack:
            port = config.server.port
            for attempt in range(3):
                try:
                    served = stack.enter_context(serve_app((app or build_app)(deployment), port=port, **serve_kwargs))
                    break
                except ServerDidNotStart:
                    # The port was free when the test chose it, but the processes Ray started since
                    # bind ports of their own and may have taken it: serve on one free now instead.
                    if attempt == 2:
                        raise
                    port = free_port()
            yield RunningServer(deployment, served)
    finally:
        deployment.shutdown()


@dataclass(frozen=True)
class RankActor:
    """A live Ray actor of a tensor-parallel worker, as Ray's own actor table gives it."""

    pid: int
    node_id: str
    rank0: bool  # the worker's rank 0 (the actor named after the worker); else one of the ranks it owns


def tp_group_actors(worker_actor_name: str) -> list[RankActor]:
    """The live actors of the worker named `worker_actor_name`: its rank 0 and the rank actors it owns."""
    alive = [a for a in ray._private.state.actors().values() if a["State"] == "ALIVE"]
    rank0 = [a for a in alive if a.get("Name") == worker_actor_name]
    owners = {a["Address"]["Port"] for a in rank0}  # a process's own port: its rank actors' owner's
    ranks = [a for a in alive if a["ActorClassName"].endswith("TPRankActor") and a["OwnerAddress"]["Port"] in owners]
    return [RankActor(a["Pid"], a["Address"]["NodeID"], a in rank0) for a in rank0 + ranks]


@dataclass(frozen=True)
class NodeType:
    """`count` simulated nodes, each offering `resources` and carrying `labels`."""

    name: str
    count: int
    resources: dict[str, float]
    labels: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.count < 0 or not self.name or self.name == "ray.head.default":
            raise ValueError(f"bad node type {self!r}")


def cluster_yaml(node_types: list[NodeType], gcs_port: int, head_cpus: float) -> dict:
    """The fake provider's cluster file (the recipe in DESIGN.md)."""
    types = {"ray.head.default": {"resources": {"CPU": head_cpus}, "node_config": {}, "max_workers": 0}}
    for t in node_types:
        types[t.name] = {
            "resources": {**t.resources, "object_store_memory": OBJECT_STORE_BYTES},
            "node_config": {},
            "min_workers": t.count,
            "max_workers": t.count,
        }
        if t.labels:
            types[t.name]["labels"] = dict(t.labels)
    return {
        "cluster_name": "baton-fake",
        "max_workers": sum(t.count for t in node_types),
        "upscaling_speed": 10.0,
        "idle_timeout_minutes": 60,
        "provider": {
            "type": "fake_multinode",
            "use_node_id_as_ip": True,
            "disable_node_updaters": True,
            "disable_launch_config_check": True,
            "gcs_address": f"127.0.0.1:{gcs_port}",
        },
        "auth": {"ssh_user": "ubuntu"},
        "available_node_types": types,
        "head_node_type": "ray.head.default",
        "file_mounts": {},
        "cluster_synced_files": [],
        "file_mounts_sync_continuously": False,
        "initialization_commands": [],
        "setup_commands": [],
        "head_setup_commands": [],
        "worker_setup_commands": [],
        "head_start_ray_commands": [],
        "worker_start_ray_commands": [],
    }


class FakeCluster:
    """Start with `start()` (or `with`); this process becomes a driver on it."""

    def __init__(self, node_types: list[NodeType], head_cpus: float = 1, env: dict[str, str] | None = None) -> None:
        self.node_types = list(node_types)
        self.head_cpus = head_cpus
        self.env = dict(env or {})  # extra environment for every simulated node's processes
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        # Short: Ray's unix socket paths under it must stay below 108 characters.
        self.workdir = Path(tempfile.mkdtemp(prefix="btfc-", dir="/tmp"))
        self._proc: subprocess.Popen | None = None
        self._log = None

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self, timeout_s: float = 120.0) -> FakeCluster:
        config = self.workdir / "cluster.yaml"
        config.write_text(yaml.safe_dump(cluster_yaml(self.node_types, self.port, self.head_cpus)))
        env = dict(
            os.environ,
            RAY_FAKE_CLUSTER="1",
            RAY_AUTH_MODE="disabled",
            RAY_TMPDIR=str(self.workdir),
            PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
            RAY_SCHEDULER_EVENTS="0",
            **{**FAST_RAY_ENV, **self.env},
        )
        ensure_private_ray_env(env)
        ray_bin = Path(sys.executable).with_name("ray")
        self._log = (self.workdir / "ray-start.log").open("w")
        self._proc = subprocess.Popen(
            [
                str(ray_bin),
                "start",
                "--head",
                "--node-ip-address=127.0.0.1",
                f"--port={self.port}",
                f"--dashboard-agent-listen-port={free_port()}",
                "--include-dashboard=false",
                f"--num-cpus={self.head_cpus}",
                "--num-gpus=0",
                f"--object-store-memory={OBJECT_STORE_BYTES}",
                f"--autoscaling-config={config}",
                "--block",
            ],
            env=env,
            cwd=str(self.workdir),
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            self._connect(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _connect(self, timeout_s: float) -> None:
        if ray._private.ray_constants.ENABLE_RAY_CLUSTER:
            raise RuntimeError(
                "Ray was imported without RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0: this driver would look "
                "for the cluster on the machine's interface address; set it before importing ray"
            )
        os.environ["RAY_AUTH_MODE"] = "disabled"  # as the cluster runs
        deadline = time.monotonic() + timeout_s
        # ray.init on an address where no GCS answers yet retries for minutes: first wait for
        # `ray start` to say the head is up (or to fail).
        while "Ray runtime started" not in self.log_tail(200):
            if self._proc.poll() is not None:
                raise RuntimeError(f"ray start exited with {self._proc.returncode}: {self.log_tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the Ray head did not start in {timeout_s:.0f} s: {self.log_tail()}")
            time.sleep(0.2)
        ray.init(address=self.address, namespace="baton", log_to_driver=False)
        want = 1 + sum(t.count for t in self.node_types)
        while len(self.alive_nodes()) < want:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"only {len(self.alive_nodes())} of {want} Ray nodes came up in {timeout_s:.0f} s; "
                    f"{self.log_tail()}"
                )
            time.sleep(0.2)

    def stop(self) -> None:
        """Disconnect, end the process group (SIGTERM, then SIGKILL), remove the temporary folder."""
        if ray.is_initialized():
            ray.shutdown()
        proc, self._proc = self._proc, None
        if proc is not None:
            _end_group(proc)
        if self._log is not None:
            self._log.close()
            self._log = None
        # Twice: a Ray process that was still exiting may have written its session folder again.
        for _ in range(2):
            shutil.rmtree(self.workdir, ignore_errors=True)
            time.sleep(0.5)
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> FakeCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- views -------------------------------------------------------------------------------
    @staticmethod
    def alive_nodes() -> list[dict]:
        return [n for n in ray.nodes() if n["Alive"]]

    def node_ids(self, node_type: str) -> set[str]:
        """Ray node ids of the alive nodes of `node_type` (head: "ray.head.default")."""
        if node_type == "ray.head.default":
            return {n["NodeID"] for n in self.alive_nodes() if "node:__internal_head__" in n["Resources"]}
        kind = next(t for t in self.node_types if t.name == node_type)
        marker = {k for k in kind.resources if k not in ("CPU", "GPU", "memory")}
        labels = kind.labels
        return {
            n["NodeID"]
            for n in self.alive_nodes()
            if "node:__internal_head__" not in n["Resources"]
            and all(k in n["Resources"] for k in marker)
            and all((n.get("Labels") or {}).get(k) == v for k, v in labels.items())
        }

    def node_pids(self, node_id: str) -> list[int]:
        """Processes of one simulated node: its raylet and what it started (found by the node id
        the fake provider puts in their environment, and this cluster's RAY_TMPDIR). Not by
        process group: Ray starts each worker process (the actors) in a group of its own."""
        self._proc_pgid()  # raises when the cluster is not running
        marks = (f"RAY_OVERRIDE_NODE_ID_FOR_TESTING={node_id}".encode(), f"RAY_TMPDIR={self.workdir}\0".encode())
        pids = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                environ = (entry / "environ").read_bytes() + b"\0"
            except (OSError, ProcessLookupError):
                continue
            if all(mark in environ for mark in marks):
                pids.append(int(entry.name))
        return pids

    def kill_node(self, node_id: str) -> list[int]:
        """SIGKILL every process of one simulated node, as when a machine dies; returns them."""
        pids = self.node_pids(node_id)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return pids

    def _proc_pgid(self) -> int:
        if self._proc is None:
            raise RuntimeError("the fake cluster is not running")
        return self._proc.pid  # start_new_session: the group id is the leader's pid

    def log_tail(self, lines: int = 20) -> str:
        path = self.workdir / "ray-start.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""


def _end_group(proc: subprocess.Popen, grace_s: float = 2.0) -> None:
    """SIGTERM the process group, SIGKILL what is left after `grace_s` (Ray would drain for 30 s),
    wait until only zombies are left (the container's init reaps them)."""
    pgid = proc.pid
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            try:
                proc.wait(timeout=0.2)  # reap the leader so the group can empty
            except subprocess.TimeoutExpired:
                pass
            if not _group_alive(pgid):
                return


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # killpg(0) also succeeds for zombies that only wait to be reaped by init: look closer.
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid and fields[0] != "Z":
                return True
    return False
