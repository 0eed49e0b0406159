"""The HTTP edge every System One app of this package shares: loading in a thread while
``/health`` answers, reading a body within its size and time limits, error answers in the shape
the SDKs read (``cascade.serve.transport``), and a request id on every answer."""

from __future__ import annotations

import asyncio
import logging
import re
import threading
from collections.abc import Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cascade.errors import CascadeError, ServiceError
from cascade.serve.gone import ClientGone
from cascade.serve.transport import HttpProblem, error_body, problems, read_body, request_id, slow_body

log = logging.getLogger("cascade.serve")
LOADING_RETRY_AFTER = "5"
DEFAULT_RECEIVE_TIMEOUT = 10.0
"""Seconds a client has to send a request's head, and again its body (the SDKs send at once)."""


def lifespan_of(close: Callable[[], None], load: Callable[[], None] | None = None,
                failed: Callable[[BaseException], None] | None = None) -> Callable[[FastAPI], Any]:
    """The one lifespan of every app here: ``load`` (where there is one) runs in a thread, so
    that /health answers while models load, and an exception it raises goes to ``failed``;
    ``close`` runs at shutdown, once the load is done."""

    def load_in_thread() -> None:
        try:
            if load is not None:
                load()
        except BaseException as exc:
            if failed is None:
                raise
            failed(exc)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> Any:
        loader = threading.Thread(target=load_in_thread, name="cascade-load", daemon=True)
        loader.start()
        yield
        await asyncio.to_thread(loader.join)
        close()

    return lifespan


def still_loading(what: str) -> HttpProblem:
    """The 503 a route answers while ``what`` loads (``what``: "the models are", say)."""
    return HttpProblem(503, "loading", f"{what} still loading; retry shortly",
                       {"Retry-After": LOADING_RETRY_AFTER}, kind="unavailable_error")


def health(ready: bool, failure: BaseException | None, **facts: Any) -> Response:
    """``/health``: 503 while loading (or failed to load), then ok with ``facts``."""
    if not ready:
        status = "failed" if failure is not None else "loading"
        return JSONResponse({"status": status}, 503, {"Retry-After": LOADING_RETRY_AFTER})
    return JSONResponse({"status": "ok", **facts})


def unprocessable(exc: CascadeError) -> HttpProblem:
    return HttpProblem(422, "invalid_request", str(exc), found=problems(str(exc)))



async def request_body(request: Request, limit: int, timeout: float = DEFAULT_RECEIVE_TIMEOUT) -> bytes:
    """The body, inflated and at most ``limit`` bytes (413), received within ``timeout`` seconds
    (408): a client that sends it slowly does not hold the server."""
    declared = request.headers.get("content-length")
    encoding = request.headers.get("content-encoding")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise HttpProblem(413, "request_too_large", f"request body of {declared} bytes is over the "
                          f"server's limit of {limit} bytes; send fewer or shorter states per request")
    try:
        return await asyncio.wait_for(read_body(request.stream(), encoding, limit), timeout)
    except asyncio.TimeoutError:
        raise slow_body(timeout) from None
    except ClientDisconnect:  # hung up mid-body, or framed it so the server closed it: not a bug
        raise ClientGone from None


def add_wire(app: FastAPI) -> None:
    """What every System One app of this package answers with: its error bodies (a refused
    request, a failed upstream or a full queue with its status and Retry-After, a bug) and the
    request id on every answer."""
    app.add_exception_handler(HttpProblem, _problem_handler)  # type: ignore[arg-type]
    app.add_exception_handler(ServiceError, _service_handler)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, _http_handler)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, _bug_handler)
    app.add_middleware(_RequestIds)


async def _problem_handler(request: Request, problem: HttpProblem) -> Response:
    return JSONResponse(error_body(problem), problem.status, problem.headers)


async def _service_handler(request: Request, exc: ServiceError) -> Response:
    """An upstream's own 4xx passed back unchanged (status, body, type); any other failure a
    client can act on as an error body with its status and Retry-After."""
    if exc.body is not None:
        return Response(exc.body, exc.status, exc.headers, media_type=exc.content_type)
    code = re.sub(r"(?<!^)(?=[A-Z])", "_", type(exc).__name__).lower().removesuffix("_error")
    kind = "rate_limit_error" if exc.status == 429 else \
        "invalid_request_error" if 400 <= exc.status < 500 else "server_error"
    problem = HttpProblem(exc.status, code, str(exc), exc.headers, kind=kind)
    return JSONResponse(error_body(problem), exc.status, exc.headers)


async def _http_handler(request: Request, exc: StarletteHTTPException) -> Response:
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, f"http_{exc.status_code}")
    problem = HttpProblem(exc.status_code, code, str(exc.detail))
    return JSONResponse(error_body(problem), exc.status_code, dict(exc.headers or {}))


async def _bug_handler(request: Request, exc: Exception) -> Response:
    """A bug: the client gets its request id, never the exception's words (they may quote a
    secret or a state); the traceback goes to the operator's log under that id, URLs' passwords
    hidden (``cascade.private``)."""
    import traceback

    from cascade.private import redact_text

    rid = getattr(request.state, "request_id", "?")
    log.error("request %s failed\n%s", rid, redact_text("".join(traceback.format_exception(exc))).rstrip())
    problem = HttpProblem(500, "internal_error", f"the server failed on request {rid}; this is a bug in "
                          "cascade serve, and its log holds the details under that request id",
                          kind="server_error")
    # answered from outside the request-id middleware, so the id headers are set here
    return JSONResponse(error_body(problem), 500, {"X-Request-Id": rid, "x-typesafe-request-id": rid})


class _RequestIds:
    """Give every request an id (the client's ``X-Request-Id`` or a new one) and every answer
    the headers that carry it back, where the answer does not carry them already (a pass-through
    returns the upstream's); pure ASGI, so that it costs no task per request."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        rid = request_id(headers.get(b"x-request-id", b"").decode("latin-1") or None)
        scope.setdefault("state", {})["request_id"] = rid

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                raw = rid.encode("latin-1")
                given = {name.lower() for name, _ in message.get("headers", [])}
                message["headers"] = [*message.get("headers", []),  # a pass-through's upstream's are kept
                                      *((name, raw) for name in (b"x-request-id", b"x-typesafe-request-id")
                                        if name not in given)]
            await send(message)

        await self.app(scope, receive, send_with_id)
