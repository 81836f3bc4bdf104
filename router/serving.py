"""Serving chat and text completions: parse and check a request, build its prompt and sampling
parameters, route it, run it through the backend, and answer in full or as a stream.

Both endpoints share one path (`router.generation.Generation.run`) and one formatter
(router.formatting); each endpoint supplies only its prompt, its max_tokens rule and its format.
Every rejection is an `APIError` (router.errors turns it into the envelope). The request's identity
(`common.request.RequestContext`) is made here, once, and travels with it to the engine.

Order of work for a generation request, cheapest refusal first: admission check (429, before the
body is read), body limits and schema (400, router.limits and router.protocol), waiting for a decode
and a prefill slot (router.admission, bounded by the request's deadline), then tokenization,
routing and the backend. Prompts and completions are logged only with `log_prompts`.
"""

from __future__ import annotations

import logging
import math
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel, ValidationError

from common.lora import LoRAModuleSpec
from common.protocol import GrammarCompileError
from common.request import DEFAULT_TENANT, RequestContext
from common.roles import ROLES
from common.tenants import tenant_from_header
from router.admission import AdmissionControl, Deadline, Ticket, request_deadline
from router.backend import LoRABackend, ServingBackend
from router.config import ServerConfig
from router.formatting import ChatFormat, CompletionFormat, ResponseFormat
from router.generation import Choice, Generation
from router.limits import check_limits, check_unsupported, read_json
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
    to_sampling_params,
    validation_error_to_api,
)
from router.reasoning import grammar_start_token_ids
from router.routing import RoutingPolicy, live_workers
from router.streaming import ClientGone, await_unless_disconnected
from router.structured import Constraints, request_constraints
from router.tokenizer import ChatTemplateError, Tokenizer

__all__ = ["COMPLETIONS_DEFAULT_MAX_TOKENS", "Serving"]

logger = logging.getLogger("baton.router")
# Prompts and completions go only here, and only when the operator sets log_prompts.
request_logger = logging.getLogger("baton.router.requests")

# OpenAI's and vLLM's default for the legacy /v1/completions endpoint. Chat requests without a
# limit may use the whole remaining context (max_model_len - prompt tokens).
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


def parse(model: type[BaseModel], body: Any) -> Any:
    if not isinstance(body, dict):
        raise APIError("request body must be a JSON object", 400, None)
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise validation_error_to_api(e) from None


@dataclass(frozen=True)
class Endpoint:
    """What one generation endpoint supplies to the shared path."""

    schema: type[ChatCompletionRequest | CompletionRequest]
    check: Callable[[Any], None]  # endpoint-specific checks before admission
    prompts: Callable[[Any], list[list[int]]]  # the prompt(s), tokenized (after admission)
    prompt_param: str  # the field a too-long prompt is blamed on
    default_max_tokens: int | None  # None: whatever is left of the context
    format: type[ResponseFormat]
    id_prefix: str


class Serving:
    """The model's endpoints over one backend; `metrics` records every request's trace."""

    def __init__(
        self,
        backend: ServingBackend,
        tokenizer: Tokenizer,
        model_name: str,
        max_model_len: int,
        policy: RoutingPolicy,
        config: ServerConfig,
    ) -> None:
        self.backend = backend
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.policy = policy
        self.config = config
        self.created = int(time.time())
        # LoRA adapters from --lora-modules: what is served until the workers report their own.
        self.configured_adapters: dict[str, LoRAModuleSpec] = {s.name: s for s in config.lora_adapters}
        self.admission = AdmissionControl(config)
        self.metrics = RouterMetrics(model_name, backend, self.admission)
        self.generation = Generation(backend, policy, tokenizer, self.metrics, config)
        self.chat_endpoint = Endpoint(
            ChatCompletionRequest,
            check_chat_extras,
            lambda req: [self.chat_prompt_ids(req)],
            "messages",
            None,
            ChatFormat,
            "chatcmpl",
        )
        self.completion_endpoint = Endpoint(
            CompletionRequest,
            check_completion_extras,
            self.completion_prompts,
            "prompt",
            COMPLETIONS_DEFAULT_MAX_TOKENS,
            CompletionFormat,
            "cmpl",
        )

    # -- the generation endpoints: each supplies its checks, prompt, max_tokens default and format
    async def chat(self, request: Request, started: float) -> Response:
        return await self._serve(request, started, self.chat_endpoint)

    async def completion(self, request: Request, started: float) -> Response:
        return await self._serve(request, started, self.completion_endpoint)

    async def _serve(self, request: Request, started: float, endpoint: Endpoint) -> Response:
        """Cheapest refusal first: load (429), body and fields (400), then wait for slots (or the
        deadline), then tokenize, route and run."""
        deadline = request_deadline(self.config, request.headers, time.monotonic())
        ttft_target = request_ttft_target(request.headers)
        try:
            tenant = tenant_from_header(request.headers)
        except ValueError as exc:
            raise APIError(str(exc), 400, None) from None
        self.admission.check()
        req, constraints, adapter = await self._request(request, endpoint.schema)
        endpoint.check(req)
        context = self.request_context(
            f"{endpoint.id_prefix}-{uuid.uuid4().hex}",
            deadline,
            adapter,
            priority=req.priority,
            ttft_target=ttft_target,
            tenant=tenant,
        )
        ticket = await self._admit(request, deadline, context)
        if ticket is None:
            return Response(status_code=499)
        try:
            prompts = endpoint.prompts(req)
            return await self._complete(
                request, started, req, prompts, endpoint, ticket, deadline, constraints, context
            )
        except BaseException:
            ticket.release()
            raise

    async def _admit(self, request: Request, deadline: Deadline | None, context: RequestContext) -> Ticket | None:
        """Wait for the request's slots (in its priority's and tenant's turn); None when the client
        left while it waited."""
        admit = self.admission.admit(deadline, context.priority, context.ttft_target, context.tenant)
        try:
            return await await_unless_disconnected(request, admit)
        except ClientGone:
            return None

    async def _request(
        self, request: Request, schema: type[ChatCompletionRequest | CompletionRequest]
    ) -> tuple[Any, Constraints, str | None]:
        """The request parsed and checked, its constraints, and the LoRA adapter its `model` names."""
        body = await read_json(request, self.config)
        if not isinstance(body, dict):
            raise APIError("request body must be a JSON object", 400, None)
        check_unsupported(body, schema, self.tokenizer.vocab_size)
        req = parse(schema, body)
        adapter = self.check_model(req.model)
        if req.priority != 0 and self.config.scheduling_policy != "priority":
            raise APIError(
                f"priority {req.priority}: priority scheduling is not enabled (--scheduling-policy priority)",
                400,
                "priority",
            )
        check_common(req)
        check_limits(req, self.config, self.tokenizer.vocab_size)
        # Structured output, tools and reasoning: checked here, before any slot is taken.
        constraints = request_constraints(
            body, schema is ChatCompletionRequest, self.config, self.tokenizer.chat_template
        )
        return req, constraints, adapter

    async def _complete(
        self,
        request: Request,
        started: float,
        req: ChatCompletionRequest | CompletionRequest,
        prompts: list[list[int]],
        endpoint: Endpoint,
        ticket: Ticket,
        deadline: Deadline | None,
        constraints: Constraints,
        context: RequestContext,
    ) -> Response:
        requested, field_name = req.requested_max_tokens()
        request_id = context.request_id
        choices: list[Choice] = []
        for prompt_ids in prompts:  # each prompt n times, in OpenAI's order of choice indexes
            max_tokens = self.resolve_max_tokens(
                len(prompt_ids), requested, field_name, endpoint.prompt_param, endpoint.default_max_tokens
            )
            params = to_sampling_params(req, max_tokens, max_tokens_field=field_name)
            if constraints.structured is not None:
                params = replace(
                    params,
                    structured_output=constraints.structured,
                    reasoning_end_token_ids=(
                        grammar_start_token_ids(self.tokenizer, prompt_ids) if constraints.after_reasoning else ()
                    ),
                )
            for sample in range(req.n):
                # A seeded request stays reproducible, and its n samples differ from each other.
                seeded = params if sample == 0 or params.seed is None else replace(params, seed=params.seed + sample)
                choices.append(Choice(prompt_ids, seeded, shares_prompt=sample > 0))
        opts = req.stream_options
        fmt = endpoint.format(
            self.tokenizer,
            request_id,
            req.model or self.model_name,
            int(time.time()),
            include_usage=bool(req.stream and opts and opts.include_usage),
            continuous_usage=bool(opts and opts.continuous_usage_stats),
            logprobs=req.wants_logprobs(),
        )
        if isinstance(fmt, ChatFormat):
            fmt.shaped(constraints.shape)
        self.metrics.count_structured(constraints.kind)
        try:
            return await self.generation.run(request, context, choices, req.stream, fmt, started, ticket, deadline)
        except GrammarCompileError as e:  # the router's checks passed it, the workers' grammar backend did not
            raise APIError(f"{constraints.param}: {e}", 400, constraints.param) from None

    def request_context(
        self,
        request_id: str,
        deadline: Deadline | None,
        adapter: str | None = None,
        priority: int = 0,
        ttft_target: float | None = None,
        tenant: str = DEFAULT_TENANT,
    ) -> RequestContext:
        """The request's identity, made here once: every worker call and the engine read it from here."""
        return RequestContext(
            request_id,
            model=adapter or self.model_name,
            adapter=adapter,
            priority=priority,
            deadline=None if deadline is None else time.time() + deadline.remaining(),
            ttft_target=ttft_target,
            tenant=tenant,
        )

    # -- checks and prompts
    def check_model(self, name: str | None) -> str | None:
        """The LoRA adapter a request's `model` names (None: the base model); 404 for any other name."""
        if name is None or name == self.model_name:
            return None
        adapters = self.adapters()
        if name in adapters:
            return name
        served = ", ".join(f"`{n}`" for n in (self.model_name, *adapters))
        raise APIError(
            f"The model `{name}` does not exist. This server serves {served}.", 404, "model", "NotFoundError"
        )

    def resolve_max_tokens(
        self, num_prompt: int, requested: int | None, field_name: str, prompt_param: str, default: int | None = None
    ) -> int:
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

    def completion_prompts(self, req: CompletionRequest) -> list[list[int]]:
        """The prompt, or each prompt of a batch, tokenized."""
        return [self.completion_prompt_ids(prompt, req.add_special_tokens) for prompt in req.prompts()]

    def completion_prompt_ids(self, prompt: str | list[int], add_special_tokens: bool) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        else:
            ids = list(prompt)
            bad = next((t for t in ids if not self.tokenizer.is_valid_id(t)), None)
            if bad is not None:
                raise APIError(f"prompt token id {bad} is out of range [0, {self.tokenizer.vocab_size})", 400, "prompt")
        if not ids:
            raise APIError("prompt must not be empty", 400, "prompt")
        return ids

    def chat_prompt_ids(
        self, req: ChatCompletionRequest | TokenizeRequest, add_special_tokens: bool = False
    ) -> list[int]:
        if isinstance(req, ChatCompletionRequest):
            messages = req.template_messages()
        else:
            messages = ChatCompletionRequest.model_construct(messages=req.messages or []).template_messages()
        try:
            text = self.tokenizer.render_chat(
                messages, add_generation_prompt=req.add_generation_prompt, tools=getattr(req, "tools", None)
            )
        except ChatTemplateError as e:
            raise APIError(str(e), 400, "messages") from None
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    # -- the other endpoints' answers
    def models(self) -> dict:
        card = {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "baton",
            "max_model_len": self.max_model_len,
        }
        adapters = [
            {**card, "id": s.name, "root": s.path, "parent": s.base_model_name or self.model_name}
            for s in self.adapters().values()
        ]
        return {"object": "list", "data": [{**card, "root": self.model_name, "parent": None}, *adapters]}

    # -- LoRA adapters: listed, loaded and unloaded while serving (vLLM's endpoints)
    def adapters(self) -> dict[str, LoRAModuleSpec]:
        """The adapters a request may name: those the live workers report serving (so every router
        process sees a run-time load or unload made through any of them, at the workers' next
        stats), else, before any worker reported, those of --lora-modules."""
        reporting = [w for w in self.backend.workers() if w.alive and w.lora.max_loras]
        if not reporting:
            return dict(self.configured_adapters)
        served: dict[str, LoRAModuleSpec] = {}
        for w in reporting:
            for spec in w.lora.served or ():
                served.setdefault(spec.name, spec)
        return served

    async def load_lora_adapter(self, request: Request) -> str:
        body = await read_json(request, self.config)
        name, path = _lora_field(body, "lora_name"), _lora_field(body, "lora_path")
        if not self.config.enable_lora:
            raise APIError("LoRA adapters are not served here (start with --enable-lora)", 400, "lora_name")
        if name == self.model_name or name in self.adapters():
            raise APIError(f"The lora adapter '{name}' has already been loaded.", 400, "lora_name")
        if not isinstance(self.backend, LoRABackend):
            raise APIError("this backend cannot load LoRA adapters while serving", 400, "lora_name")
        try:
            base = body.get("base_model_name") if isinstance(body, dict) else None
            spec = LoRAModuleSpec(name, path, base if isinstance(base, str) else None)
            await self.backend.load_lora_adapter(spec)
        except ValueError as exc:
            raise APIError(str(exc), 400, "lora_path") from None
        return f"Success: LoRA adapter '{name}' added successfully."

    async def unload_lora_adapter(self, request: Request) -> str:
        body = await read_json(request, self.config)
        name = _lora_field(body, "lora_name")
        if name not in self.adapters():
            raise APIError(f"The lora adapter '{name}' cannot be found.", 404, "lora_name", "NotFoundError")
        if isinstance(self.backend, LoRABackend):
            await self.backend.unload_lora_adapter(name)
        return f"Success: LoRA adapter '{name}' removed successfully."

    def health(self) -> tuple[int, dict]:
        """(status, body): 503 naming the pools without a live worker, else 200."""
        workers = self.backend.workers()
        live = {role: len(live_workers(workers, role)) for role in ROLES}
        missing = [role for role, n in live.items() if n == 0]
        if not missing:
            return 200, {"status": "ok", "live_workers": live}
        message = "no live worker in the " + " and ".join(missing) + " pool" + ("s" if len(missing) > 1 else "")
        return 503, {"status": "unavailable", "missing_pools": missing, "live_workers": live, "message": message}

    async def tokenize(self, request: Request) -> dict:
        req: TokenizeRequest = parse(TokenizeRequest, await read_json(request, self.config))
        self.check_model(req.model)
        if req.messages is not None:
            if not req.messages:
                raise APIError("messages must not be empty", 400, "messages")
            tokens = self.chat_prompt_ids(req, add_special_tokens=bool(req.add_special_tokens))
        elif req.prompt is not None:
            add = True if req.add_special_tokens is None else req.add_special_tokens
            tokens = self.tokenizer.encode(req.prompt, add_special_tokens=add)
        else:
            raise APIError("give either prompt or messages", 400, "prompt")
        return {"count": len(tokens), "max_model_len": self.max_model_len, "tokens": tokens}

    async def detokenize(self, request: Request) -> dict:
        req: DetokenizeRequest = parse(DetokenizeRequest, await read_json(request, self.config))
        self.check_model(req.model)
        bad = next((t for t in req.tokens if not self.tokenizer.is_valid_id(t)), None)
        if bad is not None:
            raise APIError(f"token id {bad} is out of range [0, {self.tokenizer.vocab_size})", 400, "tokens")
        return {"prompt": self.tokenizer.decode(req.tokens, skip_special_tokens=False)}


def _lora_field(body: object, key: str) -> str:
    value = body.get(key) if isinstance(body, dict) else None
    if not isinstance(value, str) or not value:
        raise APIError(f"{key} is required (a non-empty string)", 400, key)
    return value


TTFT_TARGET_HEADER = "x-llm-d-slo-ttft-ms"  # llm-d's: the TTFT the client wants, in milliseconds


def request_ttft_target(headers) -> float | None:
    """The wall-clock time by which the request wants its first token (x-llm-d-slo-ttft-ms), or None."""
    value = headers.get(TTFT_TARGET_HEADER)
    if value is None:
        return None
    try:
        ms = float(value)
    except ValueError:
        ms = math.nan
    if not (math.isfinite(ms) and ms > 0):
        raise APIError(f"{TTFT_TARGET_HEADER} must be a positive number of milliseconds, got {value!r}", 400, None)
    return time.time() + ms / 1000
