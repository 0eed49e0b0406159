"""Each connection's deadlines, and the limit on connections: a client cannot hold a slot by
being slow either way, nor by holding sockets open.

Reading: uvicorn waits for a request's head as long as bytes keep coming, and its keep-alive
timer is reset by every byte: a client trickling one header byte a second (a slowloris) holds a
connection, and a few hundred of them hold every slot ``limit_concurrency`` counts. So each
connection's head must arrive whole within ``seconds`` of the connection opening, or of the
previous answer on it; past that the connection is closed. The body has a deadline of its own,
kept by the app while it reads it (``cascade.serve.app.request_body``: 408).

Writing: a client that sends requests and never reads the answers (pipelined down one
connection: no key is needed, a 401 is an answer too) fills the socket, then the transport's
buffer past its high-water mark, and uvicorn waits to write without end; closing would wait for
the buffer to drain, which never comes. So a connection whose writing stays paused for
``seconds`` is aborted (its buffered bytes dropped), as is one closed at the head deadline with
bytes still unsent: either frees its slot at once.

Holding: uvicorn's ``limit_concurrency`` answered every request once that many sockets were open,
idle ones too, with its own plain-text 503 (no ``Retry-After``, no request id, ``/health``
included): a client holding 25 silent sockets refused every other client and had a load balancer
take the server out. Here a connection past ``most`` closes the one that has waited longest for a
request's head (an idle keep-alive, a silent socket); where every one has a request in flight, a
request past ``most`` in flight is answered 503 ``server_busy`` with ``Retry-After`` and the
connection closed, and ``/health`` is answered all the same.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from cascade.serve.transport import HttpProblem, send_problem

log = logging.getLogger("cascade.serve")

MAX_HEAD = 16 * 1024
"""Bytes of headers a request may carry: h11's bound on a head that arrives in pieces (a plain 400
past it), kept for one that arrives whole too (read whatever its size, up to about 64 KiB, so a
client's big cookie was taken or refused by how TCP split it); past it, 431."""
ALWAYS_ANSWERED = frozenset({"/health", "/healthz"})
"""Answered past the limit too: a probe of a busy server is told it is up."""


def connection_policy(seconds: float, most: int) -> type[H11Protocol]:
    """uvicorn's h11 protocol, each request's head due within ``seconds``, no answer stalled
    unread for longer, and at most ``most`` connections kept (``Config(http=...)``, with no
    ``limit_concurrency``)."""
    if not seconds > 0:
        raise ValueError(f"a connection's deadline must be > 0 seconds; got {seconds!r}")
    if most < 1:
        raise ValueError(f"at least 1 connection must be allowed; got {most!r}")

    class Policed(H11Protocol):
        _head_due: asyncio.TimerHandle | None = None
        _write_due: asyncio.TimerHandle | None = None
        _waiting_since = 0.0
        _heard = False  # bytes came since it last waited for a head

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()
            if len(self.connections) > most:
                self._make_room()
            app = self.app
            self.app = lambda scope, receive, send: self._admitted(app, scope, receive, send)

        def _make_room(self) -> None:
            """Close the connection that has waited longest for a request's head, this one aside."""
            waiting = [c for c in self.connections if isinstance(c, Policed) and c is not self
                       and not c._reading_request() and not c.transport.is_closing()]
            if waiting:  # one that sent nothing of its head first: a slow client's head may be on its way
                min(waiting, key=lambda c: (c._heard, c._waiting_since))._close()

        def data_received(self, data: bytes) -> None:
            self._heard = True
            super().data_received(data)

        async def _admitted(self, app: Any, scope: Any, receive: Any, send: Any) -> None:
            """The app's answer, or past ``most`` requests in flight (this one counted) a 503."""
            names = {name for name, _ in scope.get("headers") or []}
            if {b"transfer-encoding", b"content-length"} <= names and self.cycle is not None:
                # framed two ways (RFC 9112 6.1): answered, then the connection closed, so that a
                # proxy in front that read the other framing cannot slip a request past it
                self.cycle.keep_alive = False
            head = len(scope.get("raw_path", b"")) + len(scope.get("query_string", b""))
            head += sum(len(name) + len(value) + 4 for name, value in scope.get("headers") or [])
            if head > MAX_HEAD:
                await send_problem(send, HttpProblem(
                    431, "headers_too_large", f"the request's line and headers are over {MAX_HEAD} bytes; "
                    "send a shorter address, or fewer or shorter headers", {"Connection": "close"}), scope)
                return
            if len(self.tasks) <= most or scope.get("path") in ALWAYS_ANSWERED:
                await app(scope, receive, send)
                return
            problem = HttpProblem(503, "server_busy", f"the server has {most} requests in flight "
                                  "(--max-connections); retry after 1 s",
                                  {"Retry-After": "1", "Connection": "close"}, kind="server_error")
            log.warning(json.dumps({"event": "server_busy", "in_flight": len(self.tasks)}))
            await send_problem(send, problem, scope)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            self._writing()
            super().connection_lost(exc)

        def pause_writing(self) -> None:
            super().pause_writing()
            if self._write_due is None:
                self._write_due = self.loop.call_later(seconds, self.transport.abort)

        def resume_writing(self) -> None:
            super().resume_writing()
            self._writing()

        def _writing(self) -> None:
            """The client reads again (or is gone): no write deadline."""
            if self._write_due is not None:
                self._write_due.cancel()
                self._write_due = None

        def handle_events(self) -> None:
            super().handle_events()
            if self._reading_request():
                self._disarm()

        def _reading_request(self) -> bool:
            """A head came in whole and its answer is not sent yet."""
            return self.cycle is not None and not self.cycle.response_complete

        def _arm(self) -> None:
            self._disarm()
            self._waiting_since, self._heard = self.loop.time(), False
            if not self.transport.is_closing():
                self._head_due = self.loop.call_later(seconds, self._overdue)

        def _disarm(self) -> None:
            if self._head_due is not None:
                self._head_due.cancel()
                self._head_due = None

        def _overdue(self) -> None:
            self._head_due = None
            if self._reading_request() or self.transport.is_closing():
                return
            self._close()

        def _close(self) -> None:
            """Close a connection waiting for a head, dropping what it left unsent."""
            self._disarm()
            with contextlib.suppress(h11.LocalProtocolError):
                self.conn.send(h11.ConnectionClosed())
            if self.transport.get_write_buffer_size():
                self.transport.abort()  # close() would wait for a reader that never comes
            else:
                self.transport.close()

    return Policed
