"""The router's section of the configuration: its HTTP server, request limits, admission control,
deadlines, API keys and what it may log; and the admin endpoint's section (`AdminConfig`).

`ServerConfig` is one section of `cluster.config.BatonConfig`: every field becomes a `baton serve`
flag, a YAML key (`server: {max_waiting_requests: 64}`) and a JSON Schema entry, from the metadata
here (`help`, `choices`, `flag`, `size`, `example`). Defaults follow vLLM's and OpenAI's where they
have one; every limit is refused with HTTP 400 and the OpenAI error envelope naming the field.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from common import envs
from common.lora import LoRAModuleSpec
from common.sampling_params import MAX_LOGPROBS
from router.reasoning import REASONING_PARSERS
from router.tool_parsers import TOOL_CALL_PARSERS

__all__ = ["ADMIN_TOKEN_ENV", "ADMIN_TOKEN_HEADER", "API_KEY_ENV", "AdminConfig", "LOG_LEVELS", "ServerConfig"]

LOG_LEVELS = ("debug", "info", "warning", "error")
# Read when --api-key is not given (vLLM reads VLLM_API_KEY the same way); comma-separated keys.
API_KEY_ENV = envs.BATON_API_KEY.name
ADMIN_TOKEN_ENV = envs.BATON_ADMIN_TOKEN.name
ADMIN_TOKEN_HEADER = "X-Baton-Admin-Token"


@dataclass
class ServerConfig:
    """The router: HTTP server, request limits, admission control, deadlines and API keys."""

    host: str = field(default="127.0.0.1", metadata={"help": "address the router binds", "example": "0.0.0.0"})
    # LoRA: the engine's --enable-lora and --lora-modules, which the launcher copies here so that
    # requests may name an adapter as their `model` and /v1/models lists them.
    enable_lora: bool = field(default=False, metadata={"internal": True})
    # The engine's --scheduling-policy, copied here too: the router's queues follow it, and a
    # request's `priority` is refused without it.
    scheduling_policy: str = field(default="fcfs", metadata={"internal": True})
    tenant_weights: str | None = field(default=None, metadata={"internal": True})
    lora_adapters: tuple[LoRAModuleSpec, ...] = field(default=(), metadata={"internal": True})
    port: int = field(default=8000, metadata={"help": "port the router listens on"})
    log_level: str = field(
        default="info", metadata={"help": "log level of the router and the CLI", "choices": LOG_LEVELS}
    )

    # -- API keys and logging
    # repr=False: the configuration may be printed or logged; the keys must not be.
    api_key: str | None = field(
        default=None,
        repr=False,
        metadata={
            "help": "API keys (comma-separated) that clients must send as `Authorization: Bearer KEY` on /v1/*, "
            "/tokenize, /detokenize and the dashboard; /health, /metrics and /version stay open "
            f"(default: the {API_KEY_ENV} environment variable, else no key)",
            "example": "key-one,key-two",
        },
    )
    log_prompts: bool = field(
        default=False,
        metadata={
            "help": "log every request's prompt and completion text (level info, logger baton.router.requests); "
            "off, prompts and completions appear in no log and not on the dashboard"
        },
    )

    # -- request limits (each refused with 400 naming the field and the limit)
    max_request_body: int = field(
        default=8 << 20,
        metadata={
            "size": True,
            "example": "1MiB",
            "help": "largest request body accepted (bytes, or with a unit: 8MiB)",
        },
    )
    max_json_depth: int = field(
        default=64, metadata={"help": "deepest nesting of JSON objects and arrays accepted in a request body"}
    )
    max_stop_sequences: int = field(
        default=16, metadata={"help": "most stop strings, and most stop_token_ids, in one request (OpenAI allows 4)"}
    )
    max_stop_length: int = field(default=256, metadata={"help": "longest stop string, in characters"})
    max_choices: int = field(
        default=16,
        metadata={
            "help": "most choices one request may ask for: n, times the prompts of a batched /v1/completions request"
        },
    )
    max_logprobs: int = field(
        default=MAX_LOGPROBS,
        metadata={"help": f"most top logprobs per token a request may ask for (at most {MAX_LOGPROBS})", "example": 5},
    )

    # -- tool calls and reasoning (vLLM's flags; docs/structured-outputs.md)
    tool_call_parser: str | None = field(
        default=None,
        metadata={
            "choices": (None, *TOOL_CALL_PARSERS),
            "example": "hermes",
            "help": "how the model writes tool calls, for tool_choice auto (default: guessed from the chat template)",
        },
    )
    enable_auto_tool_choice: bool = field(
        default=False,
        metadata={
            "help": "parse tool calls out of replies when a request offers tools with tool_choice auto (the default "
            "choice then); required and named choices work without it"
        },
    )
    reasoning_parser: str | None = field(
        default=None,
        metadata={
            "choices": (None, *REASONING_PARSERS),
            "example": "deepseek_r1",
            "help": "split a thinking model's <think>...</think> into message.reasoning_content",
        },
    )

    # -- admission control: FIFO gates per pool, bounded waiting queues, 429 beyond them
    max_running_requests: int | None = field(
        default=None,
        metadata={
            "example": 16,
            "help": "requests in the decode pool at once (each holds a decode slot from start to finish); more wait "
            "in the router's queue (default: decode workers x max_num_seqs)",
        },
    )
    max_waiting_requests: int = field(
        default=128,
        metadata={
            "help": "requests waiting for a decode slot; beyond that the router answers 429 with Retry-After at once"
        },
    )
    max_running_prefills: int | None = field(
        default=None,
        metadata={
            "example": 4,
            "help": "requests between admission and their first token at once (prefill); more wait in the router's "
            "queue (default: prefill workers x max_num_seqs, decode workers' when the prefill pool is empty)",
        },
    )
    max_waiting_prefills: int = field(
        default=128,
        metadata={
            "help": "requests waiting for a prefill slot; beyond that the router answers 429 with Retry-After at once"
        },
    )
    request_timeout: float | None = field(
        default=600.0,
        metadata={
            "example": 30.0,
            "help": "seconds a request may wait and run before it is ended with an error and its KV blocks are freed "
            "(a client's x-stainless-read-timeout header, which OpenAI SDKs send, can only shorten it; "
            "null: no deadline)",
        },
    )

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port}")
        for name in ("max_request_body", "max_json_depth", "max_stop_sequences", "max_stop_length"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.max_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"max_logprobs must be in [0, {MAX_LOGPROBS}], got {self.max_logprobs}")
        for name in ("max_running_requests", "max_running_prefills"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1 (or null: automatic), got {value}")
        for name in ("max_waiting_requests", "max_waiting_prefills"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.request_timeout is not None and not self.request_timeout > 0:
            raise ValueError(f"request_timeout must be > 0 seconds (or null: no deadline), got {self.request_timeout}")
        if self.api_key is not None and not self.api_keys():
            raise ValueError("api_key must hold at least one non-empty key (comma-separated)")

    def api_keys(self) -> tuple[str, ...]:
        """The accepted keys (empty: no authentication)."""
        return tuple(k.strip() for k in (self.api_key or "").split(",") if k.strip())

    def with_api_key_from_env(self, environ: Mapping[str, str] | None = None) -> ServerConfig:
        """This configuration, its keys read from BATON_API_KEY when none were configured."""
        key = envs.api_key(environ)
        if self.api_key is not None or key is None:
            return self
        return replace(self, api_key=key)


@dataclass
class AdminConfig:
    """The admin endpoint (`baton scale`): off by default, loopback only unless a token is set."""

    enabled: bool = field(
        default=False,
        metadata={
            "flag": "admin_endpoint",
            "help": "serve GET /admin/pools and POST /admin/scale (`baton scale`); answers loopback clients only, "
            "unless admin_token is set",
        },
    )
    # repr=False: the configuration may be printed or logged; the token must not be.
    token: str | None = field(
        default=None,
        repr=False,
        metadata={
            "flag": "admin_token",
            "help": f"token every /admin request must carry as `{ADMIN_TOKEN_HEADER}: TOKEN`; with it, clients on any "
            f"address may scale (default: the {ADMIN_TOKEN_ENV} environment variable, else loopback only)",
        },
    )

    def __post_init__(self) -> None:
        if self.token is not None and not self.token.strip():
            raise ValueError("admin_token must not be empty")

    def with_token_from_env(self, environ: Mapping[str, str] | None = None) -> AdminConfig:
        token = envs.admin_token(environ)
        if self.token is not None or token is None:
            return self
        return replace(self, token=token)
