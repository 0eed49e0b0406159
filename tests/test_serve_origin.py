"""A server on loopback with no key answers this machine's programs only (``cascade.serve.origin``).

Before, a web page open in a browser here could POST to it (``text/plain`` needs no preflight) and,
its domain re-bound to 127.0.0.1, read the answers: the server took any ``Host`` and ``Origin``.
Here the middleware wraps a plain app on a real uvicorn, as ``cascade serve`` wraps its own, and
the command itself is run once to show it is wired in.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
from servers import free_port, serving, until
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from tinymodels import tiny_llama_path

from cascade.serve.origin import LoopbackOnly


async def echo(request: Request) -> Response:
    return JSONResponse({"ok": True})


def test_only_this_machines_programs_are_answered() -> None:
    routes = [Route("/v1/systemone", echo, methods=["POST"]), Route("/health", echo)]
    app = LoopbackOnly(Starlette(routes=routes))
    with serving(app, wait=False) as url:
        port = url.rsplit(":", 1)[1]
        post = lambda **headers: httpx.post(f"{url}/v1/systemone", content=b"{}",  # noqa: E731
                                            headers=headers, timeout=10)
        for host in (f"127.0.0.1:{port}", f"localhost:{port}", "[::1]", "api.localhost", "localhost.",
                     "[::ffff:127.0.0.1]"):
            assert post(Host=host).status_code == 200, host
        for host in ("evil.example@localhost", "localhost/evil"):  # no Host a browser sends
            assert post(Host=host).status_code == 403, host
        assert post(Origin=f"http://localhost:{port}").status_code == 200  # a page served here
        refused = post(Host=f"attacker.example:{port}", **{"X-Request-Id": "r-1"})  # a re-bound domain
        assert refused.status_code == 403 and refused.json()["error"]["code"] == "cross_origin"
        assert refused.headers["x-request-id"] == "r-1"
        for origin in ("https://attacker.example", "null"):  # a page elsewhere; a sandboxed one
            assert post(Origin=origin, **{"Content-Type": "text/plain"}).status_code == 403, origin
        assert post(Host="[::1").status_code == 403  # not a host at all


def test_cascade_serve_on_loopback_without_a_key_refuses_another_host(tmp_path: Path) -> None:
    """Wired in where it applies: a teacher-alone server here, with no key, on loopback."""
    port = free_port()
    env = {key: value for key, value in os.environ.items() if key != "CASCADE_API_KEY"}
    command = [sys.executable, "-m", "distill.cli", "serve", "--teacher", str(tiny_llama_path(tmp_path)),
               "--port", str(port), "--threads", "1"]
    server = subprocess.Popen(command, env=env, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        until(lambda: _health(base) == 200, "the server up")
        rebound = httpx.get(f"{base}/health", headers={"Host": "attacker.example"}, timeout=10)
        assert rebound.status_code == 403
    finally:
        server.terminate()
        server.wait(timeout=60)


def _health(base: str) -> int:
    try:
        return httpx.get(f"{base}/health", timeout=5).status_code
    except httpx.TransportError:
        return 0
