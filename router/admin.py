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
from dataclasses import asdict, dataclass
from typing import Protocol

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse

from router.backend import WorkerInfo
from router.config import ADMIN_TOKEN_HEADER, AdminConfig
from router.protocol import APIError

__all__ = ["PoolScaler", "PoolsView", "ScaleResult",
           "install_admin"]

_LOOPBACK = frozenset({"127.0.0.1", "::1", "localhost"})


@dataclass(frozen=True)
class PoolsView:
    """Target sizes (what the last scaling asked for) and the workers serving now."""

    prefill: int
    decode: int
    workers: list[WorkerInfo]


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
