"""Every failure a client sees, as the OpenAI error envelope `{"error": {"message", "type", "param", "code"}}`.

`to_api_error` maps an exception to an `APIError` (status, param, headers); `install_error_handlers`
registers one handler for every exception class the app can raise, so routes just raise. Streams
that already sent their headers use `to_api_error` to report the failure in-band.
"""

from __future__ import annotations

import logging
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from common.protocol import GrammarCompileError
from router.backend import BackendError
from router.protocol import APIError
from router.routing import NoWorkerAvailable

__all__ = ["RETRY_AFTER_S", "install_error_handlers", "to_api_error"]

logger = logging.getLogger("baton.router")

RETRY_AFTER_S = 1  # what 503 answers tell clients to wait before retrying


def _retry_after() -> dict[str, str]:
    return {"Retry-After": str(RETRY_AFTER_S)}


def to_api_error(e: BaseException, where: str, log_traceback: bool = True) -> APIError:
    """The client-facing error for `e`; `where` (a request id or route) goes to the log only."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, ClientDisconnect):  # the client left while its body was being read: nothing to log
        return APIError("the client closed the request", 499, None, "ClientClosedRequest")
    if isinstance(e, GrammarCompileError):  # bad input the workers found (router.serving names the field)
        return APIError(str(e), 400, None)
    if isinstance(e, NoWorkerAvailable):
        return APIError(str(e), 503, None, headers=_retry_after())
    if isinstance(e, BackendError):
        logger.error("%s failed in the backend: %s", where, e)
        message = f"the worker pool failed this request: {e}"
        return APIError(message, 503, None, headers=_retry_after()) if e.retryable else APIError(message, 500, None)
    if isinstance(e, StarletteHTTPException):
        return APIError(str(e.detail), e.status_code, None, headers=getattr(e, "headers", None))
    if isinstance(e, RequestValidationError):
        errors = e.errors()
        first = errors[0] if errors else {}
        param = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or None
        msg = first.get("msg", "invalid request")
        return APIError(f"{param}: {msg}" if param else msg, 400, param)
    error_id = uuid.uuid4().hex[:12]
    logger.error("%s failed (error id %s): %r", where, error_id, e, exc_info=e if log_traceback else None)
    return APIError(f"internal server error (error id {error_id}; details are in the router log)", 500, None)


async def _handle(request: Request, exc: Exception) -> JSONResponse:
    # Starlette re-raises what reaches the catch-all after answering, and the server logs that
    # traceback: log only the error id here.
    e = to_api_error(exc, f"{request.method} {request.url.path}", log_traceback=False)
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def install_error_handlers(app: FastAPI) -> None:
    for exc_class in (
        APIError,
        ClientDisconnect,
        NoWorkerAvailable,
        BackendError,
        RequestValidationError,
        StarletteHTTPException,
        Exception,
    ):
        app.add_exception_handler(exc_class, _handle)
