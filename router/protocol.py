"""OpenAI-compatible request and response schemas (pydantic 2) and their conversion to SamplingParams.

Requests ignore fields they do not know (as vLLM does), so clients sending newer OpenAI fields
still work; known OpenAI fields Baton cannot honour are refused by name (router.limits). Ranges
live in the fields (and so in the OpenAPI schema). Every rejection is an `APIError`, which the
HTTP layer turns into the OpenAI error envelope `{"error": {"message", "type", "param", "code"}}`
with code = HTTP status.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypedDict, cast

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, ValidationError

from common.sampling_params import MAX_LOGPROBS, SamplingParams

# --------------------------------------------------------------------------- errors

_ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestTooLargeError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
    504: "TimeoutError",
}


class APIError(Exception):
    """An error the client should see, with its HTTP status and the offending parameter."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        param: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.type = type or _ERROR_TYPES.get(status, "BadRequestError" if status < 500 else "InternalServerError")
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.status}}


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "none", "dict", "list", "ChatMessage", "StreamOptions"})


def _loc_to_param(loc: tuple) -> str | None:
    """('messages', 0, 'role') -> 'messages[0].role'; drops pydantic's union-branch tags."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif isinstance(part, str):
            if "[" in part or part in _TYPE_TAGS:  # a union branch tag such as 'list[int]', not a field
                continue
            out += ("." if out else "") + part
    return out or None


def validation_error_to_api(e: ValidationError) -> APIError:
    errors = e.errors(include_url=False)
    first = errors[0] if errors else {"loc": (), "msg": str(e)}
    param = _loc_to_param(tuple(first.get("loc", ())))
    msg = first.get("msg", "invalid value")
    where = f"{param}: " if param else ""
    return APIError(f"{where}{msg}", 400, param)


# --------------------------------------------------------------------------- requests


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


# Ranges are OpenAI's where it documents one (temperature [0, 2], penalties [-2, 2], 20 top
# logprobs), else vLLM's; they are in the OpenAPI schema too. Seeds must fit in 64 bits (int64).
INT64 = (-(2**63), 2**63 - 1)
TokenId = Annotated[StrictInt, Field(ge=0)]


class StreamOptions(_Request):
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False


class ChatMessage(_Request):
    # Any other role is rejected with 400 (param messages[i].role), as OpenAI does.
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    model_config = ConfigDict(extra="allow")


class _SamplingFields(_Request):
    """Fields shared by chat and text completions."""

    model: str | None = None
    n: int = Field(1, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = Field(None, ge=INT64[0], le=INT64[1])
    stop: str | list[str] | None = None
    max_tokens: StrictInt | None = Field(None, ge=1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # common extras (vLLM names)
    priority: StrictInt = Field(0, ge=INT64[0], le=INT64[1])  # lower runs first (--scheduling-policy priority)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0, le=10)
    ignore_eos: StrictBool = False
    min_tokens: int = Field(0, ge=0)
    stop_token_ids: list[TokenId] | None = None
    # Structured output (router.structured reads and checks these; Any, so its messages name the field).
    response_format: Any = Field(
        None, description="OpenAI: {type: text | json_object | json_schema, json_schema: {name, schema, strict}}"
    )
    structured_outputs: Any = Field(
        None, description="vLLM: exactly one of json, regex, choice, grammar (EBNF), json_object"
    )
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = Field(None, description="none, auto, required or {type: function, function: {name}}")
    parallel_tool_calls: Any = None
    add_generation_prompt: StrictBool = True

    def wants_logprobs(self) -> bool:
        return self.logprobs

    def requested_max_tokens(self) -> tuple[int | None, str]:
        """(value, field name): max_completion_tokens wins over the deprecated max_tokens."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"

    def template_messages(self) -> list[dict[str, Any]]:
        """Messages as plain dicts for the chat template; text parts are joined into one string."""
        out = []
        for i, m in enumerate(self.messages):
            d = m.model_dump(exclude_none=True)
            if isinstance(m.content, list):
                texts = []
                for j, part in enumerate(m.content):
                    if part.get("type") != "text" or not isinstance(part.get("text"), str):
                        kind = part.get("type")
                        why = (
                            f"{kind} parts are not supported: this is a text-only model"
                            if kind in ("image_url", "input_image", "input_audio", "file", "video_url")
                            else f"got type {kind!r}"
                        )
                        raise APIError(
                            f"messages[{i}].content[{j}]: only text content parts ({{'type': 'text', 'text': ...}}) "
                            f"are supported; {why}",
                            400,
                            f"messages[{i}].content[{j}]",
                        )
                    texts.append(part["text"])
                d["content"] = "\n".join(texts)
            elif m.content is None and m.role != "assistant":
                raise APIError(f"messages[{i}].content is required for role {m.role!r}", 400, f"messages[{i}].content")
            elif m.content is None:
                d["content"] = ""  # an assistant turn of tool calls only: templates read content as text
            out.append(d)
        return out


class CompletionRequest(_SamplingFields):
    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]]
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: StrictBool = False
    best_of: int | None = Field(None, ge=1)
    suffix: str | None = None
    add_special_tokens: StrictBool = True

    def wants_logprobs(self) -> bool:
        return self.logprobs is not None

    def requested_max_tokens(self) -> tuple[int | None, str]:
        return self.max_tokens, "max_tokens"

    def prompts(self) -> list[str | list[int]]:
        """The prompts of the request: one, or each of a batch (a list of strings or of id lists)."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            return list(prompt)
        # Validation keeps a list's items of one kind: a list not of strings or lists is one prompt's ids.
        return [cast("str | list[int]", prompt)]


class TokenizeRequest(_Request):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: StrictBool | None = None
    add_generation_prompt: StrictBool = True


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[StrictInt]


# --------------------------------------------------------------------------- responses


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


class ChatCompletionChoice(BaseModel):
    index: int = 0
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


class ChatCompletionChunkChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionChunkChoice]
    usage: UsageInfo | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    """Both the full response and each stream chunk (OpenAI uses object "text_completion" for both)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "baton"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# --------------------------------------------------------------------------- conversion


def check_common(req: _SamplingFields) -> None:
    """Checks both request kinds need before tokenization."""
    if req.stream_options is not None and not req.stream:
        raise APIError("stream_options is only allowed when stream is true", 400, "stream_options")
    for name in ("max_tokens", "max_completion_tokens"):
        value = getattr(req, name, None)
        if value is not None and value < 1:
            raise APIError(f"{name} must be an integer >= 1, got {value}", 400, name)


def check_completion_extras(req: CompletionRequest) -> None:
    if req.echo:
        raise APIError("echo is not supported", 400, "echo")
    if req.suffix:
        raise APIError("suffix is not supported", 400, "suffix")
    if req.best_of not in (None, 1):
        raise APIError(f"best_of={req.best_of} is not supported (must be 1)", 400, "best_of")


def check_chat_extras(req: ChatCompletionRequest) -> None:
    if not req.messages:
        raise APIError("messages must not be empty", 400, "messages")
    if req.top_logprobs is not None:
        if not req.logprobs:
            raise APIError("top_logprobs requires logprobs to be true", 400, "top_logprobs")
        if not 0 <= req.top_logprobs <= MAX_LOGPROBS:
            raise APIError(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {req.top_logprobs}", 400, "top_logprobs")


class _SamplingKwargs(TypedDict):
    """The SamplingParams fields a request sets (their names are the fields its errors start with)."""

    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int | None
    stop: list[str]
    stop_token_ids: list[int]
    ignore_eos: bool
    min_tokens: int
    logprobs: int | None
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float


def to_sampling_params(
    req: ChatCompletionRequest | CompletionRequest, max_tokens: int, *, max_tokens_field: str = "max_tokens"
) -> SamplingParams:
    """Build SamplingParams; its ValueError("<field> ...") becomes a 400 naming the request field."""
    if isinstance(req, ChatCompletionRequest):
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        logprobs_field = "top_logprobs"
    else:
        logprobs = req.logprobs
        logprobs_field = "logprobs"
    stop = req.stop
    if isinstance(stop, str):
        stop = [stop]
    kwargs = _SamplingKwargs(
        max_tokens=max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=0 if req.top_k is None else req.top_k,
        min_p=0.0 if req.min_p is None else req.min_p,
        seed=req.seed,
        stop=list(stop or []),
        stop_token_ids=list(req.stop_token_ids or []),
        ignore_eos=req.ignore_eos,
        min_tokens=req.min_tokens,
        logprobs=logprobs,
        presence_penalty=0.0 if req.presence_penalty is None else req.presence_penalty,
        frequency_penalty=0.0 if req.frequency_penalty is None else req.frequency_penalty,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
    )
    try:
        return SamplingParams(**kwargs)
    except (ValueError, TypeError) as e:
        message = str(e)
        field: str | None = message.split(" ", 1)[0]
        if field not in kwargs:
            field = None
        elif field == "max_tokens":
            field = max_tokens_field
        elif field == "logprobs":
            field = logprobs_field
        raise APIError(
            message if field is None or field == message.split(" ", 1)[0] else f"{field}: {message}", 400, field
        ) from e
