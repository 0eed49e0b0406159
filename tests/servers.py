"""A real ``cascade serve`` app on a free loopback port, in a thread, for tests that call it over HTTP.

The bundle is the session's trained one (encoder heads for "urgent" and "department"), its
teacher pinned to gemma-3-270m and run live, with thresholds that make the encoder keep every
"urgent" answer and escalate every "department" one (its threshold, a margin of 1, is never
reached, so an encoder answer is there to fall back on): each request's route is known.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import uvicorn

from cascade.bundle.manifest import Bundle, Manifest
from cascade.hashing import file_sha256
from cascade.readout.prompts import PROMPT_VERSION
from cascade.routing.router import Cascade
from cascade.serve.app import ServeConfig, create_app

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
def running(load: Callable[[], Cascade], config: ServeConfig | None = None,
            wait: bool = True) -> Iterator[str]:
    """Serve ``create_app(load, config)`` on loopback; yields the base URL. ``wait``: until
    /health says ok (the models loaded)."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(load, config), host="127.0.0.1", port=port,
                                           log_level="warning", access_log=False))
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
