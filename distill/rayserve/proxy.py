"""A request whose replica died while it ran is sent again, on Ray's HTTP proxy.

Ray Serve's proxy ends such a request with no answer (uvicorn then sends ``500 Internal Server
Error``), or a 500 of its own: the client's request is lost although another replica could
answer it. Every answer of this application's replicas carries ``X-Cascade-Replica``
(``replicas.ProxyHeaders``), so a 500 without it is Ray's, not the app's: the proxy then sends the
same request (its body held here) again, up to ``TRIES`` times in all, and Ray routes it to a
live replica. Ray also routes such a request again by itself, but without its body (the proxy has
read it), so the replica answers 408 once its receive timeout passes; since the body is held
whole here before Ray gets it, a 408 can only mean that, and the request is sent again too. A decision only
reads, so sending it again changes no answer; the replica that died sent nothing, so the client
gets one answer. Ray applies this where its environment names it, on every node:
``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=distill.rayserve.proxy:middlewares``.

A body past ``MAX_HELD`` bytes, or one whose ``Content-Length`` says so, is answered 413 here, the
rest unread: it was passed on as it came, and while no replica was ready (one restarting, say)
Ray's proxy took all of it into memory (600 MB sent took the proxy from 228 MB to 802 MB), and a
3 GB Content-Length was held for the whole receive timeout before a 408. A replica's own
``--max-body`` (2 MiB by default) refuses far less than this; one set above ``MAX_HELD`` does not
apply behind Ray.

Holding a body is bounded in time as ``cascade serve`` bounds reading one: a body that has not
arrived whole within ``RECEIVE_TIMEOUT`` seconds is answered 408 here, with the System One error
body and ``Connection: close``, so a client that sends slowly holds neither the proxy nor a
replica. A body that is neither whole by then nor past ``MAX_HELD`` is one the replica's own
limits would refuse or time out too.
"""

from __future__ import annotations

import asyncio
from typing import Any

from cascade.serve.edge import DEFAULT_RECEIVE_TIMEOUT
from cascade.serve.transport import HttpProblem, send_problem, slow_body

TRIES = 3
VARIABLE = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
IMPORT_PATH = "distill.rayserve.proxy:middlewares"
START = f"{VARIABLE}={IMPORT_PATH}"
"""What Ray's environment must hold, on every node, for its proxies to run this middleware."""
MAX_HELD = 16 * 1024 * 1024
REPLICA_HEADER = b"x-cascade-replica"
RECEIVE_TIMEOUT = DEFAULT_RECEIVE_TIMEOUT
"""Seconds a body has to arrive whole at the proxy: ``cascade serve``'s default for its own."""


def middlewares() -> list[Any]:
    """What Ray's proxy calls (by the environment's import path) for its middlewares."""
    from starlette.middleware import Middleware

    return [Middleware(ResendWhenReplicaDies)]


class ResendWhenReplicaDies:
    """ASGI middleware: hold a request's body, and send the request again while Ray loses it (its
    replica died), ``TRIES`` times in all."""

    def __init__(self, app: Any, receive_timeout: float = RECEIVE_TIMEOUT) -> None:
        self.app, self.receive_timeout = app, receive_timeout

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > MAX_HELD:
            await send_problem(send, _too_large(), scope)
            return
        try:
            body, whole = await asyncio.wait_for(_held_body(receive), self.receive_timeout)
        except asyncio.TimeoutError:
            await send_problem(send, slow_body(self.receive_timeout), scope)
            return
        if not whole:
            await send_problem(send, _too_large(), scope)
            return
        for attempt in range(1, TRIES + 1):
            answer = _Answer(send, last=attempt == TRIES)
            await self.app(dict(scope), _replaying(body, receive), answer.send)
            if not answer.lost and answer.started:
                return
            if answer.last:  # ended with no answer: uvicorn sends its 500
                return


async def _held_body(receive: Any) -> tuple[bytes, bool]:
    """The request's body, and whether it is whole (False: past ``MAX_HELD``, the rest unread)."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return b"".join(chunks), True  # the client went: the app finds out at its next receive
        chunks.append(message.get("body", b""))
        size += len(chunks[-1])
        if size > MAX_HELD:  # whole or not: past what is held
            return b"".join(chunks), False
        if not message.get("more_body", False):
            return b"".join(chunks), True


def _too_large() -> HttpProblem:
    """413, the connection closed: the rest of the body is never read."""
    return HttpProblem(413, "request_too_large", f"request body over {MAX_HELD} bytes, the most Ray's "
                       "proxy holds for a request; send fewer or shorter states per request",
                       {"Connection": "close"})


def _replaying(body: bytes, receive: Any) -> Any:
    """A ``receive`` that gives ``body`` first, then whatever ``receive`` gives (the client's
    disconnect)."""
    given = False

    async def replay() -> Any:
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


class _Answer:
    """Passes an answer on, unless it is Ray's 500 for a dead replica or a 408 for a body Ray lost,
    and ``last`` is False: then it is swallowed and ``lost`` says so. ``started``: an answer began
    (none: the proxy gave up)."""

    def __init__(self, send: Any, last: bool) -> None:
        self._send, self.last = send, last
        self.lost = self.started = False

    async def send(self, message: Any) -> None:
        if message["type"] == "http.response.start":
            self.started = True
            names = {name.lower() for name, _ in message.get("headers", [])}
            status = message["status"]
            self.lost = not self.last and (status == 408 or (status == 500 and REPLICA_HEADER not in names))
        if not self.lost:
            await self._send(message)
