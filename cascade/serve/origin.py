"""Requests a server on loopback with no key takes: those meant for this machine alone.

With no key, anything that can reach the port may ask, and on loopback that is meant to be this
machine's own programs. A web page in a browser here reaches it too: a cross-origin POST of
``text/plain`` needs no preflight, so a page could spend the teacher's time, and one whose domain
is re-bound to 127.0.0.1 (DNS rebinding) reads the answers, its requests naming the page's host.
So such a server answers only requests whose ``Host`` is a loopback name and whose ``Origin``,
where a browser sent one, is a loopback page too; others get 403 ``cross_origin``. Programs
(the SDKs, curl) send a loopback ``Host`` and no ``Origin``. A server that checks a key needs
none of this: a page cannot send the key.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from cascade.serve.transport import HttpProblem, send_problem
from cascade.teachers.keys import is_loopback


class LoopbackOnly:
    """ASGI middleware: 403 for a request whose ``Host``, or ``Origin`` where sent, is not this
    machine's (see the module)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        host = headers.get(b"host", b"").decode("latin-1")
        origin = headers.get(b"origin")
        # no Host at all (HTTP/1.0) is a program's: no browser sends none
        if (not host or _local(f"//{host}")) and (origin is None or _local(origin.decode("latin-1"))):
            await self.app(scope, receive, send)
            return
        await send_problem(send, HttpProblem(
            403, "cross_origin", "this server listens on loopback with no key, so it answers only requests "
            "from this machine's own programs (a loopback Host, no Origin of another site); to serve "
            "others, give it a key (--api-key)", kind="permission_error"), scope)


def _local(address: str) -> bool:
    """Whether a ``Host`` (given as ``//host:port``) or an ``Origin`` names this machine (an Origin
    of ``null``, a sandboxed page's, names none; a Host holding a user part or a path is no Host a
    browser sends, and is refused). ``localhost.`` and ``::ffff:127.0.0.1`` are loopback too."""
    try:
        parts = urlsplit(address)
        name = parts.hostname
    except ValueError:  # a port that is not a number, brackets left open
        return False
    if name is None or "@" in parts.netloc or parts.path or parts.query or parts.fragment:
        return False
    name = name.rstrip(".")
    return is_loopback(name.removeprefix("::ffff:") if name.startswith("::ffff:") else name)
