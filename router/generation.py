"""Running an admitted request in the pools: each of its choices routed and started as its own
request, their outputs merged and traced, and every way it can end (finished, the client gone,
its deadline, a failure) ending it in the backend too.

`Generation.run` is what both generation endpoints of router.serving call once a request is
checked, admitted and tokenized; it answers in full or as a stream (router.streaming).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass
from typing import Any

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from common.protocol import RequestOutput
from common.request import RequestContext, WorkerRequest
from common.sampling_params import SamplingParams
from router.admission import Deadline, Ticket, deadline_error
from router.backend import GenerateRequest, RouteDecision, ServingBackend, WorkerInfo
from router.config import ServerConfig
from router.flow_commands import EndReason
from router.formatting import Accumulator, Choices, ResponseFormat
from router.metrics import RouterMetrics
from router.routing import RoutingPolicy
from router.streaming import ClientGone, DeadlineExceeded, await_unless_disconnected, ended, sse_response
from router.tokenizer import Tokenizer
from router.trace import RequestTrace

__all__ = ["Choice", "Generation", "merge_choices"]

logger = logging.getLogger("baton.router")
# A backend's outputs of one request, and a request's choices' outputs tagged with their index.
Outputs = AsyncGenerator[RequestOutput, None]
Tagged = AsyncGenerator[tuple[int, RequestOutput], None]
# Prompts and completions go only here, and only when the operator sets log_prompts.
request_logger = logging.getLogger("baton.router.requests")


@dataclass(frozen=True)
class Choice:
    """One choice of a request: a prompt and its sampling parameters (n choices share a prompt)."""

    prompt_ids: list[int]
    params: SamplingParams
    shares_prompt: bool = False  # a later sample of the same prompt: usage counts the prompt once


async def merge_choices(
    streams: list[Outputs],
) -> Tagged:
    """The outputs of every choice's stream as they come, tagged with the choice's index; closing
    it closes them all. A failure of any stream ends it with that failure."""
    if len(streams) == 1:  # the common case: no tasks, no queue
        try:
            async for out in streams[0]:
                yield 0, out
        finally:
            await streams[0].aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(index: int, stream: Outputs) -> None:
        try:
            async for out in stream:
                queue.put_nowait((index, out))
        except Exception as exc:
            queue.put_nowait((index, exc))
        finally:
            queue.put_nowait((index, done))

    tasks = [asyncio.ensure_future(pump(i, stream)) for i, stream in enumerate(streams)]
    try:
        live = len(streams)
        while live:
            index, item = await queue.get()
            if item is done:
                live -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for stream in streams:
            await stream.aclose()


class Generation:
    """Runs requests through one backend, routing each choice with `policy`; `metrics` records
    every choice's trace."""

    def __init__(
        self,
        backend: ServingBackend,
        policy: RoutingPolicy,
        tokenizer: Tokenizer,
        metrics: RouterMetrics,
        config: ServerConfig,
    ) -> None:
        self.backend = backend
        self.policy = policy
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.config = config

    async def run(
        self,
        request: Request,
        context: RequestContext,
        choices: list[Choice],
        stream: bool,
        fmt: ResponseFormat,
        started: float | None = None,
        ticket: Ticket | None = None,
        deadline: Deadline | None = None,
    ) -> Response:
        """Run an admitted request's choices (each its own request in the pools, all at once);
        its `ticket` is released however it ends, and past its `deadline` it is aborted (504)."""
        request_id = context.request_id
        backend_ids = [request_id] if len(choices) == 1 else [f"{request_id}-{i}" for i in range(len(choices))]
        streams = [
            self._start(context.for_choice(backend_id), choice, started)
            for backend_id, choice in zip(backend_ids, choices)
        ]
        outputs = self._ticketed(merge_choices(streams), ticket)
        answers = Choices([Accumulator(len(c.prompt_ids), shares_prompt=c.shares_prompt) for c in choices])
        headers = {"X-Request-Id": request_id}

        async def abort(reason: EndReason = EndReason.CLIENT_GONE) -> None:
            await self._abort(backend_ids, outputs, ticket, reason)

        # Streaming waits for the first output before sending headers, so that failures before the
        # first token still get a proper status code.
        work = outputs.__anext__() if stream else self._collect(outputs, answers)
        try:
            first = await await_unless_disconnected(request, work, deadline)
        except StopAsyncIteration:
            first = 0, ended(request_id)
        except ClientGone:
            await abort()
            return Response(status_code=499)
        except DeadlineExceeded:
            await abort(EndReason.DEADLINE)
            raise deadline_error(deadline.seconds if deadline else 0.0, running=True) from None
        except BaseException:
            await abort()
            raise
        if not stream:
            return JSONResponse(fmt.full(answers), headers=headers)
        return sse_response(request_id, outputs, first, fmt, answers, abort, headers, deadline)

    def _start(self, context: RequestContext, choice: Choice, started: float | None) -> Outputs:
        """Route one choice and start it in the pools; its outputs, traced."""
        backend_id = context.request_id
        prompt_ids = choice.prompt_ids
        structured = choice.params.structured_output
        trace = RequestTrace(backend_id, len(prompt_ids), structured.kind if structured is not None else None)
        if started is not None:
            trace.started = started  # arrival at the router, before parsing, admission and tokenizing
        if self.config.log_prompts:
            request_logger.info(
                "%s prompt (%d tokens): %r", backend_id, len(prompt_ids), self.tokenizer.decode(prompt_ids)
            )
        workers = self.backend.workers()
        route = self.policy.choose(prompt_ids, workers, context)
        trace.set_route(route)
        trace.priority, trace.tenant = context.priority, context.tenant
        if context.adapter is not None:
            trace.lora_adapter = context.adapter
            trace.lora_placement = lora_placement(context.adapter, route, workers)
        request = GenerateRequest(WorkerRequest(context, prompt_ids, choice.params), route, trace)
        return self._traced(self.backend.generate(request), trace)

    async def _traced(self, outputs: Outputs, trace: RequestTrace) -> Outputs:
        """Pass outputs through, timing tokens; record the trace however the request ends."""
        finish_reason, error = None, None
        texts: list[str] | None = [] if self.config.log_prompts else None
        try:
            async for out in outputs:
                trace.token(len(out.token_ids))
                if out.num_draft_tokens:
                    trace.speculation(out.num_draft_tokens, out.num_accepted_tokens)
                if texts is not None and out.text:
                    texts.append(out.text)
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
                if texts is not None:
                    request_logger.info("%s completion (%s): %r", trace.request_id, trace.finish_reason, "".join(texts))

    @staticmethod
    async def _ticketed(outputs: Tagged, ticket: Ticket | None) -> Tagged:
        """Free the ticket's prefill slot at the first output and its decode slot at the end."""
        try:
            async for item in outputs:
                if ticket is not None:
                    ticket.first_token()
                yield item
        finally:
            try:
                await outputs.aclose()
            finally:
                if ticket is not None:
                    ticket.release()

    @staticmethod
    async def _collect(outputs: Tagged, choices: Choices) -> None:
        unfinished = set(range(len(choices.accs)))
        try:
            async for index, out in outputs:
                choices.accs[index].add(out, keep=True)
                if out.finished:
                    unfinished.discard(index)
                    if not unfinished:
                        return
            for index in unfinished:
                choices.accs[index].finish_reason = "abort"
        finally:
            await outputs.aclose()  # let the backend run its cleanup now, not at garbage collection

    async def _abort(
        self, backend_ids: list[str], outputs: Any, ticket: Ticket | None, reason: EndReason = EndReason.CLIENT_GONE
    ) -> None:
        # The outputs may never have started (then closing them runs no cleanup): free the slots here.
        if ticket is not None:
            ticket.release()
        # Shielded: this runs while the handler is being cancelled (client gone).
        with anyio.CancelScope(shield=True):
            for backend_id in backend_ids:
                try:
                    await self.backend.abort(backend_id, reason)
                except Exception:
                    logger.exception("abort of %s failed", backend_id)
            try:
                await outputs.aclose()
            except BaseException:
                pass


def lora_placement(adapter: str, route: RouteDecision, workers: Sequence[WorkerInfo]) -> str:
    """Where `adapter` stood on the route's workers (RequestTrace.lora_placement)."""
    names = {0.0: "running", 0.25: "resident", 0.5: "load", 1.0: "evict"}
    by_id = {w.worker_id: w for w in workers}
    chosen = [wid for wid in (route.prefill_worker, route.decode_worker) if wid is not None and wid in by_id]
    return " ".join(f"{wid}:{names.get(by_id[wid].lora.affinity(adapter), '?')}" for wid in chosen)
