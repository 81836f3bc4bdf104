"""One router process of a running deployment: `python -m cluster.router_main` (a child that
`baton serve --api-server-count N` starts, cluster.router_procs) or `baton router` (another pod or
machine joining a running `baton serve`, `join_spec`).

It connects to the deployment's Ray as a driver, finds the worker actors by their names, builds
the router app over its own `WorkerPools` (its own lease, long-polls and prefix index) with its
share of the admission limits, and serves on the shared port (SO_REUSEPORT). The worker set it
starts with is the one router 0 published last (cluster.membership), else the start-up one, and
it follows every later change (`MembershipFollower`). Admin requests go to router 0 (the spec's
`admin_port`, router.admin.install_admin_forwarding); a router joined from another pod has no way
to router 0's loopback port, so there the admin routes answer 404 as with the endpoint off.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from common.envs import ensure_private_ray_env

ensure_private_ray_env()  # before Ray is imported: a private Ray's driver talks to 127.0.0.1

import ray  # noqa: E402 (Ray reads its RAY_* variables at import: set them first)

from cluster.config import BatonConfig  # noqa: E402 (may import Ray: env set first)
from cluster.launcher import Deployment, build_app, resize_gates  # noqa: E402 (may import Ray: env set first)
from cluster.membership import Membership, MembershipFollower, read_membership  # noqa: E402 (may import Ray: env set first)
from cluster.pool_manager import PoolTargets  # noqa: E402 (may import Ray: env set first)
from cluster.router_procs import RouterSpec  # noqa: E402 (may import Ray: env set first)
from common.protocol import RouterClaim  # noqa: E402 (may import Ray: env set first)
from common.roles import Role  # noqa: E402 (may import Ray: env set first)
from common.worker_client import WorkerClient  # noqa: E402 (imports Ray's types: env set first)
from router.admin import install_admin_forwarding  # noqa: E402 (may import Ray: env set first)
from router.app import bind_socket, run_during_lifespan  # noqa: E402 (may import Ray: env set first)
from router.app import serve as serve_http  # noqa: E402 (may import Ray: env set first)
from router.flow import FlowLimits  # noqa: E402 (may import Ray: env set first)
from router.pools import WorkerPools  # noqa: E402 (may import Ray: env set first)
from router.ray_backend import RayBackend  # noqa: E402 (may import Ray: env set first)
from workers.models.files import DEFAULT_MODEL_NAME, is_repo_id, resolve_model_dir  # noqa: E402 (may import Ray: env set first)

__all__ = ["join_spec", "main", "run_router"]

log = logging.getLogger("baton")


@dataclass(frozen=True)
class _JoinedWorker:
    """A worker actor found by name (router.pools.WorkerEntry)."""

    worker_id: str
    role: Role
    handle: object


def _exit_with_parent(parent_pid: int) -> None:
    """A router whose launcher is gone serves nothing useful: the workers went with it."""
    while os.getppid() == parent_pid:
        time.sleep(1.0)
    os.kill(os.getpid(), signal.SIGTERM)  # uvicorn's graceful stop


def join_spec(
    config_file: str, address: str, count: int, actor_name_prefix: str = "baton", namespace: str = "baton"
) -> RouterSpec:
    """The RouterSpec of a router joining a running `baton serve` from elsewhere (another pod:
    the Helm chart's router Deployment): the workers by the names the launcher gave them, the
    limits from their own start-up reports. Connects this process to Ray (kept for serving)."""
    config = BatonConfig.load(config_file)
    ray.init(address=address, namespace=namespace, log_to_driver=False, configure_logging=False)
    published = read_membership(actor_name_prefix, namespace)
    workers = (
        _serving(published)
        if published is not None
        else [
            (f"{role}-{i}", role, f"{actor_name_prefix}-{role}-{i}")
            for role, n in (("prefill", config.placement.prefill_workers), ("decode", config.placement.decode_workers))
            for i in range(n)
        ]
    )
    ready = [ray.get(WorkerClient(ray.get_actor(name, namespace=namespace)).ready()) for _, _, name in workers]
    limiting = min(ready, key=lambda r: r.max_model_len)
    model_name = config.served_model_name or (
        DEFAULT_MODEL_NAME
        if config.model is None
        else config.model
        if is_repo_id(config.model)
        else Path(config.model).name
    )
    return RouterSpec(
        config_file=config_file,
        ray_address=address,
        namespace=namespace,
        workers=workers,
        model_dir=str(resolve_model_dir(config.model)),
        model_name=model_name,
        max_model_len=limiting.max_model_len,
        block_size=limiting.block_size,
        count=count,
        actor_name_prefix=actor_name_prefix,
    )


def _serving(membership: Membership) -> list[tuple[str, str, str]]:
    """The published workers not being drained, as RouterSpec.workers lists them."""
    return [(m.worker_id, m.role, m.actor_name) for m in membership.members if not m.draining]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m cluster.router_main", description="One router process of `baton serve --api-server-count N`."
    )
    parser.add_argument("--spec", required=True, help="the launcher's RouterSpec JSON")
    parser.add_argument("--index", type=int, required=True)
    parser.add_argument("--router-id", required=True)
    parser.add_argument("--parent-pid", type=int, default=None)
    args = parser.parse_args(argv)
    return run_router(RouterSpec.read(args.spec), args.index, args.router_id, args.parent_pid)


def run_router(spec: RouterSpec, index: int, router_id: str, parent_pid: int | None = None) -> int:
    """Serve as router `index` of `spec.count` over the spec's workers until SIGTERM."""
    config = BatonConfig.load(spec.config_file)
    server, placement = config.server, config.placement
    logging.basicConfig(
        level=server.log_level.upper(), format=f"%(asctime)s %(levelname)s {router_id} %(name)s: %(message)s"
    )
    if parent_pid is not None:
        threading.Thread(target=_exit_with_parent, args=(parent_pid,), daemon=True).start()
    if not ray.is_initialized():
        ray.init(address=spec.ray_address, namespace=spec.namespace, log_to_driver=False, configure_logging=False)
    # The set router 0 published last, if the pools changed since the spec was written (a restarted
    # router must not look for a worker stopped meanwhile).
    published = read_membership(spec.actor_name_prefix, spec.namespace)
    listed = _serving(published) if published is not None else spec.workers
    workers = [
        _JoinedWorker(wid, Role(role), ray.get_actor(name, namespace=spec.namespace)) for wid, role, name in listed
    ]
    pools = WorkerPools(workers, router=RouterClaim(router_id, placement.router_lease_s))
    backend = RayBackend(pools, FlowLimits(placement.max_migrations, placement.migration_wait_s))
    deployment = Deployment(
        config, Path(spec.model_dir), spec.model_name, spec.max_model_len, spec.block_size, [], backend, owns_ray=False
    )
    app = build_app(
        deployment, router_index=index, router_id=router_id, metrics_dir=spec.metrics_dir, routers=spec.count
    )
    follower = MembershipFollower(
        pools,
        spec.actor_name_prefix,
        spec.namespace,
        placement.drain_timeout_s,
        on_targets=lambda prefill, decode: resize_gates(app, config, PoolTargets(prefill, decode), spec.count, index),
    )
    run_during_lifespan(app, lambda: asyncio.get_running_loop().create_task(follower.run()), asyncio.Task.cancel)
    if spec.admin_port is not None:
        install_admin_forwarding(app, config.admin.with_token_from_env(), f"http://127.0.0.1:{spec.admin_port}")
    # Bound last: the kernel hands this process connections from the moment it listens.
    sock = bind_socket(server.host, server.port, reuse_port=True)
    log.info("router %s serving on http://%s:%d", router_id, server.host, server.port)
    try:
        serve_http(app, host=server.host, port=server.port, log_level=server.log_level, sock=sock)
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
