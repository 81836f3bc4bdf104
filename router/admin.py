"""The admin endpoint: the pools' sizes, and scaling them at runtime (what `baton scale` calls).

    GET  /admin/pools                           -> PoolsView: target sizes and every worker
    POST /admin/scale {"prefill": N, "decode": M} -> ScaleResult, once the pools have that size

Off by default (`--admin-endpoint` turns it on; without it the routes do not exist: 404). It
changes what the server runs, so it is protected twice over: without an admin token it answers
loopback clients only (403 for anyone else); with one (`--admin-token`, or BATON_ADMIN_TOKEN),
every client must send it as `X-Baton-Admin-Token` (401 otherwise), compared in constant time.
API keys, when configured, are still required on top (router.auth), which is why the token has a
header of its own. One scaling at a time: a second one while the first runs gets 409.

The router does not create actors: `PoolScaler` is whatever does (cluster.pool_manager).
"""

from __future__ import annotations

import asyncio
import hmac
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Protocol

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse

from router.protocol import APIError

__all__ = ["ADMIN_TOKEN_ENV", "ADMIN_TOKEN_HEADER", "AdminConfig", "PoolScaler", "PoolsView", "ScaleResult",
           "install_admin"]

ADMIN_TOKEN_ENV = "BATON_ADMIN_TOKEN"
ADMIN_TOKEN_HEADER = "X-Baton-Admin-Token"
_LOOPBACK = frozenset({"127.0.0.1", "::1", "localhost"})


@dataclass
class AdminConfig:
    """The admin endpoint (`baton scale`): off by default, loopback only unless a token is set."""

    enabled: bool = field(default=False, metadata={
        "flag": "admin_endpoint",
        "help": "serve GET /admin/pools and POST /admin/scale (`baton scale`); answers loopback clients only, "
                "unless admin_token is set"})
    # repr=False: the configuration may be printed or logged; the token must not be.
    token: str | None = field(default=None, repr=False, metadata={
        "flag": "admin_token",
        "help": f"token every /admin request must carry as `{ADMIN_TOKEN_HEADER}: TOKEN`; with it, clients on any "
                f"address may scale (default: the {ADMIN_TOKEN_ENV} environment variable, else loopback only)"})

    def __post_init__(self) -> None:
        if self.token is not None and not self.token.strip():
            raise ValueError("admin_token must not be empty")

    def with_token_from_env(self, environ: Mapping[str, str] | None = None) -> "AdminConfig":
        environ = os.environ if environ is None else environ
        if self.token is not None or not environ.get(ADMIN_TOKEN_ENV, "").strip():
            return self
        return replace(self, token=environ[ADMIN_TOKEN_ENV].strip())


@dataclass(frozen=True)
class WorkerView:
    worker_id: str
    role: str
    alive: bool
    draining: bool
    in_flight: int


@dataclass(frozen=True)
class PoolsView:
    """Target sizes (what the last scaling asked for) and the workers serving now."""

    prefill: int
    decode: int
    workers: list[WorkerView]


@dataclass(frozen=True)
class ScaleResult:
    """What a scaling did: sizes before and after, workers started and removed, requests moved."""

    before: dict[str, int]
    after: dict[str, int]
    added: list[str]
    removed: list[str]
    moved_requests: int
    seconds: float


class PoolScaler(Protocol):
    def pools(self) -> PoolsView:
        ...

    async def scale(self, prefill: int | None, decode: int | None) -> ScaleResult:
        """Start or drain workers until the pools have these sizes (None: leave that pool);
        ValueError for sizes it refuses, RuntimeError when a worker fails to start."""
        ...


def _authorize(request: Request, token: str | None) -> None:
    if token is None:
        host = request.client.host if request.client else ""
        if host not in _LOOPBACK:
            raise APIError("the admin endpoint answers loopback clients only (set an admin token to allow others)",
                           403, None, "PermissionDeniedError")
        return
    sent = request.headers.get(ADMIN_TOKEN_HEADER)
    if sent is None or not hmac.compare_digest(sent.encode(), token.encode()):
        raise APIError(f"send the admin token as `{ADMIN_TOKEN_HEADER}: TOKEN`", 401, None, "AuthenticationError")


def _size(body: dict, name: str) -> int | None:
    value = body.get(name)
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
        raise APIError(f"{name} must be a non-negative integer, got {value!r}", 400, name)
    return value


def make_admin_routes(scaler: PoolScaler, config: AdminConfig) -> APIRouter:
    routes = APIRouter(prefix="/admin")
    busy = asyncio.Lock()

    @routes.get("/pools")
    async def pools(request: Request) -> JSONResponse:
        _authorize(request, config.token)
        return JSONResponse(asdict(scaler.pools()))

    @routes.post("/scale")
    async def scale(request: Request) -> JSONResponse:
        _authorize(request, config.token)
        try:
            body = await request.json()
        except ValueError:
            raise APIError("request body is not valid JSON", 400, None) from None
        if not isinstance(body, dict) or not set(body) <= {"prefill", "decode"}:
            raise APIError('body must be a JSON object like {"prefill": 2, "decode": 3}', 400, None)
        prefill, decode = _size(body, "prefill"), _size(body, "decode")
        if busy.locked():
            raise APIError("another scaling is in progress; retry when it has finished", 409, None, "ConflictError")
        async with busy:
            try:
                result = await scaler.scale(prefill, decode)
            except ValueError as exc:
                raise APIError(str(exc), 400, None) from None
            except RuntimeError as exc:
                raise APIError(f"scaling failed: {exc}", 500, None) from None
        return JSONResponse(asdict(result))

    return routes


def install_admin(app: FastAPI, scaler: PoolScaler, config: AdminConfig) -> None:
    """Add the admin routes to `app` when the endpoint is enabled (else nothing: the routes 404)."""
    if config.enabled:
        app.include_router(make_admin_routes(scaler, config))
