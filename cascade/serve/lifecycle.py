"""The server's lifecycle: build the app for a bundle, serve it on uvicorn, stop on SIGTERM.

``serve`` is what ``cascade serve`` calls. The bundle's cascade loads in a thread while
``/health`` answers 503; SIGTERM (or Ctrl-C) stops taking requests, finishes those in flight
within ``grace`` seconds and returns; a bundle that failed to load stops the server and is
raised as a ``CascadeError``. This module imports without the ``serve`` extra; ``serve`` needs
it, and says how to install it.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from cascade.errors import CascadeError

if TYPE_CHECKING:
    from cascade.audit.auditor import Auditor
    from cascade.encoder.onnx_encoder import Device
    from cascade.readout.placement import Placements
    from cascade.routing.router import Cascade

API_KEY_VARIABLE = "CASCADE_API_KEY"
SERVE_EXTRA = 'pip install "cascade-router[serve]"'
log = logging.getLogger("cascade.serve")


@dataclass(frozen=True)
class ServeOptions:
    """Where the server listens and how it answers.

    ``api_key``: the Bearer key the /v1 routes require (None: ``$CASCADE_API_KEY`` where set,
    else no auth). ``max_body``: largest request body in bytes, after inflating (None: 32 MiB).
    ``grace``: seconds SIGTERM waits for requests in flight. The rest are the engine's
    (``cascade.serve.engine.EngineSettings``): ``batch`` the requests waiting at the encoder
    together, at most ``max_batch``; at most ``teacher_queue`` requests wait for the top tier,
    and past it one is refused or ``overload="keep"`` keeps its best cheaper answer; at most
    ``audit_queue`` audits wait.
    """

    host: str = "127.0.0.1"
    port: int = 8080
    api_key: str | None = None
    max_body: int | None = None
    grace: int = 30
    batch: bool = True
    max_batch: int = 64
    teacher_queue: int = 32
    overload: Literal["refuse", "keep"] = "refuse"
    audit_queue: int = 64


AuditHook = Callable[["Cascade"], "Auditor | None"]
"""Makes the auditor of the loaded cascade (None: no audit); ``distill.auditing.StoreAudits`` is one."""


def serve(
    bundle: Path,
    options: ServeOptions | None = None,
    *,
    teacher: Path | None = None,
    device: Device = "cpu",
    threads: int | None = None,
    placement: Placements = None,
    accept_other_teacher: bool = False,
    audit: AuditHook | None = None,
) -> None:
    """Serve ``bundle``'s cascade at POST /v1/systemone until SIGTERM or Ctrl-C.

    ``teacher``, ``device``, ``threads``, ``placement`` and ``accept_other_teacher`` load the
    cascade as ``Cascade.load`` does; ``audit`` makes its auditor once it has loaded. Blocks while
    serving; raises ``CascadeError`` without the serve extra, for a folder that is not a bundle,
    and when the bundle failed to load (the server stops then).
    """
    try:
        import uvicorn

        from cascade.serve.app import ServeConfig, create_app
        from cascade.serve.engine import EngineSettings
        from cascade.serve.transport import DEFAULT_MAX_BODY
    except ImportError as exc:
        raise CascadeError(f"cascade serve needs the serve extra ({exc}): {SERVE_EXTRA}") from None
    from cascade.routing.router import Cascade

    options = options or ServeOptions()
    bundle = Path(bundle)
    if not (bundle / "manifest.json").is_file():
        raise CascadeError(f"no bundle at {bundle} (no manifest.json); give a folder that "
                           "cascade train wrote")
    key = options.api_key or os.environ.get(API_KEY_VARIABLE) or None
    settings = EngineSettings(batch=options.batch, max_batch=options.max_batch,
                              teacher_queue=options.teacher_queue, overload=options.overload,
                              audit_queue=options.audit_queue)
    failures: list[BaseException] = []
    server: uvicorn.Server | None = None

    def load() -> Cascade:
        return Cascade.load(bundle, teacher=teacher, device=device, threads=threads, placement=placement,
                            accept_other_teacher=accept_other_teacher)

    def failed(exc: BaseException) -> None:
        failures.append(exc)
        if server is not None:
            server.should_exit = True

    config = ServeConfig(api_key=key, max_body=options.max_body or DEFAULT_MAX_BODY, engine=settings,
                         audit=audit)
    app = create_app(load, config, failed)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    server = uvicorn.Server(uvicorn.Config(app, host=options.host, port=options.port, log_level="warning",
                                           access_log=False, timeout_graceful_shutdown=options.grace))
    log.info(f"serving {bundle} at http://{options.host}:{options.port}/v1/systemone "
             f"(auth {'on' if key else 'off'}; models loading, /health says when ready)")
    if threading.current_thread() is threading.main_thread():
        # uvicorn stops gracefully on SIGTERM and then raises the signal again under the handler
        # it found: this one, so that a requested stop returns instead of dying of the signal
        signal.signal(signal.SIGTERM, lambda *_: None)
    server.run()
    if failures:
        failure = failures[0]
        if isinstance(failure, CascadeError):
            raise failure
        raise CascadeError(f"loading the bundle failed: {type(failure).__name__}: {failure}") from failure
