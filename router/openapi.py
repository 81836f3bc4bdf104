"""The app's OpenAPI schema: every route's request body and every answer it can give.

The routes read their bodies themselves (for the limits of router.limits), so FastAPI cannot see
their schemas; this module documents them from the same pydantic models that validate requests
and describe responses, with each route's error statuses and the OpenAI error envelope. Clients
generate code from it and schemathesis checks the app against it (tests/hardening).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import JsonSchemaMode

from router.protocol import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    ModelList,
    TokenizeRequest,
)

__all__ = ["install_openapi"]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: int


class ErrorResponse(BaseModel):
    """The OpenAI error envelope; code is the HTTP status."""

    error: ErrorDetail


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str


class HealthResponse(BaseModel):
    status: str
    live_workers: dict[str, int]


_ERROR_MEANINGS = {
    400: "Invalid request: malformed or oversized body, a field out of range or unsupported (param names it), "
    "prompt plus max_tokens over the context",
    401: "Missing or invalid API key (only when the server has keys)",
    404: "Unknown model",
    429: "Overloaded: the pool's waiting queue is full (Retry-After says when to retry)",
    500: "Internal error (the message holds an error id; details are in the router's log)",
    503: "No live worker in a pool, or the request's deadline passed while it waited (Retry-After)",
    504: "The request ran past its deadline and was stopped",
}
_GENERATION_ERRORS = (400, 401, 404, 429, 500, 503, 504)


def install_openapi(app: FastAPI, authenticated: bool) -> None:
    """Replace the app's schema generator; `authenticated` documents the bearer key requirement."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = build_schema(app, authenticated)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI's documented way to replace the schema


def build_schema(app: FastAPI, authenticated: bool) -> dict[str, Any]:
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    components: dict[str, Any] = schema.setdefault("components", {}).setdefault("schemas", {})

    def ref(model: type[BaseModel], mode: JsonSchemaMode = "serialization") -> dict[str, Any]:
        js = model.model_json_schema(ref_template="#/components/schemas/{model}", mode=mode)
        components.update(js.pop("$defs", {}))
        components[model.__name__] = js
        return {"$ref": f"#/components/schemas/{model.__name__}"}

    def json_body(model: type[BaseModel]) -> dict[str, Any]:
        return {"required": True, "content": {"application/json": {"schema": ref(model, "validation")}}}

    def answer(description: str, content: dict[str, Any]) -> dict[str, Any]:
        return {"description": description, "content": content}

    def errors(*statuses: int) -> dict[str, Any]:
        error = {"application/json": {"schema": ref(ErrorResponse)}}
        return {str(s): answer(_ERROR_MEANINGS[s], error) for s in statuses}

    def json(model: type[BaseModel] | None) -> dict[str, Any]:
        return {"application/json": {"schema": ref(model) if model else {"type": "object"}}}

    def event_stream(chunk: type[BaseModel]) -> dict[str, Any]:
        # One schema per server-sent event, as OpenAPI 3.2 and schemathesis read text/event-stream:
        # `data` holds a chunk (or an in-band error) as JSON, and the last event holds `[DONE]`.
        chunk_or_error = {"anyOf": [ref(chunk), ref(ErrorResponse)]}
        json_data = {"properties": {"data": {"contentMediaType": "application/json", "contentSchema": chunk_or_error}}}
        return {
            "text/event-stream": {
                "schema": {
                    "type": "object",
                    "required": ["data"],
                    "description": "`data: <chunk JSON>` events (an error event if generation fails), "
                    "then `data: [DONE]`",
                    "properties": {"data": {"type": "string"}, "event": {"type": "string"}},
                    "if": {"properties": {"data": {"const": "[DONE]"}}},
                    "then": {},
                    "else": json_data,
                }
            }
        }

    open_errors = (500,)
    keyed = (401,) if authenticated else ()
    operations: dict[tuple[str, str], dict[str, Any]] = {
        ("/v1/chat/completions", "post"): {
            "requestBody": json_body(ChatCompletionRequest),
            "responses": {
                "200": answer(
                    "The completion, or its event stream when stream is true",
                    {**json(ChatCompletionResponse), **event_stream(ChatCompletionChunk)},
                ),
                **errors(*_GENERATION_ERRORS),
            },
        },
        ("/v1/completions", "post"): {
            "requestBody": json_body(CompletionRequest),
            "responses": {
                "200": answer(
                    "The completion, or its event stream when stream is true",
                    {**json(CompletionResponse), **event_stream(CompletionResponse)},
                ),
                **errors(*_GENERATION_ERRORS),
            },
        },
        ("/v1/models", "get"): {
            "responses": {"200": answer("The served model", json(ModelList)), **errors(*keyed, 500)}
        },
        ("/tokenize", "post"): {
            "requestBody": json_body(TokenizeRequest),
            "responses": {"200": answer("Token ids", json(TokenizeResponse)), **errors(400, *keyed, 404, 500)},
        },
        ("/detokenize", "post"): {
            "requestBody": json_body(DetokenizeRequest),
            "responses": {"200": answer("Text", json(DetokenizeResponse)), **errors(400, *keyed, 404, 500)},
        },
        ("/health", "get"): {
            "responses": {
                "200": answer("Every pool has a live worker", json(HealthResponse)),
                "503": answer("A pool has no live worker", json(None)),
                **errors(*open_errors),
            }
        },
        ("/version", "get"): {"responses": {"200": answer("The router's version", json(VersionResponse))}},
        ("/metrics", "get"): {
            "responses": {
                "200": answer("Prometheus metrics", {"text/plain": {"schema": {"type": "string"}}}),
                **errors(*open_errors),
            }
        },
        ("/v1/status", "get"): {
            "responses": {
                "200": answer("Pools, admission, latency window and recent requests", json(None)),
                **errors(*keyed, 500),
            }
        },
        ("/dashboard", "get"): {
            "responses": {
                "200": answer("The operator page", {"text/html": {"schema": {"type": "string"}}}),
                **errors(*keyed),
            }
        },
    }
    for (path, method), spec in operations.items():
        operation = schema["paths"][path][method]
        operation.pop("requestBody", None)
        operation.update(spec)
        if authenticated and (path, method) not in (("/health", "get"), ("/version", "get"), ("/metrics", "get")):
            operation["security"] = [{"bearer": []}]
    if authenticated:
        schema["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    return schema
