"""The OpenAI-compatible HTTP API (FastAPI + uvicorn) in front of a `ServingBackend`.

`build_app(backend, tokenizer, model_name, max_model_len, policy, server)` returns the FastAPI app;
`serve(app, host, port)` runs it with uvicorn on 127.0.0.1 by default. The app is assembled from:

- router.routes: the thin route handlers;
- router.serving: parsing, checks, prompts, routing and running chat and text completions;
- router.formatting: the one response formatter both endpoints share (chunks, full answers);
- router.streaming: SSE frames, [DONE], in-band errors, client disconnects;
- router.config: `ServerConfig`, the limits, admission gates, deadlines and API keys it applies;
- router.limits: request bodies (size, JSON depth, finite numbers, UTF-8, content type), fields
  Baton cannot honour, and the configured limits on stop strings, logprobs and logit_bias;
- router.admission: a FIFO gate per pool with a bounded queue (429 beyond it) and deadlines;
- router.auth: API keys (`Authorization: Bearer`) on everything but /health, /metrics, /version;
- router.openapi: the OpenAPI schema of every route, request and response (schemathesis tests it);
- router.errors: the one exception handler. Every error a client sees uses the OpenAI envelope
  `{"error": {"message", "type", "param", "code"}}` with code = HTTP status: 400 for malformed
  JSON, schema errors (param = the field), empty messages, more choices (n x prompts) than
  `max_choices`, out-of-range sampling values
  and prompt + max_tokens over the context; 404 (type NotFoundError, as vLLM does) for an unknown
  model; 503 with Retry-After when a pool has no live worker; 500 for unexpected failures, never
  with a stack trace.

Observability: every request carries a `RequestTrace` (router.trace) that ends up in the app's
`RouterMetrics` (router.metrics): `GET /metrics` (Prometheus text), `GET /v1/status` (JSON) and
`GET /dashboard` (the operator page, router/static/dashboard.html, polling /v1/status).

Several router processes (`baton serve --api-server-count N`, cluster.router_procs) share one
port: `bind_socket(..., reuse_port=True)` binds each process's own listening socket with
SO_REUSEPORT, so the kernel spreads connections over them; every response names the process that
served it in the `x-baton-router` header (`router_id`).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import uvicorn
from fastapi import FastAPI

from router import __version__
from router.admission import LoadShedding
from router.auth import APIKeyMiddleware
from router.backend import ServingBackend
from router.config import ServerConfig
from router.errors import RETRY_AFTER_S, install_error_handlers
from router.metrics_merge import RouterExposition
from router.openapi import install_openapi
from router.routes import make_routes
from router.routing import RoundRobinPolicy, RoutingPolicy
from router.serving import COMPLETIONS_DEFAULT_MAX_TOKENS, Serving
from router.tokenizer import Tokenizer

__all__ = [
    "ROUTER_HEADER",
    "bind_socket",
    "build_app",
    "install_router_metrics",
    "make_server",
    "run_during_lifespan",
    "serve",
    "COMPLETIONS_DEFAULT_MAX_TOKENS",
    "RETRY_AFTER_S",
]

ROUTER_HEADER = "x-baton-router"  # on every response: the router process that served it

T = TypeVar("T")


def build_app(
    backend: ServingBackend,
    tokenizer: Tokenizer,
    model_name: str,
    max_model_len: int,
    policy: RoutingPolicy | None = None,
    server: ServerConfig | None = None,
    router_id: str | None = None,
) -> FastAPI:
    """The OpenAI-compatible app serving `model_name` through `backend`, with `server`'s limits and
    keys. A gate capacity left None here means no limit (`baton serve` fills it in from the pools).
    `router_id` names this router process in each response's x-baton-router header."""
    server = server or ServerConfig()
    serving = Serving(backend, tokenizer, model_name, max_model_len, policy or RoundRobinPolicy(), server)
    app = FastAPI(title="Baton router", version=__version__)
    app.state.baton = serving
    install_error_handlers(app)
    app.include_router(make_routes(serving))
    install_openapi(app, authenticated=bool(server.api_keys()))
    # Added first, so it runs inside the key check: a client without a key learns nothing of the load.
    app.add_middleware(
        LoadShedding, admission=serving.admission, paths=frozenset({"/v1/chat/completions", "/v1/completions"})
    )
    if server.api_keys():
        app.add_middleware(APIKeyMiddleware, keys=server.api_keys())
    if router_id is not None:
        app.add_middleware(RouterIdentity, router_id=router_id)  # outermost: refusals carry it too
    run_during_lifespan(
        app, lambda: asyncio.get_running_loop().create_task(serving.metrics.watch_event_loop()), asyncio.Task.cancel
    )
    return app


def install_router_metrics(app: FastAPI, router_id: str, folder: str | None) -> None:
    """With several router processes (`folder` shared by them): /metrics labels this router's
    series `router=<id>` and includes the other live routers' (router.metrics_merge). Without a
    folder (one router) nothing changes."""
    if folder is None:
        return
    metrics = app.state.baton.metrics
    metrics.exposition = RouterExposition(router_id, folder)
    run_during_lifespan(
        app,
        lambda: asyncio.get_running_loop().create_task(metrics.exposition.publish_every(metrics.registry)),
        asyncio.Task.cancel,
    )


def run_during_lifespan(app: FastAPI, start: Callable[[], T], stop: Callable[[T], Any]) -> None:
    """Extend the app's lifespan: `start()` once it has begun (on the server's event loop), and
    `stop(what start returned)` as it ends."""
    original = app.router.lifespan_context

    @contextlib.asynccontextmanager
    async def lifespan(a):
        async with original(a) as state:
            started = start()
            try:
                yield state
            finally:
                stop(started)

    app.router.lifespan_context = lifespan


class RouterIdentity:
    """ASGI middleware: every HTTP response says which router process served it."""

    def __init__(self, app, router_id: str) -> None:
        self.app = app
        self.header = (ROUTER_HEADER.encode(), router_id.encode())

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_with_header(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self.header]}
            await send(message)

        await self.app(scope, receive, send_with_header)


def bind_socket(host: str, port: int, reuse_port: bool = False) -> socket.socket:
    """A listening TCP socket on host:port. `reuse_port`: SO_REUSEPORT, so that several router
    processes, each binding its own, share the port (the kernel spreads connections over them)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        if not hasattr(socket, "SO_REUSEPORT"):
            raise ValueError("several router processes need SO_REUSEPORT, which this platform lacks")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.listen(2048)
    sock.set_inheritable(False)
    return sock


def make_server(app: FastAPI, host: str = "127.0.0.1", port: int = 8000, log_level: str = "warning", **kwargs: Any):
    """A uvicorn.Server for `app` (call .run(), or .serve() inside a loop; set .should_exit to stop)."""
    kwargs.setdefault("timeout_graceful_shutdown", 5)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, **kwargs)
    return uvicorn.Server(config)


def serve(
    app: FastAPI,
    host: str = "127.0.0.1",
    port: int = 8000,
    log_level: str = "info",
    sock: socket.socket | None = None,
    also: Sequence[socket.socket] = (),
    **kwargs: Any,
) -> None:
    """Run `app` with uvicorn until interrupted (binds 127.0.0.1 unless told otherwise; on `sock`,
    a socket bound already, e.g. by `bind_socket(..., reuse_port=True)`, when given). `also`: more
    bound sockets the same app answers on (router 0's private loopback port for the admin requests
    the other routers forward)."""
    if also and sock is None:
        raise ValueError("serving on more sockets needs the main one bound too (sock)")
    server = make_server(app, host=host, port=port, log_level=log_level, **kwargs)
    server.run(sockets=[sock, *also] if sock is not None else None)
