"""A client cannot hold the server's connection slots (``cascade.serve.connections``): not by
never reading its answers, nor by holding silent sockets open.

Before, uvicorn waited without end to write an answer nobody read (and closing would have waited
for the buffer to drain): pipelined requests (no key needed, a 401 is an answer too) held a slot
for as long as the client kept the socket open, and a handful held them all. And its connection
limit counted idle sockets: 25 silent ones had every other client, ``/health`` too, answered a
plain-text 503 with no ``Retry-After``. Served here as ``cascade serve`` serves (its uvicorn
configuration), with an app whose answer is far past what the socket buffers hold, so that
writing pauses for real, and one that takes its time.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from servers import serving, until
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from cascade.serve.lifecycle import ServeOptions

BIG = 16 * 1024 * 1024
DEADLINE = 3.0


async def health(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


async def ping(request: Request) -> Response:
    return JSONResponse({"pong": True})


SLOW_STARTED: list[int] = []
SLOW_RELEASE = threading.Event()
"""The slow route's requests that have begun, and what lets them end: the test, not a clock."""


async def slow(request: Request) -> Response:
    SLOW_STARTED.append(1)
    await asyncio.to_thread(SLOW_RELEASE.wait, 60)
    return JSONResponse({"slow": True})


APP = Starlette(routes=[Route("/health", health), Route("/ping", ping, methods=["GET", "POST"]),
                        Route("/slow", slow)])


async def big(request: Request) -> Response:
    """In one piece: the answer is complete at once, and the head deadline of the next request
    finds it unsent (closing would wait for it)."""
    return Response(b"x" * BIG, media_type="application/octet-stream")


async def chunks(request: Request) -> Response:
    """In pieces: uvicorn waits to write the next one, so the answer is never complete."""
    async def pieces() -> AsyncIterator[bytes]:
        for _ in range(BIG // 65536):
            yield b"x" * 65536

    return StreamingResponse(pieces(), media_type="application/octet-stream")


def status(url: str, path: str = "/ping") -> int:
    try:
        return httpx.get(f"{url}{path}", timeout=5).status_code
    except httpx.TransportError:
        return 0


@pytest.mark.parametrize("path", ["/big", "/chunks"])
def test_a_client_that_never_reads_its_answer_loses_its_slot_at_the_deadline(path: str) -> None:
    app = Starlette(routes=[Route("/health", health), Route("/ping", ping), Route("/big", big),
                            Route("/chunks", chunks)])
    with serving(app, wait=False, options=ServeOptions(max_connections=1, receive_timeout=DEADLINE)) as url:
        stuck = socket.socket()
        stuck.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a reader that takes nothing
        stuck.connect(("127.0.0.1", int(url.rsplit(":", 1)[1])))
        try:
            stuck.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            if path == "/big":  # its answer done (if unsent), it waits for a head: closed to make room
                until(lambda: status(url) == 200, "the stuck connection closed for a new one", 2)
            else:  # its request in flight holds the one slot
                assert status(url) == 503
                assert status(url, "/health") == 200  # a probe of a busy server is told it is up
                until(lambda: status(url) == 200, "the slot freed as its answer stalled", 60)
            stuck.settimeout(30)
            received = 0
            try:
                while chunk := stuck.recv(1 << 20):
                    received += len(chunk)
            except ConnectionResetError:
                pass
            assert received < BIG  # aborted, its unsent bytes dropped
        finally:
            stuck.close()


def test_silent_sockets_cannot_refuse_other_clients() -> None:
    """Ten sockets that never send a head, past a limit of four: each new connection closes the
    one waiting longest, so every request is answered, and the silent ones are closed."""
    with serving(APP, wait=False, options=ServeOptions(max_connections=4, receive_timeout=60)) as url:
        port = int(url.rsplit(":", 1)[1])
        silent = [socket.create_connection(("127.0.0.1", port)) for _ in range(10)]
        try:
            assert [status(url) for _ in range(5)] == [200] * 5 and status(url, "/health") == 200
            for sock in silent[:6]:  # the oldest, closed to make room (well before the 60 s deadline)
                sock.settimeout(10)
                assert sock.recv(1) == b""
        finally:
            for sock in silent:
                sock.close()


def test_requests_past_the_limit_in_flight_get_a_busy_answer_with_retry_after() -> None:
    """Two slow requests in flight, a limit of two: a third is told to come back (the usual error
    body, its request id, Retry-After, the connection closed), /health is answered, and once the
    slow ones are done the server answers again."""
    SLOW_STARTED.clear()
    SLOW_RELEASE.clear()
    with serving(APP, wait=False, options=ServeOptions(max_connections=2, receive_timeout=10)) as url:
        with ThreadPoolExecutor(2) as pool:
            slow_ones = [pool.submit(httpx.get, f"{url}/slow", timeout=60) for _ in range(2)]
            try:  # probing before both were in flight could close a slow one's new connection for room
                until(lambda: len(SLOW_STARTED) == 2, "both slow requests in flight")
                busy = httpx.get(f"{url}/ping", headers={"X-Request-Id": "busy-1"}, timeout=5)
                health = status(url, "/health")
            finally:
                SLOW_RELEASE.set()
            assert [f.result().status_code for f in slow_ones] == [200, 200]
        assert busy.status_code == 503 and busy.headers["retry-after"] == "1" and health == 200
        assert busy.headers["x-request-id"] == "busy-1" and busy.headers["connection"] == "close"
        assert busy.json()["error"]["code"] == "server_busy"
        assert status(url) == 200


def test_a_request_framed_two_ways_is_answered_and_its_connection_closed() -> None:
    """Transfer-Encoding and Content-Length both: the body is read chunked, and the request
    pipelined after it was answered too on the same connection (RFC 9112 6.1: the server must
    close it, or a proxy in front that framed the body by its length is smuggled a request)."""
    with serving(APP, wait=False, options=ServeOptions(max_connections=4, receive_timeout=10)) as url:
        sock = socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), timeout=10)
        try:
            sock.sendall(b"POST /ping HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
                         b"Content-Length: 5\r\n\r\n0\r\n\r\nGET /ping HTTP/1.1\r\nHost: x\r\n\r\n")
            reply = b""
            while chunk := sock.recv(65536):
                reply += chunk
        finally:
            sock.close()
    assert reply.count(b"HTTP/1.1 ") == 1, reply  # and closed: the read above ended


def test_headers_past_the_limit_are_refused_however_they_arrive() -> None:
    """A 20 KB header was read when it came in one write and refused (400) in pieces: a client's
    big cookie was taken or not by how TCP split it."""
    with serving(APP, wait=False, options=ServeOptions(max_connections=4, receive_timeout=10)) as url:
        port = int(url.rsplit(":", 1)[1])
        head = b"GET /ping HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"y" * 20_000 + b"\r\n\r\n"
        statuses = []
        for pieces in (1, 20):
            sock = socket.create_connection(("127.0.0.1", port), timeout=10)
            try:
                with contextlib.suppress(OSError):  # refused midway: the rest is not wanted
                    for k in range(pieces):
                        sock.sendall(head[k * len(head) // pieces:(k + 1) * len(head) // pieces])
                        time.sleep(0.01)
                try:
                    statuses.append(sock.recv(64).split(b" ")[1])
                except ConnectionResetError:  # h11's 400 may be lost to the reset of what it left unread
                    statuses.append(b"400")
            finally:
                sock.close()
        small = httpx.get(f"{url}/ping", headers={"X-Pad": "y" * 10_000}, timeout=10)
        long_address = httpx.get(f"{url}/ping?q={'y' * 20_000}", timeout=10)
    assert statuses == [b"431", b"400"] and small.status_code == 200 and long_address.status_code == 431


def test_a_slow_clients_head_on_its_way_is_not_the_one_closed_for_room() -> None:
    """The one waiting longest for a head was closed, a slow client halfway through sending its
    own before a silent socket opened after it: one that has sent nothing goes first."""
    with serving(APP, wait=False, options=ServeOptions(max_connections=2, receive_timeout=30)) as url:
        port = int(url.rsplit(":", 1)[1])
        slow = socket.create_connection(("127.0.0.1", port), timeout=10)
        silent = socket.create_connection(("127.0.0.1", port), timeout=10)
        try:
            slow.sendall(b"GET /ping HTTP/1.1\r\nHost: x\r\n")  # the rest of its head to come
            time.sleep(0.5)  # the server has read it (the order, not a time, is what is tested)
            assert status(url) == 200  # a third connection: room made by closing one of the two
            slow.sendall(b"\r\n")
            reply = slow.recv(64)
            silent.settimeout(10)
            closed = silent.recv(1)
        finally:
            slow.close()
            silent.close()
    assert reply.startswith(b"HTTP/1.1 200") and closed == b""
