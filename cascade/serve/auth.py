"""Who may call a System One app of this package: its API key, a separate key for ``/metrics``,
or, with forwarded auth, the upstream's word on each caller's own key (``UpstreamClient``: a key
it refused lately is refused here at once, and one it has not accepted lately is asked about on
routes that send nothing upstream). Keys are compared in constant time and never echoed.

Checking a key with the upstream takes a call (seconds, where the upstream is slow to refuse), so
a client sending junk keys must not tie up what good callers need: the checks run on threads of
their own (``KeyChecks``), at most ``MAX_KEY_CHECKS`` at once, and past that a caller whose key is
not known is answered 503 with ``Retry-After`` at once; a key the upstream answered lately needs
no check, so its callers never wait on them."""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import Request

from cascade.serve.transport import HttpProblem

if TYPE_CHECKING:
    from cascade.teachers.client import UpstreamClient


BOTH_KEYS = ("forwarded auth and an API key would both check the caller's one Authorization header: "
             "either the upstream checks it (--forward-auth) or this server does (--api-key, or "
             "$CASCADE_API_KEY); give one of them")


MAX_KEY_CHECKS = 4
"""Callers' keys checked with the upstream at once, per server (see the module)."""

T = TypeVar("T")


class KeyChecks:
    """Calls that check a caller's key with the upstream: on a pool of their own (not the event
    loop's default one, which validation and the engine's submissions use), at most ``most`` at
    once, the next refused with 503 and ``Retry-After: 1``. Counted on the event loop alone."""

    def __init__(self, most: int = MAX_KEY_CHECKS) -> None:
        self.most, self.inside = most, 0
        self._pool = ThreadPoolExecutor(most, "cascade-key-check")

    async def run(self, check: Callable[..., T], *args: Any) -> T:
        if self.inside >= self.most:
            raise HttpProblem(503, "busy", f"{self.most} callers' keys are being checked with the upstream "
                              "now; retry shortly", {"Retry-After": "1"}, kind="unavailable_error")
        self.inside += 1
        try:
            return await asyncio.wrap_future(self._pool.submit(check, *args))
        finally:
            self.inside -= 1

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def app_options(docs: bool) -> dict[str, Any]:
    """FastAPI's arguments every app here takes: the documentation routes (/docs, /redoc,
    /openapi.json) off unless ``docs``, and no redirect of a path with a trailing slash
    (Starlette's default answers 307 to the client's own Host header, before any key is
    checked: an open redirect; such a path is a 404 here)."""
    off = {} if docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    return {"redirect_slashes": False, **off}


def authorize(request: Request, key: str | None, what: str = "API key") -> None:
    """401 unless the request carries ``Authorization: Bearer KEY`` (nothing is checked where
    ``key`` is None); ``what`` names the key in the refusal."""
    if key is None:
        return
    given = request.headers.get("authorization", "")
    scheme, _, token = given.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
        raise HttpProblem(401, "unauthorized", f"missing or wrong {what}; send Authorization: Bearer KEY",
                          {"WWW-Authenticate": "Bearer"}, kind="authentication_error")


async def check_caller(request: Request, key: str | None, forwarding: UpstreamClient | None = None,
                       checks: KeyChecks | None = None) -> None:
    """Check a request's caller: against ``key`` here (None: nothing is checked); or, with
    forwarded auth (``forwarding``: the upstream's client), a key the upstream refused lately gets
    its refusal at once (no upstream call, no slot), and with ``checks`` (a route that sends
    nothing upstream) one it has not accepted lately is checked with it now, through them."""
    if forwarding is None:
        authorize(request, key)
        return
    authorization = request.headers.get("authorization")
    forwarding.refuse_rejected(authorization)
    if checks is not None and not forwarding.accepted.accepted(authorization):
        await checks.run(forwarding.vouch, authorization)


async def check_metrics(request: Request, metrics_key: str | None, key: str | None,
                        forwarding: UpstreamClient | None, checks: KeyChecks) -> None:
    """``/metrics``: the metrics key where one is given, else as every other route."""
    if metrics_key is not None:
        authorize(request, metrics_key, "metrics key")
        return
    await check_caller(request, key, forwarding, checks)
