"""The middleware Ray's HTTP proxy runs (``distill.rayserve.proxy``) holds each request's body
before a replica gets it, so it bounds that hold in time as ``cascade serve`` bounds its own read:
here it wraps a plain app on a real uvicorn on loopback, and clients on raw sockets send slowly.
The same middleware on a real Ray cluster is in tests/test_rayserve.py."""

from __future__ import annotations

import json
import socket
import time

import httpx
from fastapi import FastAPI, Request
from servers import serving

from distill.rayserve.proxy import MAX_HELD, ResendWhenReplicaDies

TIMEOUT = 1.0


def echoing() -> tuple[ResendWhenReplicaDies, list[bytes]]:
    """The middleware around an app that answers /health and echoes each body it gets (kept)."""
    app = FastAPI()
    seen: list[bytes] = []

    @app.get("/health")
    def health() -> dict:
        return {"status": "ok"}

    @app.post("/v1/systemone")
    async def echo(request: Request) -> dict:
        seen.append(await request.body())
        return {"echo": seen[-1].decode()}

    return ResendWhenReplicaDies(app, receive_timeout=TIMEOUT), seen


def read_all(conn: socket.socket) -> bytes:
    reply = b""
    while chunk := conn.recv(4096):
        reply += chunk
    return reply


def test_a_slow_body_gets_the_408_cascade_serve_gives_and_others_are_answered_meanwhile() -> None:
    app, seen = echoing()
    with serving(app) as url:
        port = int(url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=30) as conn:
            conn.sendall(b"POST /v1/systemone HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"X-Request-Id: slow-1\r\nContent-Length: 1000\r\n\r\n{\"state\": ")
            started = time.monotonic()
            answered = 0
            while time.monotonic() - started < TIMEOUT / 2:
                answered += httpx.get(f"{url}/health", timeout=5).status_code == 200
            reply = read_all(conn)  # sent nothing more: the hold's deadline passes, then it closes
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), reply[:200]
    assert b"connection: close" in head.lower() and b"x-request-id: slow-1" in head.lower()  # it had none
    error = json.loads(body)["error"]
    assert (error["type"], error["code"]) == ("invalid_request_error", "request_timeout")
    assert f"within {TIMEOUT:g} s" in error["message"]
    assert answered >= 1, "the proxy's loop answered others while it held the slow body"
    assert seen == [], "the app never saw the part of a body"


def test_a_body_sent_in_pieces_in_time_reaches_the_app_once_and_whole() -> None:
    app, seen = echoing()
    body = json.dumps({"state": "x" * 5000}).encode()
    with serving(app) as url:
        port = int(url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=30) as conn:
            conn.sendall(b"POST /v1/systemone HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Connection: close\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n")
            for start in range(0, len(body), 1000):
                conn.sendall(body[start:start + 1000])
                time.sleep(TIMEOUT / 20)
            reply = read_all(conn)
    assert reply.startswith(b"HTTP/1.1 200"), reply[:200]
    assert seen == [body]


def test_a_body_past_what_the_proxy_holds_is_refused_unread_with_its_request_id() -> None:
    """It was passed on as it came, and Ray's proxy took 600 MB of it into memory while no replica
    was ready; a 3 GB Content-Length was held for the whole receive timeout, then a 408 without the
    client's request id."""
    app, seen = echoing()
    with serving(app) as url:
        port = int(url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=30) as conn:
            conn.sendall(b"POST /v1/systemone HTTP/1.1\r\nHost: x\r\nX-Request-Id: big-1\r\n"
                         b"Content-Length: 3000000000\r\n\r\n{")
            reply = read_all(conn)  # a 413, not the 408 of a body held until the receive timeout
        chunks = (b"x" * 65536 for _ in range(MAX_HELD // 65536 + 1))  # in pieces, no length: just past
        sent = httpx.post(f"{url}/v1/systemone", content=chunks, headers={"X-Request-Id": "big-2"},
                          timeout=30)
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413") and b"x-request-id: big-1" in head.lower(), reply[:300]
    assert json.loads(body)["error"]["code"] == "request_too_large"
    assert (sent.status_code, sent.headers["x-request-id"]) == (413, "big-2") and seen == []
