"""A request whose client has gone is not computed.

An SDK gives up after its timeout (10 s by default) and closes the connection; the work queued for
it would be read by nobody, and would delay everyone behind it. So while a handler waits for its
answer it also listens for the client's disconnect (the ASGI ``http.disconnect`` message, which
the server delivers once the body has been read); when that comes first the job's future is
cancelled, and the worker that would have taken it drops it (a job already being computed
finishes, its answer unread: a model call cannot be stopped halfway).
"""

from __future__ import annotations

import asyncio
from concurrent.futures import Future
from typing import Any, TypeVar

from starlette.requests import Request

from cascade.serve.transport import HttpProblem

T = TypeVar("T")
GONE = 499
"""The status logged (and counted) for a request whose client went before its answer (nginx's)."""


class ClientGone(HttpProblem):
    """The client closed the connection before its answer: nothing is sent."""

    def __init__(self) -> None:
        super().__init__(GONE, "client_gone", "the client closed the connection before the answer; "
                         "its request was dropped (or its answer left unread)")


async def unless_gone(future: Future[T], request: Request) -> T:
    """The future's result, or ``ClientGone`` once the client disconnects first (the future is
    then cancelled: a job not yet started is never computed)."""
    waiting: asyncio.Future[Any] = asyncio.wrap_future(future)
    listening: asyncio.Future[Any] = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait((waiting, listening), return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        future.cancel()
        raise
    finally:
        listening.cancel()
    if waiting in done:
        result: T = waiting.result()
        return result
    future.cancel()
    waiting.cancel()
    raise ClientGone


async def _disconnected(request: Request) -> None:
    """Return when the client disconnects (the body has been read before this is called)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
