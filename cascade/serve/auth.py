"""Who may call a System One app of this package: its API key, a separate key for ``/metrics``,
or, with forwarded auth, the upstream's word on each caller's own key (``UpstreamClient``: a key
it refused lately is refused here at once, and one it has not accepted lately is asked about on
routes that send nothing upstream). Keys are compared in constant time and never echoed."""

from __future__ import annotations

import asyncio
import hmac
from typing import TYPE_CHECKING, Any

from fastapi import Request

from cascade.serve.transport import HttpProblem

if TYPE_CHECKING:
    from cascade.teachers.client import UpstreamClient


BOTH_KEYS = ("forwarded auth and an API key would both check the caller's one Authorization header: "
             "either the upstream checks it (--forward-auth) or this server does (--api-key, or "
             "$CASCADE_API_KEY); give one of them")


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
                       vouch: bool = False) -> None:
    """Check a request's caller: against ``key`` here (None: nothing is checked); or, with
    forwarded auth (``forwarding``: the upstream's client), a key the upstream refused lately gets
    its refusal at once (no upstream call, no slot), and with ``vouch`` (a route that sends
    nothing upstream) one it has not accepted lately is checked with it now."""
    if forwarding is None:
        authorize(request, key)
        return
    authorization = request.headers.get("authorization")
    if vouch:
        await asyncio.to_thread(forwarding.vouch, authorization)
    else:
        forwarding.refuse_rejected(authorization)


async def check_metrics(request: Request, metrics_key: str | None, key: str | None,
                        forwarding: UpstreamClient | None) -> None:
    """``/metrics``: the metrics key where one is given, else as every other route."""
    if metrics_key is not None:
        authorize(request, metrics_key, "metrics key")
        return
    await check_caller(request, key, forwarding, vouch=True)
