"""Start-up and shut-down: Ray on loopback (or an existing cluster), the two pools, the router.

With `api_server_count` N > 1 the launcher serves as router 0 and runs routers 1..N-1 as child
processes on the same port (cluster.router_procs); every router holds a lease on every worker.
The pools belong to router 0: their changes go out through a worker directory the other routers
follow (cluster.membership), and admin requests reach router 0 through a private loopback port.

Without an address Baton always starts a private Ray on 127.0.0.1 (`address="local"`: a stale
`/tmp/ray/ray_current_cluster` or another user's Ray is never joined by accident); with
`--address auto|HOST:PORT` it joins that cluster as a driver and asks it for nothing but the
workers' own resources. Where the workers go and what they ask for is `cluster.placement`.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import signal
import socket
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import ray

from cluster.autoscaler_loop import install_autoscaler
from cluster.config import BatonConfig
from cluster.membership import MembershipPublisher
from cluster.placement import (
    SpawnedWorker,
    actor_state,
    cluster_nodes,
    connect_pairs,
    private_ray_cpus,
    release_placement_group,
    resolve_pool,
    spawn_worker,
    wait_placed,
)
from cluster.pool_manager import PoolManager, PoolTargets
from cluster.router_procs import RouterProcesses, RouterSpec
from common.envs import ensure_private_ray_env
from common.protocol import DEFAULT_ROUTER_ID, RouterClaim, WorkerReady
from common.roles import Role
from router.admin import install_admin
from router.admission import share_of
from router.app import bind_socket, install_router_metrics
from router.app import build_app as build_router_app
from router.app import serve as serve_http
from router.flow import FlowLimits
from router.pools import WorkerPools
from router.ray_backend import RayBackend
from router.routing import make_policy
from router.tokenizer import Tokenizer
from workers.models.files import DEFAULT_MODEL_NAME, ModelNotFoundError, is_repo_id, resolve_model_dir

log = logging.getLogger("baton")


@dataclass
class Deployment:
    """A running set of pools with the router's backend in front of them.

    `max_model_len` is what every worker can hold (the smallest engine limit, each capped by its
    KV cache), so the router refuses longer prompts with a 400 instead of a failure in a worker.
    """

    config: BatonConfig
    model_dir: Path
    model_name: str
    max_model_len: int
    block_size: int
    workers: list[SpawnedWorker]
    backend: RayBackend | None
    owns_ray: bool
    nodes: dict[str, str] = field(default_factory=dict)  # worker id -> Ray node id
    kv_links: dict[tuple[str, str], str] = field(default_factory=dict)  # (prefill, decode) -> shm|gloo|nccl
    pools: PoolManager | None = None  # scales and heals the pools at runtime
    membership: MembershipPublisher | None = None  # publishes the pools' changes to the other routers

    def shutdown(self, timeout_s: float = 12.0) -> None:
        """Stop the workers (bounded: when Ray's own processes were signalled too, as systemd or
        `kill -- -PGID` do, every call to them would wait out Ray's reconnect timeout), then the
        private Ray."""
        stopping = threading.Thread(target=self._stop_workers, name="baton-shutdown", daemon=True)
        stopping.start()
        stopping.join(timeout_s)
        if stopping.is_alive():
            log.warning("the workers did not confirm their shutdown within %.0f s (is Ray already gone?)", timeout_s)
        if self.owns_ray:
            ray.shutdown()

    def _stop_workers(self) -> None:
        pending = []
        for w in self.workers:
            handle = w.handle
            try:
                if actor_state(handle)[1] is None:
                    continue  # never placed: nothing to shut down, and nobody would answer
                pending.append(w.client.shutdown())
            except Exception:  # already dead
                pass
        if pending:
            ray.wait(pending, num_returns=len(pending), timeout=10)
        for w in self.workers:
            try:
                ray.kill(w.handle)
            except Exception:
                pass
            release_placement_group(w)
        if self.membership is not None:
            self.membership.close()


def start_ray(address: str | None, num_cpus: int | None = None) -> bool:
    """Connect to `address`, or start a private Ray on 127.0.0.1 with `num_cpus` (default: this
    machine's). Returns True if we started it."""
    if ray.is_initialized():
        return False
    # Read when Ray starts its processes: a private Ray then binds to loopback only.
    ensure_private_ray_env()
    if address and address != "local":
        # Joining: the cluster's nodes declare their resources; a driver passing any is refused.
        ray.init(address=address, namespace="baton", log_to_driver=True)
        return False
    # address="local": never join a cluster found through /tmp/ray/ray_current_cluster by accident.
    ray.init(
        address="local",
        num_cpus=num_cpus or os.cpu_count() or 1,
        include_dashboard=False,
        namespace="baton",
        log_to_driver=True,
        configure_logging=False,
    )
    return True


def deploy(config: BatonConfig, ready_timeout_s: float = 300.0, actor_name_prefix: str = "baton") -> Deployment:
    """Resolve the model, start Ray and both pools; return once every worker answers.

    `actor_name_prefix` names the actors (`<prefix>-prefill-0`, ...): two deployments in one Ray
    (tests, benchmarks) need different prefixes.
    """
    # The router's tokenizer comes from this node's copy; every worker resolves the model again
    # on its own node (a GGUF is converted once per node, with a progress bar here).
    try:
        model_dir = resolve_model_dir(config.model)
    except ModelNotFoundError as exc:
        raise ModelNotFoundError(
            f"the router on this node ({socket.gethostname()}) needs the model's tokenizer files too: {exc}"
        ) from None
    model_name = config.served_model_name or (
        DEFAULT_MODEL_NAME
        if config.model is None
        else config.model
        if is_repo_id(config.model)
        else Path(config.model).name
    )
    placement = config.placement
    owns_ray = start_ray(placement.address, private_ray_cpus(config, os.cpu_count() or 1))
    deployment = Deployment(config, model_dir, model_name, 0, config.engine.block_size, [], None, owns_ray)
    try:
        nodes = cluster_nodes()
        spawned: list[SpawnedWorker] = []
        for role, count in ((Role.PREFILL, placement.prefill_workers), (Role.DECODE, placement.decode_workers)):
            pool = resolve_pool(config, role, nodes)
            log.info("%s pool: %d workers, each with %s", role, count, pool.describe())
            if role is Role.PREFILL:  # the routing's automatic queue threshold follows its device
                config = deployment.config = dataclasses.replace(config, routing=config.routing.for_device(pool.device))
            for i in range(count):
                spawned.append(
                    spawn_worker(config, role, i, actor_name_prefix, pool, max_restarts=placement.max_restarts)
                )
                deployment.workers.append(spawned[-1])
        deployment.nodes = wait_placed(spawned, placement.placement_timeout_s)
        _learn_limits(deployment, _wait_ready(deployment.workers, ready_timeout_s, deployment.nodes))
        deployment.kv_links = connect_pairs(
            [(w.worker_id, w.handle) for w in spawned if w.role is Role.PREFILL],
            [(w.worker_id, w.handle) for w in spawned if w.role is Role.DECODE],
        )
        log.info("KV transport per pair: %s", ", ".join(f"{p}->{d} {k}" for (p, d), k in deployment.kv_links.items()))
    except BaseException:
        deployment.shutdown()  # no actor, shared memory segment or private Ray outlives a failed start
        raise
    deployment.backend = RayBackend(
        WorkerPools(deployment.workers, router=RouterClaim(DEFAULT_ROUTER_ID, placement.router_lease_s)),
        FlowLimits(placement.max_migrations, placement.migration_wait_s),
    )
    deployment.pools = PoolManager(deployment, actor_name_prefix)
    # Routers other than this one follow the pools' changes through it (cluster.membership).
    deployment.membership = MembershipPublisher(actor_name_prefix, ray.get_runtime_context().namespace)
    deployment.pools.subscribe_membership(deployment.membership.publish)
    return deployment


def _wait_ready(
    workers: list[SpawnedWorker], ready_timeout_s: float, nodes: dict[str, str] | None = None
) -> list[WorkerReady]:
    started = time.monotonic()
    pending = {w.client.ready(): w.worker_id for w in workers}
    reports = []
    while pending:
        done, _ = ray.wait(
            list(pending), num_returns=1, timeout=max(1.0, ready_timeout_s - (time.monotonic() - started))
        )
        if not done:
            raise RuntimeError(f"workers {sorted(pending.values())} not ready after {ready_timeout_s:.0f} s")
        wid = pending.pop(done[0])
        try:
            reports.append(ray.get(done[0]))
        except ray.exceptions.RayError as exc:  # its constructor failed: the model missing on its node, ...
            node = (nodes or {}).get(wid)
            where = f" on node {node}" if node else ""
            raise ValueError(f"worker {wid} failed to start{where}: {_cause(exc)}") from None
        log.info("worker %s ready after %.1f s", wid, time.monotonic() - started)
    return reports


def _cause(exc: BaseException) -> str:
    """The worker's own error out of Ray's wrapping (a traceback ending in `Error: message`)."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, BaseException) and not isinstance(cause, ray.exceptions.RayError):
        return f"{type(cause).__name__}: {cause}"
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    errors = [line for line in lines if "Error: " in line and not line.startswith("ray.exceptions")]
    return errors[-1] if errors else (lines[0] if lines else repr(exc))


def _learn_limits(deployment: Deployment, reports: list[WorkerReady]) -> None:
    """The router serves what every worker can hold: the smallest engine max_model_len (each capped
    by its own KV cache), in the block size and dtypes the workers report."""
    for name in ("block_size", "dtype", "kv_cache_dtype"):
        seen = {getattr(r, name) for r in reports}
        if len(seen) > 1:
            raise ValueError(f"workers disagree on {name}: {sorted(map(str, seen))}")
    limiting = min(reports, key=lambda r: r.max_model_len)
    deployment.max_model_len, deployment.block_size = limiting.max_model_len, limiting.block_size
    log.info(
        "max_model_len %d (from %s: %d KV blocks of %d tokens, %s weights, %s KV cache)",
        limiting.max_model_len,
        limiting.worker_id,
        limiting.num_blocks,
        limiting.block_size,
        limiting.dtype,
        limiting.kv_cache_dtype,
    )


def build_app(
    deployment: Deployment,
    router_index: int = 0,
    router_id: str = DEFAULT_ROUTER_ID,
    metrics_dir: str | None = None,
    routers: int | None = None,
):
    """The router app over the deployment's pools. Admission gates left automatic get each pool's
    batch capacity (workers x max_num_seqs; decode workers prefill when there is no prefill pool),
    and API keys come from BATON_API_KEY when none were configured. With several router processes
    (`routers`, default api_server_count), this one, `router_index`, gets its share of every
    admission limit, so the deployment admits what one router would. The admin endpoint and the autoscaler belong to the
    process that owns the pools (deployment.pools: the launcher's)."""
    config, backend = deployment.config, deployment.backend
    if backend is None:
        raise ValueError("the deployment has no backend yet (its workers are still starting)")
    tokenizer = Tokenizer.from_model_dir(deployment.model_dir)
    policy = make_policy(config.routing, backend.prefix_index, deployment.block_size)
    seqs, placement = config.engine.max_num_seqs, config.placement
    routers = routers or placement.api_server_count
    server = dataclasses.replace(
        config.server.with_api_key_from_env(),
        max_running_requests=share_of(
            config.server.max_running_requests or placement.decode_workers * seqs, routers, router_index
        ),
        max_running_prefills=share_of(
            config.server.max_running_prefills or (placement.prefill_workers or placement.decode_workers) * seqs,
            routers,
            router_index,
        ),
        max_waiting_requests=share_of(config.server.max_waiting_requests, routers, router_index),
        max_waiting_prefills=share_of(config.server.max_waiting_prefills, routers, router_index),
        enable_lora=config.engine.lora_enabled,
        scheduling_policy=config.engine.scheduling_policy,
        tenant_weights=config.engine.tenant_weights,
        lora_adapters=config.engine.lora_specs,
    )
    app = build_router_app(
        backend,
        tokenizer,
        deployment.model_name,
        deployment.max_model_len,
        policy,
        server,
        router_id=router_id,
    )
    install_router_metrics(app, router_id, metrics_dir)
    if deployment.pools is None:
        return app
    install_admin(app, deployment.pools, config.admin.with_token_from_env())
    deployment.pools.subscribe_resize(lambda targets: resize_gates(app, config, targets, routers, router_index))
    if config.autoscaler.enabled:
        install_autoscaler(app, deployment.pools, backend, config.autoscaler)
    return app


def resize_gates(app, config: BatonConfig, targets: PoolTargets, routers: int, router_index: int) -> None:
    """Automatic gate capacities follow the pools' target sizes, this router's share of them (a
    request waiting already gets the next free slot). Router 0 calls it after every scaling, the
    others when the worker directory says the targets changed (cluster.membership)."""
    admission, seqs = app.state.baton.admission, config.engine.max_num_seqs
    if config.server.max_running_requests is None:
        admission.decode.capacity = share_of(targets.decode * seqs, routers, router_index)
    if config.server.max_running_prefills is None:
        admission.prefill.capacity = share_of((targets.prefill or targets.decode) * seqs, routers, router_index)


def _start_router_processes(deployment: Deployment, folder: Path, admin_port: int | None = None) -> RouterProcesses:
    """Routers 1..api_server_count-1 as child processes joining this deployment's Ray."""
    import yaml

    config, pools = deployment.config, deployment.pools
    if pools is None:
        raise ValueError("only the deployment that owns the pools starts the other routers")
    config_file = folder / "config.yaml"
    config_file.write_text(yaml.safe_dump(config.to_dict(), sort_keys=False))
    spec = RouterSpec(
        config_file=str(config_file),
        ray_address=ray.get_runtime_context().gcs_address,
        namespace=ray.get_runtime_context().namespace,
        workers=[(w.worker_id, Role(w.role).value, w.actor_name) for w in deployment.workers],
        model_dir=str(deployment.model_dir),
        model_name=deployment.model_name,
        max_model_len=deployment.max_model_len,
        block_size=deployment.block_size,
        count=config.placement.api_server_count,
        metrics_dir=str(folder / "metrics"),
        actor_name_prefix=pools.actor_name_prefix,
        admin_port=admin_port,
    )
    (folder / "metrics").mkdir(exist_ok=True)
    spec.write(folder / "routers.json")
    routers = RouterProcesses(folder / "routers.json", spec.count)
    routers.start()
    return routers


def serve(config: BatonConfig) -> None:
    """Run until Ctrl-C or SIGTERM, then take everything down."""
    started = time.monotonic()
    deployment = deploy(config)
    # uvicorn re-raises SIGTERM once it has drained; turning it into KeyboardInterrupt (as
    # Ctrl-C is) lets the finally clause below stop the workers and free their shared memory.
    # Installed after Ray starts, which sets a SIGTERM handler of its own that exits with 15.
    signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    server = config.server
    routers: RouterProcesses | None = None
    folder = tempfile.TemporaryDirectory(prefix="baton-routers-")
    try:
        count = config.placement.api_server_count
        # Several routers: each binds its own socket on the port with SO_REUSEPORT (this one first,
        # so a port another program holds fails here, before any child starts).
        sock = bind_socket(server.host, server.port, reuse_port=True) if count > 1 else None
        # The admin endpoint runs here only; the other routers forward admin requests to this
        # private loopback port (router.admin.install_admin_forwarding).
        admin_sock = bind_socket("127.0.0.1", 0) if count > 1 and config.admin.enabled else None
        app = build_app(deployment, metrics_dir=str(Path(folder.name) / "metrics") if count > 1 else None)
        if count > 1:
            routers = _start_router_processes(
                deployment, Path(folder.name), admin_sock.getsockname()[1] if admin_sock is not None else None
            )
        # Everything built so far (tokenizer, Ray's state, the app) lives as long as the router:
        # keep it out of the collector's full passes, which otherwise pause the event loop for tens
        # of milliseconds now and then (a 429's or a token's p99).
        gc.collect()
        gc.freeze()
        log.info(
            "serving %s on http://%s:%d (start-up %.1f s)",
            deployment.model_name,
            server.host,
            server.port,
            time.monotonic() - started,
        )
        serve_http(
            app,
            host=server.host,
            port=server.port,
            log_level=server.log_level,
            sock=sock,
            also=[admin_sock] if admin_sock is not None else (),
        )
    except KeyboardInterrupt:
        pass
    finally:
        if routers is not None:
            log.info("stopping %d router processes", len(routers.pids()))
            routers.stop()
        log.info("shutting down workers")
        deployment.shutdown()
        folder.cleanup()


def _raise_keyboard_interrupt(signum, frame):
    raise KeyboardInterrupt
