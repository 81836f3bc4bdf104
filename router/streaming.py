"""Server-sent events and client disconnects.

A stream is `data: <chunk JSON>\\n\\n` frames straight from the backend's async generator (no
polling, no per-token sleeps), then the usage chunk when asked for, then `data: [DONE]\\n\\n`. A
backend failure after the headers went out is reported in-band as an error frame before [DONE].
A client that disconnects, while streaming or while waiting for an answer, gets its request
aborted in the backend (`abort` below is the caller's: it must be safe to call under cancellation).
A request past its deadline (router.admission) is stopped the same way, with an in-band 504 error
event once the headers are gone.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from common.protocol import RequestOutput
from router.admission import Deadline, deadline_error
from router.errors import to_api_error
from router.flow_commands import EndReason
from router.formatting import Choices, ResponseFormat, dumps

__all__ = [
    "DONE",
    "SSE_HEADERS",
    "ClientGone",
    "DeadlineExceeded",
    "await_unless_disconnected",
    "ended",
    "remaining",
    "sse_response",
]

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
DONE = "data: [DONE]\n\n"


class ClientGone(Exception):
    """The client disconnected before the answer was ready."""


class DeadlineExceeded(Exception):
    """The request's deadline passed before the answer was ready."""


def remaining(deadline: Deadline | None) -> float | None:
    """Seconds left until `deadline` (None: no deadline)."""
    return None if deadline is None else deadline.remaining()


async def _wait_for_disconnect(request: Request) -> None:
    # The body is already read, so the next ASGI message is http.disconnect (the client left, or
    # the server finished the response). Event-driven: no polling.
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def await_unless_disconnected(
    request: Request, awaitable: Awaitable[Any], deadline: Deadline | None = None
) -> Any:
    """Await `awaitable`; raise ClientGone if the client disconnects first, DeadlineExceeded if the
    `deadline` passes first (after cancelling it, either way)."""
    task = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait((task, watcher), timeout=remaining(deadline), return_when=asyncio.FIRST_COMPLETED)
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
    raise ClientGone() if watcher.done() and not watcher.cancelled() else DeadlineExceeded()


def ended(request_id: str) -> RequestOutput:
    """What a backend stream that stopped without a finished output amounts to."""
    return RequestOutput(request_id, [], finished=True, finish_reason="abort")


async def _frames(
    request_id: str,
    outputs: AsyncGenerator[tuple[int, RequestOutput], None],
    first: tuple[int, RequestOutput],
    fmt: ResponseFormat,
    choices: Choices,
    abort: Callable[[EndReason], Awaitable[None]],
    deadline: Deadline | None,
) -> AsyncGenerator[str, None]:
    finished = False
    why = EndReason.CLIENT_GONE  # what ends the request in the backend unless it finishes
    unfinished = set(range(len(choices.accs)))
    try:
        for index in sorted(unfinished):
            frame = fmt.first_frame(index, choices)
            if frame is not None:
                yield frame
        index, out = first
        while True:
            choices.accs[index].add(out, keep=False)
            frame = fmt.chunk(out, index, choices)
            if frame is not None:
                yield frame
            if out.finished:
                unfinished.discard(index)
                if not unfinished:
                    break
            try:
                async with asyncio.timeout(remaining(deadline)):
                    index, out = await outputs.__anext__()
            except StopAsyncIteration:
                index, out = min(unfinished), ended(request_id)
            except TimeoutError:
                why = EndReason.DEADLINE
                raise deadline_error(deadline.seconds if deadline else 0.0, running=True) from None
        finished = True
        await outputs.aclose()
        if fmt.include_usage:
            yield fmt.usage_frame(choices)
        yield DONE
    except Exception as e:  # a backend failure mid-stream: headers are gone, so say it in-band
        yield "data: " + dumps(to_api_error(e, request_id).body()) + "\n\n"
        yield DONE
    finally:
        if not finished:  # client gone (cancelled), past the deadline, or the backend failed
            await abort(why)


def sse_response(
    request_id: str,
    outputs: AsyncGenerator[tuple[int, RequestOutput], None],
    first: tuple[int, RequestOutput],
    fmt: ResponseFormat,
    choices: Choices,
    abort: Callable[[EndReason], Awaitable[None]],
    headers: dict[str, str],
    deadline: Deadline | None = None,
) -> StreamingResponse:
    """The event stream of a request whose first output (`first`, with its choice's index)
    already arrived; past its `deadline` it ends with a 504 error event and the request is aborted."""
    return StreamingResponse(
        _frames(request_id, outputs, first, fmt, choices, abort, deadline),
        media_type="text/event-stream",
        headers={**SSE_HEADERS, **headers},
    )
