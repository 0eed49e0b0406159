"""Deadlines on each connection, so that a client cannot hold a slot by being slow either way.

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
"""

from __future__ import annotations

import asyncio
import contextlib

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


def connection_deadlines(seconds: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol, each request's head due within ``seconds`` and no answer stalled
    unread for longer (``Config(http=...)``)."""
    if not seconds > 0:
        raise ValueError(f"a connection's deadline must be > 0 seconds; got {seconds!r}")

    class Deadlines(H11Protocol):
        _head_due: asyncio.TimerHandle | None = None
        _write_due: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

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
            with contextlib.suppress(h11.LocalProtocolError):
                self.conn.send(h11.ConnectionClosed())
            if self.transport.get_write_buffer_size():
                self.transport.abort()  # close() would wait for a reader that never comes
            else:
                self.transport.close()

    return Deadlines
