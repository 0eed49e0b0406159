"""The server's side of the wire: request bodies in (size-limited, gzip or zstd), errors out.

An error is one JSON body that every published System One client reads: ``error`` with ``type``,
``code``, ``message``, ``param``/``field`` (the request path the problem is at) and ``question``
(avrik-sdk reads code/message/field, jev-style code/message/question, typesafe-sdk the message),
and ``detail`` beside it as TypeSafe's API writes it, for clients that read that instead: a 422's
is FastAPI's ``[{loc, msg, type}]``, one entry per problem; any other status's is
``{error_type, message}`` (``error_type`` the ``error``'s ``type``, ``authentication_error`` for a
401), as jevcompat's ``errors.shape`` and ``auth.*`` checks require. A body's size limit holds
after inflating too, so a small compressed body cannot unpack into gigabytes.
"""

from __future__ import annotations

import json
import uuid
import zlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import IO, Any, cast

from cascade.errors import CascadeError

DEFAULT_MAX_BODY = 2 * 1024 * 1024
"""Largest body, after inflating: room for a state and questions at their limits
(``cascade.serve.limits``, 100,000 characters each, even JSON-escaped), and small enough that
parsing one (which holds the interpreter lock) takes milliseconds, not seconds."""
_CHUNK = 1 << 16


class HttpProblem(CascadeError):
    """A request the server refuses, with the status, code and headers of the answer it gets."""

    def __init__(self, status: int, code: str, message: str, headers: dict[str, str] | None = None,
                 kind: str = "invalid_request_error", found: list[Problem] | None = None) -> None:
        """``found``: the request's problems, one per line of ``message`` (a 422)."""
        super().__init__(message)
        self.status, self.code, self.kind = status, code, kind
        self.headers = headers or {}
        self.found = found


def too_large(limit: int) -> HttpProblem:
    return HttpProblem(413, "request_too_large",
                       f"request body over the server's limit of {limit} bytes (after inflating "
                       "compressed bodies); send fewer or shorter states per request")


def slow_body(timeout: float) -> HttpProblem:
    """A body that did not arrive in time: the connection closes with the answer."""
    return HttpProblem(408, "request_timeout", f"the request body did not arrive within {timeout:g} s; "
                       "send it at once", {"Connection": "close"})


async def read_body(chunks: AsyncIterator[bytes], encoding: str | None, limit: int) -> bytes:
    """The request body, inflated, refused with 413 as soon as it passes ``limit`` bytes."""
    kind = (encoding or "identity").strip().lower()
    if kind not in ("identity", "gzip", "x-gzip", "zstd"):
        raise HttpProblem(415, "unsupported_encoding",
                          f"Content-Encoding {encoding!r} is not supported; send identity, gzip or zstd")
    out = _Capped(limit)
    inflate = _inflater(kind, out)
    received = 0
    async for chunk in chunks:
        received += len(chunk)
        if received > limit:
            raise too_large(limit)
        inflate(chunk)
    return bytes(out.data)


class _Capped:
    """Inflated bytes, refused once past the limit: written to a chunk at a time, so a bomb is
    stopped after at most one chunk past the limit, never unpacked whole."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.data = bytearray()

    def write(self, data: bytes) -> int:
        self.data += data
        if len(self.data) > self.limit:
            raise too_large(self.limit)
        return len(data)


def _inflater(kind: str, out: _Capped) -> Callable[[bytes], object]:
    """A function that inflates one received chunk into ``out``."""
    if kind == "identity":
        return out.write
    if kind == "zstd":
        sink = cast(IO[bytes], out)  # stream_writer only calls write
        import zstandard  # the serve extra's; imported here so that the limits load without it

        writer = zstandard.ZstdDecompressor().stream_writer(sink, write_size=_CHUNK, closefd=False)
        return lambda chunk: _checked(writer.write, chunk, "zstd", zstandard.ZstdError)
    gzip = zlib.decompressobj(16 + zlib.MAX_WBITS)

    def inflate_gzip(chunk: bytes) -> None:
        while chunk:
            out.write(_checked(lambda data: gzip.decompress(data, _CHUNK), chunk, "gzip", zlib.error))
            chunk = gzip.unconsumed_tail
    return inflate_gzip


def _checked(inflate: Callable[[bytes], Any], chunk: bytes, kind: str, error: type[Exception]) -> Any:
    try:
        return inflate(chunk)
    except error as exc:
        raise HttpProblem(400, "invalid_encoding", f"the body is not valid {kind} ({exc})") from None


@dataclass(frozen=True)
class Problem:
    """One line of a request error: the field path it is at and what to fix."""

    path: str
    message: str

    @property
    def loc(self) -> list[str | int]:
        parts = [] if self.path == "request" else self.path.split(".")
        return ["body", *(int(p) if p.isdigit() else p for p in parts)]

    @property
    def question(self) -> str | None:
        parts = self.path.split(".")
        return parts[1] if len(parts) > 1 and parts[0] == "questions" else None


def problems(message: str) -> list[Problem]:
    """Split a ``RequestError``'s lines ("questions.q.criteria: must be ...") into problems."""
    out = []
    for line in message.splitlines() or [message]:
        path, sep, rest = line.partition(": ")
        if not sep or " " in path:
            path, rest = "request", line
        out.append(Problem(path, rest))
    return out


def error_body(problem: HttpProblem) -> dict[str, Any]:
    """The JSON of an error answer: a 422's ``detail`` has a line per problem, any other's says
    its type and message."""
    found = problem.found or [Problem("request", str(problem))]
    first = found[0]
    field = None if first.path == "request" else first.path
    detail: list[dict[str, Any]] | dict[str, str] = (
        [{"loc": p.loc, "msg": p.message, "type": problem.code} for p in found] if problem.status == 422
        else {"error_type": problem.kind, "message": str(problem)})
    return {"error": {"type": problem.kind, "code": problem.code, "message": str(problem),
                      "param": field, "field": field, "question": first.question},
            "detail": detail}


def request_id(given: str | None) -> str:
    """The client's ``X-Request-Id`` when it sent a usable one, else a new one."""
    if given and given.isprintable() and len(given) <= 200:
        return given
    return f"req_{uuid.uuid4().hex}"


async def send_problem(send: Any, problem: HttpProblem, scope: Any) -> None:
    """``problem`` answered on a raw ASGI ``send``, as the app answers it (its error body, its
    headers, the request's id): for a refusal made before the app, by a connection's limit, an
    origin check or Ray's proxy."""
    given = dict(scope.get("headers") or []).get(b"x-request-id", b"").decode("latin-1")
    rid = request_id(given or None).encode("latin-1")
    body = json.dumps(error_body(problem)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
               *((name.lower().encode(), value.encode()) for name, value in problem.headers.items()),
               (b"x-request-id", rid), (b"x-typesafe-request-id", rid)]
    await send({"type": "http.response.start", "status": problem.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
