"""The HTTP routes: thin handlers that hand each request to `Serving` and wrap its answer.

Handlers only raise; router.errors turns every exception into the OpenAI error envelope.
"""

from __future__ import annotations

import time
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from common import envs
from router import __version__
from router.errors import RETRY_AFTER_S
from router.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from router.serving import Serving

__all__ = ["make_routes"]

_DASHBOARD = Path(__file__).parent / "static" / "dashboard.html"


def make_routes(serving: Serving) -> APIRouter:
    routes = APIRouter()
    dashboard_html = _DASHBOARD.read_bytes()

    @routes.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await serving.chat(request, started=time.perf_counter())

    @routes.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await serving.completion(request, started=time.perf_counter())

    @routes.get("/v1/models")
    async def list_models() -> Response:
        return JSONResponse(serving.models())

    if envs.BATON_ALLOW_RUNTIME_LORA_UPDATING.get() in ("1", "true", "True"):

        @routes.post("/v1/load_lora_adapter")
        async def load_lora_adapter(request: Request) -> Response:
            return PlainTextResponse(await serving.load_lora_adapter(request))

        @routes.post("/v1/unload_lora_adapter")
        async def unload_lora_adapter(request: Request) -> Response:
            return PlainTextResponse(await serving.unload_lora_adapter(request))

    @routes.get("/health")
    async def health() -> Response:
        status, body = serving.health()
        headers = {"Retry-After": str(RETRY_AFTER_S)} if status == 503 else None
        return JSONResponse(body, status_code=status, headers=headers)

    @routes.get("/version")
    async def version() -> Response:
        return JSONResponse({"version": __version__})

    @routes.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        return JSONResponse(await serving.tokenize(request))

    @routes.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        return JSONResponse(await serving.detokenize(request))

    @routes.get("/metrics")
    async def metrics() -> Response:
        return Response(serving.metrics.render(), media_type=METRICS_CONTENT_TYPE)

    @routes.get("/v1/status")
    async def status() -> Response:
        return JSONResponse(serving.metrics.status())

    @routes.get("/dashboard")
    async def dashboard() -> Response:
        return Response(dashboard_html, media_type="text/html; charset=utf-8", headers={"Cache-Control": "no-cache"})

    return routes
