"""A real ``cascade serve`` app on a free loopback port, in a thread, for tests that call it over HTTP.

The bundle is the session's trained one (encoder heads for "urgent" and "department"), its
teacher pinned to gemma-3-270m and run live, with thresholds that make the encoder keep every
"urgent" answer and escalate every "department" one (its threshold, a margin of 1, is never
reached, so an encoder answer is there to fall back on): each request's route is known.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import uvicorn

from cascade.bundle.manifest import Bundle, Manifest
from cascade.hashing import file_sha256
from cascade.readout.prompts import PROMPT_VERSION
from cascade.routing.router import Cascade
from cascade.serve.app import ServeConfig, create_app
from cascade.serve.lifecycle import ServeOptions, server_config

KEPT, ESCALATED = "urgent", "department"


def serving_bundle(bundle: Bundle, directory: Path, teacher: Path) -> Path:
    """A copy of ``bundle`` whose labels came from ``teacher``, the encoder keeping every KEPT
    answer and escalating every ESCALATED one."""
    data = bundle.manifest.model_dump(mode="json")
    data["teacher"] = {"kind": "gguf", "model": teacher.name, "model_sha256": file_sha256(teacher),
                       "prompt_version": PROMPT_VERSION}
    data["name"] = directory.name
    data["thresholds"] = {KEPT: {"encoder": 0.0}, ESCALATED: {"encoder": 1.0}}
    data["calibration"] = {"calibrated_at": "2026-12-01T00:00:00Z", "target": 0.95, "delta": 0.05,
                           "costs": {"encoder": {"seconds_per_state": 1e-3, "seconds_per_token": 0.0},
                                     "teacher": {"seconds_per_state": 0.1, "seconds_per_token": 0.0}}}
    Bundle(Manifest.model_validate(data), bundle.directory).save(directory)
    return directory


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@contextmanager
def running(load: Callable[[], Cascade] | None, config: ServeConfig | None = None,
            wait: bool = True, options: ServeOptions | None = None) -> Iterator[str]:
    """Serve ``create_app(load, config)`` on loopback; yields the base URL. ``wait``: until
    /health says ok (the models loaded); ``options``: uvicorn's limits (see ``serving``)."""
    with serving(create_app(load, config), wait, options) as url:
        yield url


@contextmanager
def serving(app: Any, wait: bool = True, options: ServeOptions | None = None) -> Iterator[str]:
    """Serve the ASGI ``app`` on loopback in a thread, as ``cascade serve`` does (its connection
    limit and request deadlines: ``options``, defaults but the port); yields the base URL (see
    ``running``)."""
    port = free_port()
    server = uvicorn.Server(server_config(app, replace(options or ServeOptions(), port=port)))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_for(url, "ok" if wait else None)
        yield url
    finally:
        server.should_exit = True
        thread.join(timeout=60)


def _wait_for(url: str, status: str | None, seconds: float = 120.0) -> None:
    """Until the server answers /health (with ``status``, when given)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            health = httpx.get(f"{url}/health", timeout=5).json()
            if status is None or health["status"] == status:
                return
            if health["status"] == "failed":
                raise RuntimeError("the server's models failed to load")
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"{url} did not become ready in {seconds} s")


def request_json(state: str, questions: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"state": state, "questions": questions, **extra}


# --- upstream System One servers in processes of their own, to kill, pause and swap ---

VENV_BIN = Path(sys.executable).parent
MOCK_MODEL = "mock"
"""The model name jevcompat's mock takes in a request (it requires one: ../shared/notes/upstreams.md)."""


class Upstream:
    """A System One server in a process of its own on a loopback port: ``url`` is its
    /v1/systemone. ``pause`` (SIGSTOP) makes it a server that takes connections and never answers;
    ``kill`` one that is gone; ``stop`` ends it."""

    def __init__(self, command: list[str], port: int, ready: str = "/v1/models",
                 env: dict[str, str] | None = None) -> None:
        self.command, self.port, self.ready = command, port, ready
        self.base = f"http://127.0.0.1:{port}"
        self.url = f"{self.base}/v1/systemone"
        self._log = tempfile.TemporaryFile()  # noqa: SIM115  (not a pipe: a full one stalls the server)
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=self._log,
                                        env={**os.environ, **(env or {})})

    def wait_ready(self, seconds: float = 120.0) -> Upstream:
        """Until the server answers ``ready`` with any status below 500 (or raise, with its stderr)."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                message = f"{self.command[:3]} exited {self.process.returncode}: {self.stderr()}"
                self.stop()
                raise RuntimeError(message)
            try:
                if httpx.get(f"{self.base}{self.ready}", timeout=5).status_code < 500:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        message = f"{self.command[:3]} was not ready in {seconds} s: {self.stderr()}"
        self.stop()
        raise TimeoutError(message)

    def pause(self) -> None:
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.process.send_signal(signal.SIGCONT)

    def kill(self) -> None:
        self.process.send_signal(signal.SIGCONT)
        self.process.kill()
        self.process.wait(timeout=30)

    def stop(self) -> None:
        """End the server (SIGTERM, then SIGKILL after 30 s) and close its log."""
        self._stop()
        self._log.close()

    def _stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=30)

    def stderr(self) -> str:
        """The last of what the server wrote to stderr so far."""
        self._log.seek(0)
        return self._log.read().decode(errors="replace")[-2000:]


def jevcompat_mock(*faults: str, key: str | None = None, port: int | None = None,
                   busy_every: int = 0) -> Upstream:
    """jevcompat 0.1.1's reference server (``jevcompat mock``), with ``faults`` injected, on a free
    port (or ``port``). ``busy_every``: every Nth request gets 429 with ``Retry-After: 0``, a
    setting of its ``MockConfig`` that its command line does not expose, so the server is then
    started from its own ``make_server``."""
    port = port or free_port()
    if busy_every:
        code = ("from jevcompat.mock import MockConfig, make_server\n"
                f"make_server(MockConfig(key={key!r}, faults=frozenset({list(faults)!r}), "
                f"busy_every={busy_every}), port={port}).serve_forever()")
        return Upstream([sys.executable, "-c", code], port).wait_ready()
    command = [str(VENV_BIN / "jevcompat"), "mock", "--port", str(port)]
    command += [f"--fault={fault}" for fault in faults] + (["--key", key] if key else [])
    return Upstream(command, port).wait_ready()


def teacher_server(model: Path, port: int | None = None, *extra: str) -> Upstream:
    """The project's own teacher server, ``cascade serve --teacher MODEL`` with no bundle, on one
    thread (the tests share two cores)."""
    port = port or free_port()
    command = [sys.executable, "-m", "distill.cli", "serve", "--teacher", str(model), "--port", str(port),
               "--threads", "1", *extra]
    return Upstream(command, port, ready="/health").wait_ready()


@contextmanager
def upstream(server: Upstream) -> Iterator[Upstream]:
    """``server``, stopped when the block ends however it ends."""
    try:
        yield server
    finally:
        server.stop()


@contextmanager
def mock_at(port: int = 0, **config: Any) -> Iterator[tuple[str, Any]]:
    """jevcompat's mock from its own ``make_server`` on a thread of this process, on ``port`` (0: a
    free one): yields its /v1/systemone URL and its ``MockConfig``, whose ``requests`` counts what
    it saw."""
    from jevcompat.mock import MockConfig, make_server

    cfg = MockConfig(**config)
    server = make_server(cfg, port=port)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1/systemone", cfg
    finally:
        server.shutdown()
        server.server_close()


def until(check: Callable[[], bool], what: str, seconds: float = 120.0) -> None:
    """Wait, bounded, for ``check``: a condition on the servers, never on the time taken."""
    deadline = time.monotonic() + seconds
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not reached within {seconds} s")
        time.sleep(0.05)
