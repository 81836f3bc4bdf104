"""A request entering the engine: its prompt checked against the model and the context, the state
it runs with (generator, detokenizer, grammar), and, for a request migrated from a lost worker,
the tokens it already produced replayed into that state."""

from __future__ import annotations

import torch

from common.detokenizer import Decode, IncrementalDetokenizer
from common.protocol import ResumeState
from common.request import RequestContext
from common.sampling_params import SamplingParams
from workers.engine.grammar import GrammarCache
from workers.engine.request_state import RequestState
from workers.engine.sequence import Sequence
from workers.engine.speculation import RequestDrafts


def checked_prompt(prompt_token_ids: list[int], vocab_size: int, max_model_len: int) -> list[int]:
    """The prompt as a list; ValueError when it is empty, holds a token outside the vocabulary or
    leaves no room in the context to generate."""
    prompt = list(prompt_token_ids)
    if not prompt:
        raise ValueError("prompt_token_ids must not be empty")
    bad = next((t for t in prompt if not isinstance(t, int) or not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"prompt_token_ids contains {bad!r}, outside the vocabulary [0, {vocab_size})")
    if len(prompt) >= max_model_len:
        raise ValueError(
            f"prompt has {len(prompt)} tokens; this engine's context is {max_model_len} tokens "
            f"and at least one must be left to generate"
        )
    return prompt


def new_request_state(
    request_id: str,
    prompt: list[int],
    params: SamplingParams,
    seed: int | None,
    decode: Decode | None,
    grammars: GrammarCache | None,
    prefill_only: bool = False,
    drafting: RequestDrafts | None = None,
    context: RequestContext | None = None,
) -> RequestState:
    """A new request's state: its Sequence, its generator (seeded with `seed`; None: the engine's
    noise), its detokenizer (with a tokenizer) and its grammar (structured output)."""
    generator = torch.Generator(device="cpu").manual_seed(seed) if seed is not None else None
    detok = IncrementalDetokenizer(decode, params.stop) if decode else None
    grammar = None
    if params.structured_output is not None:
        if grammars is None:
            raise ValueError("structured output needs a tokenizer; this engine was built without one")
        # GrammarCompileError (a ValueError) when it does not compile; with reasoning_end_token_ids
        # the grammar waits for the end of the reasoning.
        grammar = grammars.state(params.structured_output, params.reasoning_end_token_ids)
    seq = Sequence(request_id, prompt, params, context=context)
    return RequestState(seq, generator, detok, prefill_only=prefill_only, grammar=grammar, drafting=drafting)


def replay_outputs(state: RequestState, resume: ResumeState, vocab_size: int, max_model_len: int) -> None:
    """Append the tokens a migrated request already produced (resume.output_token_ids) to its new
    state, one at a time, as the first worker produced them: its grammar accepts each and its
    detokenizer is replayed over them, which must give the resume.text_chars characters the client
    has. ValueError when they cannot be resumed here."""
    seq, request_id = state.seq, state.seq.request_id
    outputs = list(resume.output_token_ids)
    bad = next((t for t in outputs if not isinstance(t, int) or not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"resumed output_token_ids contains {bad!r}, outside the vocabulary [0, {vocab_size})")
    if len(outputs) >= seq.sampling_params.max_tokens:
        raise ValueError(
            f"request {request_id!r} already produced {len(outputs)} of its "
            f"{seq.sampling_params.max_tokens} max_tokens: nothing to resume"
        )
    if seq.num_prompt_tokens + len(outputs) >= max_model_len:
        raise ValueError(
            f"prompt ({seq.num_prompt_tokens}) + output so far ({len(outputs)}) tokens leave no "
            f"room in this engine's context of {max_model_len} tokens"
        )
    replayed = 0
    for position, token in enumerate(outputs):
        if state.grammar is not None and not state.grammar.accept(token):
            raise ValueError(
                f"request {request_id!r}: resumed token {position} ({token}) is not allowed by its "
                f"structured output's grammar"
            )
        seq.append_token(token)
        if state.detokenizer is not None:
            state.detokenizer.add(seq.output_token_ids)
            replayed += len(state.detokenizer.take(final=False))
    if state.detokenizer is not None and replayed != resume.text_chars:
        raise ValueError(
            f"request {request_id!r}: replaying {len(outputs)} tokens gives {replayed} characters "
            f"of text, the client has {resume.text_chars}"
        )
