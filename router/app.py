"""The OpenAI-compatible HTTP API (FastAPI + uvicorn) in front of a `ServingBackend`.

`build_app(backend, tokenizer, model_name, max_model_len, policy)` returns the FastAPI app;
`serve(app, host, port)` runs it with uvicorn on 127.0.0.1 by default.

Every error a client sees uses the OpenAI envelope `{"error": {"message", "type", "param", "code"}}`
with code = HTTP status: 400 for malformed JSON, schema errors (param = the field), empty
messages, n != 1, out-of-range sampling values and prompt + max_tokens over the context; 404
(type NotFoundError, as vLLM does) for an unknown model; 503 with Retry-After when a pool has no
live worker; 500 for unexpected failures, never with a stack trace.

Streaming sends `data: <chunk JSON>\\n\\n` frames straight from the backend's async generator (no
polling, no per-token sleeps) and ends with `data: [DONE]\\n\\n`. A client that disconnects, while
streaming or while waiting for a non-streamed answer, gets its request aborted in the backend.

Observability: every request carries a `RequestTrace` (router.trace) that ends up in the app's
`RouterMetrics` (router.metrics): `GET /metrics` (Prometheus text), `GET /v1/status` (JSON) and
`GET /dashboard` (the operator page, router/static/dashboard.html, polling /v1/status).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Callable

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from router import __version__
from router.backend import BackendError, GenerateRequest, ServingBackend
from router.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from router.metrics import RouterMetrics
from router.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    check_chat_extras,
    check_common,
    check_completion_extras,
    error_body,
    to_sampling_params,
    validation_error_to_api,
)
from router.routing import NoWorkerAvailable, RoundRobinPolicy, RoutingPolicy, live_workers
from router.tokenizer import ChatTemplateError, Tokenizer
from router.trace import RequestTrace
from workers.protocol import RequestOutput, TokenLogprob
from workers.sampling_params import SamplingParams

__all__ = ["build_app", "make_server", "serve", "COMPLETIONS_DEFAULT_MAX_TOKENS", "RETRY_AFTER_S"]

logger = logging.getLogger("baton.router")

# OpenAI's and vLLM's default for the legacy /v1/completions endpoint. Chat requests without a
# limit may use the whole remaining context (max_model_len - prompt tokens).
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
RETRY_AFTER_S = 1

_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
_DONE = "data: [DONE]\n\n"


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def _error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


class _ClientGone(Exception):
    """The client disconnected before the answer was ready."""


# --------------------------------------------------------------------------- accounting


@dataclass
class _Accumulator:
    """What a request produced so far: for usage and for non-streamed answers."""

    num_prompt_tokens: int
    completion_tokens: int = 0
    cached_tokens: int = 0
    text_parts: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None

    def add(self, out: RequestOutput, keep: bool) -> None:
        self.completion_tokens += len(out.token_ids)
        if out.num_cached_tokens > self.cached_tokens:
            self.cached_tokens = out.num_cached_tokens
        if keep:
            if out.text:
                self.text_parts.append(out.text)
            if out.logprobs:
                self.logprobs.extend(out.logprobs)
        if out.finished:
            self.finish_reason = out.finish_reason or "stop"

    def usage(self) -> dict:
        return {
            "prompt_tokens": self.num_prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.num_prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


# --------------------------------------------------------------------------- response formats


class _Format:
    """Builds the chunks and the full response of one endpoint (chat or text completion)."""

    object_full: str
    object_chunk: str

    def __init__(self, tokenizer: Tokenizer, request_id: str, model: str, created: int, include_usage: bool,
                 continuous_usage: bool, logprobs: bool) -> None:
        self.tok = tokenizer
        self.request_id = request_id
        self.model = model
        self.created = created
        self.include_usage = include_usage
        self.continuous_usage = continuous_usage and include_usage
        self.want_logprobs = logprobs
        # Everything before the choices is the same in every chunk: build it once.
        self._prefix = (
            f'data: {{"id":{_dumps(request_id)},"object":"{self.object_chunk}","created":{created},'
            f'"model":{_dumps(model)},"choices":['
        )
        self._suffix = '],"usage":null}\n\n' if include_usage else "]}\n\n"

    def _frame(self, choice: dict, acc: _Accumulator) -> str:
        suffix = f'],"usage":{_dumps(acc.usage())}}}\n\n' if self.continuous_usage else self._suffix
        return self._prefix + _dumps(choice) + suffix

    def usage_frame(self, acc: _Accumulator) -> str:
        return self._prefix + '],"usage":' + _dumps(acc.usage()) + "}\n\n"

    def first_frame(self, acc: _Accumulator) -> str | None:
        return None

    def chunk(self, out: RequestOutput, acc: _Accumulator) -> str | None:
        raise NotImplementedError

    def full(self, acc: _Accumulator) -> dict:
        raise NotImplementedError


class _ChatFormat(_Format):
    object_full = "chat.completion"
    object_chunk = "chat.completion.chunk"

    def _logprobs(self, lps: list[TokenLogprob] | None) -> dict | None:
        if not self.want_logprobs:
            return None
        tok = self.tok
        content = []
        for lp in lps or ():
            content.append(
                {
                    "token": tok.token_text(lp.token_id),
                    "logprob": lp.logprob,
                    "bytes": list(tok.token_bytes(lp.token_id)),
                    "top_logprobs": [
                        {"token": tok.token_text(t), "logprob": l, "bytes": list(tok.token_bytes(t))} for t, l in lp.top
                    ],
                }
            )
        return {"content": content}

    def first_frame(self, acc: _Accumulator) -> str:
        choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        return self._frame(choice, acc)

    def chunk(self, out: RequestOutput, acc: _Accumulator) -> str | None:
        if not out.text and not out.finished and not (self.want_logprobs and out.logprobs):
            return None  # e.g. half a UTF-8 character: nothing to show yet
        choice = {
            "index": 0,
            "delta": {"content": out.text} if out.text or not out.finished else {},
            "logprobs": self._logprobs(out.logprobs) if out.logprobs else None,
            "finish_reason": (out.finish_reason or "stop") if out.finished else None,
        }
        return self._frame(choice, acc)

    def full(self, acc: _Accumulator) -> dict:
        return {
            "id": self.request_id,
            "object": self.object_full,
            "created": self.created,
            "model": self.model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "".join(acc.text_parts)},
                    "logprobs": self._logprobs(acc.logprobs),
                    "finish_reason": acc.finish_reason,
                }
            ],
            "usage": acc.usage(),
        }


class _CompletionFormat(_Format):
    object_full = "text_completion"
    object_chunk = "text_completion"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._offset = 0  # text_offset of the next token, across stream chunks

    def _logprobs(self, lps: list[TokenLogprob] | None) -> dict | None:
        if not self.want_logprobs:
            return None
        tok = self.tok
        tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
        for lp in lps or ():
            text = tok.token_text(lp.token_id)
            tokens.append(text)
            token_logprobs.append(lp.logprob)
            top_logprobs.append({tok.token_text(t): l for t, l in lp.top})
            text_offset.append(self._offset)
            self._offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": text_offset}

    def chunk(self, out: RequestOutput, acc: _Accumulator) -> str | None:
        if not out.text and not out.finished and not (self.want_logprobs and out.logprobs):
            return None
        choice = {
            "index": 0,
            "text": out.text,
            "logprobs": self._logprobs(out.logprobs) if out.logprobs else None,
            "finish_reason": (out.finish_reason or "stop") if out.finished else None,
        }
        return self._frame(choice, acc)

    def full(self, acc: _Accumulator) -> dict:
        return {
            "id": self.request_id,
            "object": self.object_full,
            "created": self.created,
            "model": self.model,
            "choices": [
                {
                    "index": 0,
                    "text": "".join(acc.text_parts),
                    "logprobs": self._logprobs(acc.logprobs),
                    "finish_reason": acc.finish_reason,
                }
            ],
            "usage": acc.usage(),
        }


# --------------------------------------------------------------------------- disconnect watching


async def _wait_for_disconnect(request: Request) -> None:
    # The body is already read, so the next ASGI message is http.disconnect (the client left, or
    # the server finished the response). Event-driven: no polling.
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _await_unless_disconnected(request: Request, awaitable: Any) -> Any:
    """Await `awaitable`; raise _ClientGone (after cancelling it) if the client disconnects first."""
    task = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    try:
        await task
    except BaseException:
        pass
    raise _ClientGone()


# --------------------------------------------------------------------------- the server


class _Server:
    def __init__(self, backend: ServingBackend, tokenizer: Tokenizer, model_name: str, max_model_len: int,
                 policy: RoutingPolicy) -> None:
        self.backend = backend
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.policy = policy
        self.created = int(time.time())
        self.metrics = RouterMetrics(model_name, backend)

    # -- request parsing
    @staticmethod
    async def read_json(request: Request) -> Any:
        raw = await request.body()
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(f"request body is not valid JSON: {e}", 400, None) from None

    @staticmethod
    def parse(model: type[BaseModel], body: Any) -> Any:
        if not isinstance(body, dict):
            raise APIError("request body must be a JSON object", 400, None)
        try:
            return model.model_validate(body)
        except ValidationError as e:
            raise validation_error_to_api(e) from None

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(
                f"The model `{name}` does not exist. This server serves `{self.model_name}`.", 404, "model", "NotFoundError"
            )

    def resolve_max_tokens(self, num_prompt: int, requested: int | None, field_name: str, prompt_param: str,
                           default: int | None = None) -> int:
        limit = self.max_model_len
        if num_prompt >= limit:
            raise APIError(
                f"This model's maximum context length is {limit} tokens. However, your prompt has {num_prompt} tokens, "
                f"which leaves no room for any output. Please reduce the length of the prompt.",
                400,
                prompt_param,
            )
        if requested is None:
            room = limit - num_prompt
            return room if default is None else min(default, room)
        if num_prompt + requested > limit:
            raise APIError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{num_prompt + requested} tokens ({num_prompt} in the prompt, {requested} in {field_name}). "
                f"Please reduce the length of the prompt or {field_name}.",
                400,
                field_name,
            )
        return requested

    def completion_prompt_ids(self, req: CompletionRequest) -> list[int]:
        prompt: Any = req.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise APIError(
                    f"batched prompts ({len(prompt)} prompts) are not supported: send one prompt per request", 400, "prompt"
                )
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt, add_special_tokens=req.add_special_tokens)
        else:
            ids = list(prompt)
            bad = next((t for t in ids if not self.tokenizer.is_valid_id(t)), None)
            if bad is not None:
                raise APIError(
                    f"prompt token id {bad} is out of range [0, {self.tokenizer.vocab_size})", 400, "prompt"
                )
        if not ids:
            raise APIError("prompt must not be empty", 400, "prompt")
        return ids

    def chat_prompt_ids(self, req: ChatCompletionRequest | TokenizeRequest, add_special_tokens: bool = False) -> list[int]:
        messages = req.template_messages() if isinstance(req, ChatCompletionRequest) else _template_messages(req)
        try:
            text = self.tokenizer.render_chat(
                messages, add_generation_prompt=req.add_generation_prompt, tools=getattr(req, "tools", None)
            )
        except ChatTemplateError as e:
            raise APIError(str(e), 400, "messages") from None
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    # -- generation
    async def generate(
        self,
        request: Request,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        stream: bool,
        fmt: _Format,
        started: float | None = None,
    ) -> Response:
        trace = RequestTrace(request_id, len(prompt_ids))
        if started is not None:
            trace.started = started  # arrival at the router, before parsing and tokenizing
        route = self.policy.choose(prompt_ids, self.backend.workers())
        trace.set_route(route)
        outputs = self._traced(self.backend.generate(GenerateRequest(request_id, prompt_ids, params, route, trace)), trace)
        acc = _Accumulator(num_prompt_tokens=len(prompt_ids))
        headers = {"X-Request-Id": request_id}
        if not stream:
            try:
                await _await_unless_disconnected(request, self._collect(outputs, acc))
            except _ClientGone:
                await self._abort(request_id, outputs)
                return Response(status_code=499)
            except BaseException:
                await self._abort(request_id, outputs)
                raise
            return JSONResponse(fmt.full(acc), headers=headers)
        # Streaming: wait for the first output before sending headers, so that failures before
        # the first token still get a proper status code.
        try:
            first = await _await_unless_disconnected(request, outputs.__anext__())
        except StopAsyncIteration:
            first = RequestOutput(request_id, [], finished=True, finish_reason="abort")
        except _ClientGone:
            await self._abort(request_id, outputs)
            return Response(status_code=499)
        except BaseException:
            await self._abort(request_id, outputs)
            raise
        return StreamingResponse(
            self._stream(request_id, outputs, first, fmt, acc),
            media_type="text/event-stream",
            headers={**_SSE_HEADERS, **headers},
        )

    async def _traced(self, outputs: AsyncIterator[RequestOutput], trace: RequestTrace) -> AsyncIterator[RequestOutput]:
        """Pass outputs through, timing tokens; record the trace however the request ends."""
        finish_reason, error = None, None
        try:
            async for out in outputs:
                trace.token(len(out.token_ids))
                if out.finished:
                    finish_reason = out.finish_reason or "stop"
                yield out
        except Exception as e:
            error = str(e) or type(e).__name__
            raise
        finally:
            try:
                await outputs.aclose()
            finally:
                trace.finish(finish_reason or "abort", error)
                self.metrics.observe(trace)

    @staticmethod
    async def _collect(outputs: AsyncIterator[RequestOutput], acc: _Accumulator) -> None:
        try:
            async for out in outputs:
                acc.add(out, keep=True)
                if out.finished:
                    return
            if acc.finish_reason is None:
                acc.finish_reason = "abort"
        finally:
            await outputs.aclose()  # let the backend run its cleanup now, not at garbage collection

    async def _abort(self, request_id: str, outputs: Any) -> None:
        # Shielded: this runs while the handler is being cancelled (client gone).
        with anyio.CancelScope(shield=True):
            try:
                await self.backend.abort(request_id)
            except Exception:
                logger.exception("abort of %s failed", request_id)
            try:
                await outputs.aclose()
            except BaseException:
                pass

    async def _stream(
        self, request_id: str, outputs: AsyncIterator[RequestOutput], first: RequestOutput, fmt: _Format,
        acc: _Accumulator,
    ) -> AsyncIterator[str]:
        finished = False
        try:
            acc.add(first, keep=False)
            frame = fmt.first_frame(acc)
            if frame is not None:
                yield frame
            out = first
            while True:
                frame = fmt.chunk(out, acc)
                if frame is not None:
                    yield frame
                if out.finished:
                    break
                try:
                    out = await outputs.__anext__()
                except StopAsyncIteration:
                    out = RequestOutput(request_id, [], finished=True, finish_reason="abort")
                acc.add(out, keep=False)
            finished = True
            await outputs.aclose()
            if fmt.include_usage:
                yield fmt.usage_frame(acc)
            yield _DONE
        except Exception as e:  # a backend failure mid-stream: headers are gone, so say it in-band
            api = _to_api_error(e, request_id)
            yield "data: " + _dumps(api.body()) + "\n\n"
            yield _DONE
        finally:
            if not finished:  # client gone (cancelled) or the backend failed
                await self._abort(request_id, outputs)


def _template_messages(req: TokenizeRequest) -> list[dict]:
    return ChatCompletionRequest.model_construct(messages=req.messages or []).template_messages()


def _to_api_error(e: BaseException, request_id: str) -> APIError:
    if isinstance(e, APIError):
        return e
    if isinstance(e, NoWorkerAvailable):
        return APIError(str(e), 503, None, headers={"Retry-After": str(RETRY_AFTER_S)})
    if isinstance(e, BackendError):
        logger.error("request %s failed in the backend: %s", request_id, e)
        if e.retryable:
            return APIError(f"the worker pool failed this request: {e}", 503, None, headers={"Retry-After": str(RETRY_AFTER_S)})
        return APIError(f"the worker pool failed this request: {e}", 500, None)
    error_id = uuid.uuid4().hex[:12]
    logger.error("request %s failed (error id %s)", request_id, error_id, exc_info=e)
    return APIError(f"internal server error (error id {error_id}; details are in the router log)", 500, None)


def _handler(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap an endpoint so every failure becomes an OpenAI error envelope (never a stack trace)."""

    async def wrapped(request: Request) -> Response:
        try:
            return await fn(request)
        except Exception as e:
            return _error_response(_to_api_error(e, f"{request.method} {request.url.path}"))

    wrapped.__name__ = fn.__name__
    wrapped.__doc__ = fn.__doc__
    return wrapped


# --------------------------------------------------------------------------- app


def build_app(
    backend: ServingBackend,
    tokenizer: Tokenizer,
    model_name: str,
    max_model_len: int,
    policy: RoutingPolicy | None = None,
) -> FastAPI:
    """The OpenAI-compatible app serving `model_name` through `backend`."""
    server = _Server(backend, tokenizer, model_name, max_model_len, policy or RoundRobinPolicy())
    app = FastAPI(title="Baton router", version=__version__)
    app.state.baton = server

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(
            error_body(str(exc.detail), exc.status_code), status_code=exc.status_code, headers=getattr(exc, "headers", None)
        )

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        loc = [p for p in (errors[0].get("loc", ()) if errors else ()) if p != "body"]
        param = ".".join(str(p) for p in loc) or None
        msg = errors[0].get("msg", "invalid request") if errors else "invalid request"
        return JSONResponse(error_body(f"{param}: {msg}" if param else msg, 400, param), status_code=400)

    @_handler
    async def chat_completions(request: Request) -> Response:
        started = time.perf_counter()
        req: ChatCompletionRequest = server.parse(ChatCompletionRequest, await server.read_json(request))
        server.check_model(req.model)
        check_common(req)
        check_chat_extras(req)
        prompt_ids = server.chat_prompt_ids(req)
        requested, field_name = req.requested_max_tokens()
        max_tokens = server.resolve_max_tokens(len(prompt_ids), requested, field_name, "messages")
        params = to_sampling_params(req, max_tokens, max_tokens_field=field_name)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        opts = req.stream_options
        fmt = _ChatFormat(
            tokenizer, request_id, req.model or model_name, int(time.time()),
            include_usage=bool(req.stream and opts and opts.include_usage),
            continuous_usage=bool(opts and opts.continuous_usage_stats), logprobs=req.logprobs,
        )
        return await server.generate(request, request_id, prompt_ids, params, req.stream, fmt, started)

    @_handler
    async def completions(request: Request) -> Response:
        started = time.perf_counter()
        req: CompletionRequest = server.parse(CompletionRequest, await server.read_json(request))
        server.check_model(req.model)
        check_common(req)
        check_completion_extras(req)
        prompt_ids = server.completion_prompt_ids(req)
        max_tokens = server.resolve_max_tokens(
            len(prompt_ids), req.max_tokens, "max_tokens", "prompt", default=COMPLETIONS_DEFAULT_MAX_TOKENS
        )
        params = to_sampling_params(req, max_tokens)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        opts = req.stream_options
        fmt = _CompletionFormat(
            tokenizer, request_id, req.model or model_name, int(time.time()),
            include_usage=bool(req.stream and opts and opts.include_usage),
            continuous_usage=bool(opts and opts.continuous_usage_stats), logprobs=req.logprobs is not None,
        )
        return await server.generate(request, request_id, prompt_ids, params, req.stream, fmt, started)

    @_handler
    async def list_models(request: Request) -> Response:
        card = {"id": model_name, "object": "model", "created": server.created, "owned_by": "baton",
                "max_model_len": max_model_len}
        return JSONResponse({"object": "list", "data": [card]})

    @_handler
    async def health(request: Request) -> Response:
        workers = backend.workers()
        live = {role: len(live_workers(workers, role)) for role in ("prefill", "decode")}
        missing = [role for role, n in live.items() if n == 0]
        if missing:
            return JSONResponse(
                {
                    "status": "unavailable",
                    "missing_pools": missing,
                    "live_workers": live,
                    "message": "no live worker in the " + " and ".join(missing) + " pool" + ("s" if len(missing) > 1 else ""),
                },
                status_code=503,
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        return JSONResponse({"status": "ok", "live_workers": live})

    @_handler
    async def version(request: Request) -> Response:
        return JSONResponse({"version": __version__})

    @_handler
    async def tokenize(request: Request) -> Response:
        req: TokenizeRequest = server.parse(TokenizeRequest, await server.read_json(request))
        server.check_model(req.model)
        if req.messages is not None:
            if not req.messages:
                raise APIError("messages must not be empty", 400, "messages")
            tokens = server.chat_prompt_ids(req, add_special_tokens=bool(req.add_special_tokens))
        elif req.prompt is not None:
            add = True if req.add_special_tokens is None else req.add_special_tokens
            tokens = tokenizer.encode(req.prompt, add_special_tokens=add)
        else:
            raise APIError("give either prompt or messages", 400, "prompt")
        return JSONResponse({"count": len(tokens), "max_model_len": max_model_len, "tokens": tokens})

    @_handler
    async def detokenize(request: Request) -> Response:
        req: DetokenizeRequest = server.parse(DetokenizeRequest, await server.read_json(request))
        server.check_model(req.model)
        bad = next((t for t in req.tokens if not tokenizer.is_valid_id(t)), None)
        if bad is not None:
            raise APIError(f"token id {bad} is out of range [0, {tokenizer.vocab_size})", 400, "tokens")
        return JSONResponse({"prompt": tokenizer.decode(req.tokens, skip_special_tokens=False)})

    @_handler
    async def metrics(request: Request) -> Response:
        return Response(server.metrics.render(), media_type=METRICS_CONTENT_TYPE)

    @_handler
    async def status(request: Request) -> Response:
        return JSONResponse(server.metrics.status())

    dashboard_html = (Path(__file__).parent / "static" / "dashboard.html").read_bytes()

    @_handler
    async def dashboard(request: Request) -> Response:
        return Response(dashboard_html, media_type="text/html; charset=utf-8", headers={"Cache-Control": "no-cache"})

    app.add_api_route("/metrics", metrics, methods=["GET"])
    app.add_api_route("/v1/status", status, methods=["GET"])
    app.add_api_route("/dashboard", dashboard, methods=["GET"])
    app.add_api_route("/v1/chat/completions", chat_completions, methods=["POST"])
    app.add_api_route("/v1/completions", completions, methods=["POST"])
    app.add_api_route("/v1/models", list_models, methods=["GET"])
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/version", version, methods=["GET"])
    app.add_api_route("/tokenize", tokenize, methods=["POST"])
    app.add_api_route("/detokenize", detokenize, methods=["POST"])
    return app


# --------------------------------------------------------------------------- running


def make_server(app: FastAPI, host: str = "127.0.0.1", port: int = 8000, log_level: str = "warning", **kwargs: Any):
    """A uvicorn.Server for `app` (call .run(), or .serve() inside a loop; set .should_exit to stop)."""
    import uvicorn

    kwargs.setdefault("timeout_graceful_shutdown", 5)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, **kwargs)
    return uvicorn.Server(config)


def serve(app: FastAPI, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info", **kwargs: Any) -> None:
    """Run `app` with uvicorn until interrupted (binds 127.0.0.1 unless told otherwise)."""
    make_server(app, host=host, port=port, log_level=log_level, **kwargs).run()
