"""A client that never reads its answers cannot hold a connection slot (``cascade.serve.deadline``).

Before, uvicorn waited without end to write an answer nobody read (and closing would have waited
for the buffer to drain): pipelined requests (no key needed, a 401 is an answer too) held a slot
for as long as the client kept the socket open, and a handful held them all. Served here as
``cascade serve`` serves (its uvicorn configuration; two slots, this probe taking one), with an
app whose answer is far past what the socket buffers hold, so that writing pauses for real.
"""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator

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


def status(url: str) -> int:
    try:
        return httpx.get(f"{url}/health", timeout=5).status_code
    except httpx.TransportError:
        return 0


@pytest.mark.parametrize("path", ["/big", "/chunks"])
def test_a_client_that_never_reads_its_answer_loses_its_slot_at_the_deadline(path: str) -> None:
    app = Starlette(routes=[Route("/health", health), Route("/big", big), Route("/chunks", chunks)])
    with serving(app, wait=False, options=ServeOptions(max_connections=2, receive_timeout=DEADLINE)) as url:
        stuck = socket.socket()
        stuck.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a reader that takes nothing
        stuck.connect(("127.0.0.1", int(url.rsplit(":", 1)[1])))
        try:
            stuck.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            assert status(url) == 503  # it holds the one slot a client has beside this probe
            until(lambda: status(url) == 200, "the slot freed once the answer stalled past the deadline", 60)
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
