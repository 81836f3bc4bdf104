"""Start-up and shut-down: Ray on loopback (or an existing cluster), the two pools, the router."""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from cluster.config import ServeConfig

log = logging.getLogger("baton")


@dataclass
class Deployment:
    """A running set of pools with the router's backend in front of them."""

    config: ServeConfig
    model_dir: Path
    model_name: str
    max_model_len: int
    workers: list[tuple[str, str, object]]  # (worker id, role, actor handle)
    backend: object
    owns_ray: bool

    def shutdown(self) -> None:
        import ray

        pending = []
        for _, _, handle in self.workers:
            try:
                pending.append(handle.shutdown.remote())
            except Exception:  # already dead
                pass
        if pending:
            ray.wait(pending, num_returns=len(pending), timeout=10)
        for _, _, handle in self.workers:
            try:
                ray.kill(handle)
            except Exception:
                pass
        if self.owns_ray:
            ray.shutdown()


def start_ray(address: str | None) -> bool:
    """Connect to `address`, or start a private Ray on 127.0.0.1. Returns True if we started it."""
    # Must be set before Ray starts: it makes a local Ray bind to loopback only.
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import ray

    if ray.is_initialized():
        return False
    if address:
        ray.init(address=address, namespace="baton", log_to_driver=True)
        return False
    ray.init(num_cpus=os.cpu_count() or 1, include_dashboard=False, namespace="baton",
             log_to_driver=True, configure_logging=False)
    return True


def deploy(config: ServeConfig, ready_timeout_s: float = 300.0, actor_name_prefix: str = "baton") -> Deployment:
    """Resolve the model, start Ray and both pools; return once every worker answers.

    `actor_name_prefix` names the actors (`<prefix>-prefill-0`, ...): two deployments in one Ray
    (tests, benchmarks) need different prefixes.
    """
    from router.ray_backend import RayBackend
    from workers.actors import actor_class
    from workers.model_files import DEFAULT_MODEL_NAME, resolve_model_dir
    from workers.worker import WorkerConfig

    model_dir = resolve_model_dir(config.model)  # converts a GGUF once, with a progress bar
    model_name = config.served_model_name or (DEFAULT_MODEL_NAME if config.model is None else Path(config.model).name)
    hf_config = json.loads((model_dir / "config.json").read_text())
    max_model_len = config.max_model_len or hf_config.get("max_position_embeddings", 4096)

    owns_ray = start_ray(config.address)
    engine_config = config.engine_config()
    transport = config.transport_kind
    workers = []
    use_gpu = transport == "nccl"
    for role, count in (("prefill", config.prefill_workers), ("decode", config.decode_workers)):
        cls = actor_class(role)
        for i in range(count):
            worker_id = f"{role}-{i}"
            wc = WorkerConfig(worker_id, role, str(model_dir), engine_config, transport=transport)
            handle = cls.options(name=f"{actor_name_prefix}-{worker_id}", num_cpus=0, num_gpus=1 if use_gpu else 0).remote(wc)
            workers.append((worker_id, role, handle))
    deployment = Deployment(config, model_dir, model_name, max_model_len, workers, None, owns_ray)
    try:
        _wait_ready(workers, ready_timeout_s)
        _check_pairs(workers)
    except BaseException:
        deployment.shutdown()  # no actor, shared memory segment or private Ray outlives a failed start
        raise
    deployment.backend = RayBackend(workers)
    return deployment


def _wait_ready(workers: list[tuple[str, str, object]], ready_timeout_s: float) -> None:
    import ray

    started = time.monotonic()
    pending = {handle.ready.remote(): wid for wid, _, handle in workers}
    while pending:
        done, _ = ray.wait(list(pending), num_returns=1, timeout=max(1.0, ready_timeout_s - (time.monotonic() - started)))
        if not done:
            raise RuntimeError(f"workers {sorted(pending.values())} not ready after {ready_timeout_s:.0f} s")
        wid = pending.pop(done[0])
        ray.get(done[0])  # raises the worker's start-up error, if any
        log.info("worker %s ready after %.1f s", wid, time.monotonic() - started)


def _check_pairs(workers: list[tuple[str, str, object]]) -> None:
    """Every prefill worker handshakes with every decode worker before serving: workers whose KV
    layouts differ (dtype, block size, heads, FP8 scales) are refused at start-up, not mid-request."""
    import ray

    prefill = [(wid, h) for wid, role, h in workers if role == "prefill"]
    for decode_id, role, decode in workers:
        if role != "decode" or not prefill:
            continue
        endpoint = ray.get(decode.endpoint.remote())
        for prefill_id, handle in prefill:
            try:
                ray.get(handle.connect_peer.remote(endpoint))
            except ray.exceptions.RayTaskError as exc:
                raise ValueError(f"{prefill_id} cannot send KV to {decode_id}: {exc.cause}") from None


def build_app(deployment: Deployment):
    from router.app import build_app as build_router_app
    from router.routing import make_policy
    from router.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_model_dir(deployment.model_dir)
    policy = make_policy(deployment.config.routing_config(), deployment.backend.prefix_index, deployment.config.block_size)
    return build_router_app(deployment.backend, tokenizer, deployment.model_name, deployment.max_model_len, policy)


def serve(config: ServeConfig) -> None:
    """Run until Ctrl-C or SIGTERM, then take everything down."""
    from router.app import serve as serve_http

    started = time.monotonic()
    deployment = deploy(config)
    # uvicorn re-raises SIGTERM once it has drained; turning it into KeyboardInterrupt (as
    # Ctrl-C is) lets the finally clause below stop the workers and free their shared memory.
    # Installed after Ray starts, which sets a SIGTERM handler of its own that exits with 15.
    signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    try:
        app = build_app(deployment)
        log.info("serving %s on http://%s:%d (start-up %.1f s)", deployment.model_name, config.host, config.port,
                 time.monotonic() - started)
        serve_http(app, host=config.host, port=config.port, log_level=config.log_level)
    except KeyboardInterrupt:
        pass
    finally:
        log.info("shutting down workers")
        deployment.shutdown()


def _raise_keyboard_interrupt(signum, frame):
    raise KeyboardInterrupt
