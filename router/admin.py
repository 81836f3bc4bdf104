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

With several router processes (`baton serve --api-server-count N`) the pools and this endpoint
belong to router 0; the others forward every `/admin/...` request to router 0's private loopback
port (`install_admin_forwarding`) after the same checks: the loopback rule must see the client
that sent the request, not the forwarding router (which is on loopback itself), and router 0
checks the token and the API key again on what it receives.
"""

from __future__ import annotations

import asyncio
import hmac
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from typing import Protocol

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from router.backend import WorkerInfo
from router.config import ADMIN_TOKEN_HEADER, AdminConfig
from router.protocol import APIError

__all__ = ["FORWARD_TIMEOUT_S", "PoolScaler", "PoolsView", "ScaleResult", "install_admin", "install_admin_forwarding"]

_LOOPBACK = frozenset({"127.0.0.1", "::1", "localhost"})
# A scaling waits for new workers to load (the pool manager's ready timeout, 300 s) and for drains.
FORWARD_TIMEOUT_S = 900.0
# What router 0 needs of a forwarded request: its body's type and the credentials it checks again.
_FORWARDED_HEADERS = frozenset({"content-type", "accept", "authorization", ADMIN_TOKEN_HEADER.lower()})
# No proxy from the environment (http_proxy) for a call to 127.0.0.1.
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


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
    def pools(self) -> PoolsView: ...

    async def scale(self, prefill: int | None, decode: int | None) -> ScaleResult:
        """Start or drain workers until the pools have these sizes (None: leave that pool);
        ValueError for sizes it refuses, RuntimeError when a worker fails to start."""
        ...


def _authorize(request: Request, token: str | None) -> None:
    if token is None:
        host = request.client.host if request.client else ""
        if host not in _LOOPBACK:
            raise APIError(
                "the admin endpoint answers loopback clients only (set an admin token to allow others)",
                403,
                None,
                "PermissionDeniedError",
            )
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


def _forward(
    url: str, method: str, body: bytes | None, headers: dict[str, str], timeout_s: float
) -> tuple[int, str | None, bytes]:
    """(status, content type, body) of router 0's answer (blocking: run in a thread)."""
    request = urllib.request.Request(url, data=body, headers=headers, method=method)
    try:
        with _DIRECT.open(request, timeout=timeout_s) as response:
            return response.status, response.headers.get("content-type"), response.read()
    except urllib.error.HTTPError as exc:  # router 0's own refusal (401, 409, ...): passed on as it is
        return exc.code, exc.headers.get("content-type"), exc.read()
    except (urllib.error.URLError, OSError) as exc:
        raise APIError(
            f"router 0, which runs the admin endpoint, did not answer: {getattr(exc, 'reason', exc)}",
            502,
            None,
            "BadGatewayError",
        ) from None


def install_admin_forwarding(
    app: FastAPI, config: AdminConfig, router0_url: str, timeout_s: float = FORWARD_TIMEOUT_S
) -> None:
    """Answer `/admin/...` on a router that does not own the pools by forwarding it to router 0
    at `router0_url` (its private loopback port), when the endpoint is enabled (else nothing: 404
    as on router 0). The admin checks run here first, on the client that sent it."""
    if not config.enabled:
        return
    routes = APIRouter(prefix="/admin")

    @routes.api_route("/{path:path}", methods=["GET", "POST"], include_in_schema=False)
    async def forward(path: str, request: Request) -> Response:
        _authorize(request, config.token)
        body = await request.body()
        headers = {k: v for k, v in request.headers.items() if k.lower() in _FORWARDED_HEADERS}
        url = f"{router0_url.rstrip('/')}/admin/{path}" + (f"?{request.url.query}" if request.url.query else "")
        status, content_type, content = await asyncio.to_thread(
            _forward, url, request.method, body or None, headers, timeout_s
        )
        return Response(content, status_code=status, media_type=content_type)

    app.include_router(routes)
