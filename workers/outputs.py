"""What the engine hands back each step: plain, torch-free dataclasses that cross process boundaries."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    """Log-probability of a generated token, and of the most likely alternatives at that step."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class RequestOutput:
    """One step's increment for one request.

    token_ids and text hold only what is new since the previous output of that request; text
    already has stop strings cut off. finish_reason is "stop" (EOS, stop token or stop string),
    "length" (max_tokens or the context limit) or "abort".
    """

    request_id: str
    token_ids: list[int]
    text: str = ""
    logprobs: list[TokenLogprob] | None = None
    finished: bool = False
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    created_at: float = 0.0  # time.time() when the worker queued it (streaming-overhead measurement)


@dataclass(frozen=True)
class KVReservation:
    """Blocks a decode worker set aside for a prompt whose KV another worker computes.

    The first num_cached_tokens tokens (whole blocks) were already in this worker's prefix cache;
    the sender only needs to fill block_ids[num_cached_tokens // block_size:].
    """

    request_id: str
    block_ids: list[int]
    num_cached_tokens: int
