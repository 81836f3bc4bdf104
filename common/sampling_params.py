"""Per-request sampling parameters: a plain, torch-free dataclass shared by the router and the engine."""

from __future__ import annotations

from dataclasses import dataclass, field

# vLLM and OpenAI accept up to 20 top logprobs; more only costs time.
MAX_LOGPROBS = 20

# What a structured output constrains the reply to (router.structured builds them from the
# request's fields, workers.engine.grammar compiles them): a JSON schema (as JSON text), any JSON object,
# a regular expression, one of a list of strings (as a JSON array), or an EBNF grammar.
STRUCTURED_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on the reply, torch-free and hashable: equal specs share one compiled grammar."""

    kind: str
    spec: str = ""

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise ValueError(f"structured_output kind must be one of {STRUCTURED_KINDS}, got {self.kind!r}")
        if not isinstance(self.spec, str) or (not self.spec and self.kind != "json_object"):
            raise ValueError(f"structured_output {self.kind} needs a non-empty spec, got {self.spec!r}")


@dataclass
class SamplingParams:
    """How to pick the next token and when to stop.

    temperature 0 means greedy. top_k 0 or -1 means no top-k cut. seed makes a sampled
    request reproducible whatever it is batched with. logprobs=N returns the log-probability of
    the chosen token and of the N most likely ones at each step.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    structured_output: StructuredOutput | None = None
    # With a structured output: the grammar applies only once the output holds this token sequence
    # (a reasoning model's `</think>`); the tokens before it are free. Empty: from the first token.
    reasoning_end_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        self.reasoning_end_token_ids = tuple(self.reasoning_end_token_ids or ())
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first field that is out of range."""

        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"{name} {why}, got {getattr(self, name)!r}")

        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise bad("max_tokens", "must be an integer >= 1")
        if not 0.0 <= self.temperature <= 100.0:
            raise bad("temperature", "must be in [0, 100]")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", "must be an integer >= 0 (0 or -1 disables it)")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "must be in [0, 1]")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise bad("seed", "must be an integer")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", "must be non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be non-negative integers")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise bad("min_tokens", f"must be an integer in [0, max_tokens={self.max_tokens}]")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise bad("logprobs", f"must be an integer in [0, {MAX_LOGPROBS}]")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", "must be in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", "must be in [-2, 2]")
        if not 0.0 < self.repetition_penalty <= 10.0:
            raise bad("repetition_penalty", "must be in (0, 10]")
        if any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in self.reasoning_end_token_ids):
            raise bad("reasoning_end_token_ids", "must be non-negative integers")
        if self.reasoning_end_token_ids and self.structured_output is None:
            raise bad("reasoning_end_token_ids", "only apply to a structured output (structured_output is None)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
