"""The server's lifecycle: build the app for a bundle, serve it on uvicorn, stop on SIGTERM.

``serve`` is what ``cascade serve`` calls (following promotions of ``--bundle``: SIGHUP looks at
once); ``serve_teacher`` what ``cascade serve --teacher X.gguf`` without a bundle calls (the
teacher's own System One server); ``serve_proxy`` what ``cascade serve --teacher URL`` without a
bundle calls (a pass-through that may collect the traffic it forwards). The models load in a
thread while ``/health`` answers 503; SIGTERM (or Ctrl-C) stops taking requests, finishes those
in flight within ``grace`` seconds and returns; models that failed to load stop the server and
are raised as a ``CascadeError``. This module imports without the ``serve`` extra; serving
needs it, and says how to install it.

Safe defaults on an open port (``check_auth``, before anything loads): a host other than loopback
is refused unless a key is checked (an API key, or forwarded auth), or ``insecure_no_auth`` asks
for an open port on purpose (one warning line then); an API key and forwarded auth are refused
together. ``/metrics`` takes the API key, or a metrics key of its own; ``/docs``, ``/redoc`` and
``/openapi.json`` are off unless ``docs``.
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
from typing import TYPE_CHECKING, Any, Literal

from cascade.errors import CascadeError, OpenPortError

if TYPE_CHECKING:
    from cascade.audit.auditor import Auditor
    from cascade.collect.collector import Collector, Sink
    from cascade.collect.escalation import EscalationRecord
    from cascade.collect.record import CollectedItem
    from cascade.cost.upstream import UpstreamPrice
    from cascade.encoder.onnx_encoder import Device
    from cascade.readout.placement import Placements
    from cascade.readout.prompts import Layout
    from cascade.routing.endpoint import Teacher
    from cascade.routing.router import Cascade
    from cascade.serve.limits import RequestLimits
    from cascade.teachers.settings import UpstreamSettings

API_KEY_VARIABLE = "CASCADE_API_KEY"
METRICS_KEY_VARIABLE = "CASCADE_METRICS_KEY"
SERVE_EXTRA = "pip install -e '.[serve]'"
log = logging.getLogger("cascade.serve")


@dataclass(frozen=True)
class ServeOptions:
    """Where the server listens and how it answers.

    ``api_key``: the Bearer key the /v1 routes require (None: ``$CASCADE_API_KEY`` where set,
    else no auth). ``max_body``: largest request body in bytes, after inflating (None: 2 MiB).
    ``grace``: seconds SIGTERM waits for requests in flight. The rest are the engine's
    (``cascade.serve.engine.EngineSettings``): ``batch`` the requests waiting at the encoder
    together, at most ``max_batch``; the top tier's queue (a local GGUF or an upstream) admits a
    request only while its expected wait fits ``max_wait`` (None: 8 s, below the SDKs' 10 s; 5 s
    for a teacher served alone, ``cascade.teachers.admission.TEACHER_MAX_WAIT``), and past it one
    is refused with 503 and Retry-After or ``overload="keep"`` keeps its best cheaper answer; at
    most ``audit_queue`` audits wait (past it one drawn at random is dropped), and at most
    ``audit_in_flight`` are at an upstream teacher at once. ``forward_auth``: an upstream teacher
    checks each caller's key (the client's Authorization is sent on), and local answers go only to
    keys it accepted lately.
    ``watch``: seconds between looks at ``--bundle`` for a promoted bundle (0: on SIGHUP only).
    ``upstream_price``: what an upstream teacher costs (None: priced by its measured latency).
    ``limits``: the work one request may carry (None: ``cascade.serve.limits``' defaults).
    ``lower_queue``: most requests waiting at a tier below the top. ``max_connections``: open
    connections kept (``cascade.serve.connections``), and requests in flight past which one gets 503.
    ``receive_timeout``: seconds a client has to send a request's head, and again its body,
    before its connection is closed (408 for a body): a slow client cannot hold a slot.
    ``metrics_key``: the Bearer key ``/metrics`` requires instead of the API key (None:
    ``$CASCADE_METRICS_KEY`` where set, else as the /v1 routes). ``docs``: serve ``/docs``,
    ``/redoc`` and ``/openapi.json``. ``insecure_no_auth``: serve a host other than loopback
    with no key checked (refused without it; see ``check_auth``).
    """

    host: str = "127.0.0.1"
    port: int = 8080
    api_key: str | None = None
    max_body: int | None = None
    grace: int = 30
    batch: bool = True
    max_batch: int = 64
    overload: Literal["refuse", "keep"] = "refuse"
    audit_queue: int = 64
    audit_in_flight: int = 4
    max_wait: float | None = None
    forward_auth: bool = False
    watch: float = 2.0
    upstream_price: UpstreamPrice | None = None
    limits: RequestLimits | None = None
    lower_queue: int = 1024
    max_connections: int = 512
    receive_timeout: float = 10.0
    metrics_key: str | None = None
    docs: bool = False
    insecure_no_auth: bool = False


AuditHook = Callable[["Cascade"], "Auditor | None"]
"""Makes the auditor of the loaded cascade (None: no audit); ``distill.loop.auditing.StoreAudits`` is one."""


@dataclass(frozen=True)
class BundleParts:
    """What serving a bundle takes besides its folder and the server's options: ``teacher``,
    ``device``, ``threads``, ``placement`` and ``accept_other_teacher`` load the cascade as
    ``Cascade.load`` does; ``audit`` makes its auditor once it has loaded; ``escalations`` keeps
    the teacher's answers to escalated questions (closed when serving ends; its sink is the
    caller's to close)."""

    teacher: Teacher | None = None
    device: Device = "cpu"
    threads: int | None = None
    placement: Placements = None
    accept_other_teacher: bool = False
    audit: AuditHook | None = None
    escalations: Collector[EscalationRecord] | None = None


def serve(bundle: Path, options: ServeOptions | None = None, parts: BundleParts | None = None) -> None:
    """Serve ``bundle``'s cascade, loaded with ``parts``, at POST /v1/systemone until SIGTERM or
    Ctrl-C.

    Blocks while serving; raises ``CascadeError`` without the serve extra, for a folder that is
    not a bundle, and when the bundle failed to load (the server stops then).
    """
    options = options or ServeOptions()
    run = _Run(options, "the bundle")
    app, auth = bundle_app(bundle, options, parts, on_failure=run.failed)
    follows = f"follows {bundle} every {options.watch:g} s and on SIGHUP" if options.watch > 0 else \
        f"takes {bundle} again on SIGHUP"
    run.serve(app, f"serving {bundle} at http://{options.host}:{options.port}/v1/systemone "
              f"(auth {'forwarded' if options.forward_auth else 'on' if auth.key else 'off'}; {follows}; "
              "models loading, /health says when ready)", keyed=auth.key is not None,
              hangup=lambda: _poke(app))


def bundle_app(bundle: Path, options: ServeOptions, parts: BundleParts | None = None,
               on_failure: Callable[[BaseException], None] | None = None) -> tuple[Any, Auth]:
    """The ASGI app ``serve`` runs and the auth it checks, for a host that runs the app itself (a
    Ray Serve replica: ``distill.cli.serve.replicas``); refused as ``serve`` refuses, before a model loads."""
    try:
        import uvicorn  # noqa: F401  (the serve extra: refused here, before the bundle loads)

        from cascade.serve.app import BundleSource, ServeConfig, create_app
        from cascade.serve.engine_settings import EngineSettings
        from cascade.serve.limits import RequestLimits
        from cascade.serve.swap import resolve
        from cascade.serve.transport import DEFAULT_MAX_BODY
    except ImportError as exc:
        raise CascadeError(f"cascade serve needs the serve extra ({exc}): {SERVE_EXTRA}") from None
    from cascade.cost.upstream import UpstreamLedger
    from cascade.routing.router import Cascade

    bundle, parts = Path(bundle), parts or BundleParts()
    # what can be refused without loading a model is refused before the port opens
    auth = _checked(options, options.forward_auth, forwardable=True)
    key = auth.key
    Cascade.preflight(resolve(bundle), teacher=parts.teacher, accept_other_teacher=parts.accept_other_teacher)
    settings = EngineSettings(batch=options.batch, max_batch=options.max_batch, max_wait=_wait(options),
                              overload=options.overload, audit_queue=options.audit_queue,
                              audit_in_flight=options.audit_in_flight,
                              forward_auth=options.forward_auth, lower_queue=options.lower_queue)

    def load(directory: Path) -> Cascade:
        return Cascade.load(directory, teacher=parts.teacher, device=parts.device, threads=parts.threads,
                            placement=parts.placement, accept_other_teacher=parts.accept_other_teacher)

    config = ServeConfig(api_key=key, max_body=options.max_body or DEFAULT_MAX_BODY, engine=settings,
                         audit=parts.audit, bundle=BundleSource(bundle, load, options.watch),
                         ledger=UpstreamLedger(options.upstream_price), escalations=parts.escalations,
                         limits=options.limits or RequestLimits(), receive_timeout=options.receive_timeout,
                         metrics_key=auth.metrics_key, docs=options.docs)
    return create_app(None, config, on_failure), auth


def _poke(app: Any) -> None:
    """SIGHUP: look at --bundle now (a promotion)."""
    watch = app.state.loaded.watch
    if watch is not None:
        watch.poke()


def serve_proxy(upstream: UpstreamSettings, options: ServeOptions | None = None,
                collect: Sink[CollectedItem] | None = None, share: float = 1.0,
                max_items: int | None = None) -> None:
    """Serve a transparent pass-through to ``upstream`` at POST /v1/systemone until SIGTERM or
    Ctrl-C (``cascade.serve.proxy``); with ``collect``, a seeded ``share`` of the requests it
    forwards, up to ``max_items`` in the sink, is recorded there. Raises ``CascadeError`` as
    ``serve`` does."""
    try:
        from cascade.serve.limits import RequestLimits
        from cascade.serve.proxy import ProxyConfig, create_proxy_app
        from cascade.serve.transport import DEFAULT_MAX_BODY
        from cascade.teachers.connect import open_client
    except ImportError as exc:
        raise CascadeError(f"cascade serve needs the serve extra ({exc}): {SERVE_EXTRA}") from None
    from cascade.collect.collector import Collector
    from cascade.cost.upstream import UpstreamLedger

    options = options or ServeOptions()
    checked = _checked(options, upstream.forward_auth, forwardable=True)
    key = checked.key
    collector = Collector(collect, share, max_items) if collect is not None else None
    config = ProxyConfig(api_key=key, max_body=options.max_body or DEFAULT_MAX_BODY,
                         max_wait=_wait(options), collector=collector,
                         ledger=UpstreamLedger(options.upstream_price), metrics_key=checked.metrics_key,
                         docs=options.docs, limits=options.limits or RequestLimits(),
                         receive_timeout=options.receive_timeout)
    app = create_proxy_app(open_client(upstream), config)
    what = f"; collecting {share:.0%} of requests" + (f", up to {max_items}" if max_items else "") \
        if collector is not None else ""
    auth = "forwarded" if upstream.forward_auth else "on" if key else "off"
    _Run(options, "the pass-through").serve(
        app, f"passing requests through to {upstream.shown} at http://{options.host}:{options.port}"
        f"/v1/systemone (auth {auth}; admits while the expected wait is at most "
        f"{_wait(options):g} s{what})", keyed=key is not None)


def serve_teacher(teacher: Path, options: ServeOptions | None = None, *, placement: Placements = None,
                  layout: Layout = "state-first") -> None:
    """Serve ``teacher``'s raw logit readout at POST /v1/systemone until SIGTERM or Ctrl-C: the
    teacher's own System One server (``cascade.serve.teacher``), which a cascade elsewhere can
    take as its URL teacher. ``placement`` places the model (GPU layers, threads, n_ctx); its
    prompts are read in ``layout``. Its queue admits a request only while the expected wait fits
    ``options.max_wait``. Raises ``CascadeError`` as ``serve`` does."""
    options = options or ServeOptions()
    run = _Run(options, "the teacher model")
    app, auth = teacher_app(teacher, options, placement=placement, layout=layout, on_failure=run.failed)
    run.serve(app, f"serving the readout of {Path(teacher).name} at http://{options.host}:{options.port}"
              f"/v1/systemone (auth {'on' if auth.key else 'off'}; admits while the expected wait is at "
              f"most {_wait(options, alone=True):g} s; model loading, /health says when ready)",
              keyed=auth.key is not None)


def teacher_app(teacher: Path, options: ServeOptions, *, placement: Placements = None,
                layout: Layout = "state-first", on_failure: Callable[[BaseException], None] | None = None
                ) -> tuple[Any, Auth]:
    """The ASGI app ``serve_teacher`` runs and the auth it checks, for a host that runs the app
    itself (a Ray Serve replica: ``distill.cli.serve.replicas``); refused as ``serve_teacher`` refuses."""
    try:
        from cascade.serve.limits import RequestLimits
        from cascade.serve.teacher import TeacherConfig, create_teacher_app
        from cascade.serve.transport import DEFAULT_MAX_BODY
    except ImportError as exc:
        raise CascadeError(f"cascade serve needs the serve extra ({exc}): {SERVE_EXTRA}") from None
    from cascade.readout.placement import Placement, for_tier
    from cascade.readout.scorer import Scorer

    auth = _checked(options, False, forwardable=False)
    key = auth.key
    teacher = Path(teacher)
    if not teacher.is_file():
        raise CascadeError(f"teacher model {teacher} not found; give the path of a .gguf file")
    place = for_tier(placement, "teacher") or Placement()
    config = TeacherConfig(api_key=key, max_body=options.max_body or DEFAULT_MAX_BODY,
                           max_wait=_wait(options, alone=True), limits=options.limits or RequestLimits(),
                           receive_timeout=options.receive_timeout, docs=options.docs)
    return create_teacher_app(lambda: Scorer.placed(teacher, place, layout=layout), config, on_failure), auth


def _wait(options: ServeOptions, alone: bool = False) -> float:
    """The expected wait the top tier's queue admits: ``options.max_wait``, or the default of a
    cascade (or pass-through) or of a teacher served alone (``alone``), whose clients read for less."""
    from cascade.serve.engine_settings import DEFAULT_MAX_WAIT
    from cascade.teachers.admission import TEACHER_MAX_WAIT

    if options.max_wait is not None:
        return options.max_wait
    return TEACHER_MAX_WAIT if alone else DEFAULT_MAX_WAIT


@dataclass(frozen=True)
class Auth:
    """What a server checks: the API key, the metrics key (None: none of its own), and the one
    warning to log where the port is open on purpose (None: none)."""

    key: str | None
    metrics_key: str | None
    warning: str | None = None


def check_auth(options: ServeOptions, forward_auth: bool, forwardable: bool) -> Auth:
    """The API key (``options.api_key``, else ``$CASCADE_API_KEY``) and the metrics key
    (``options.metrics_key``, else ``$CASCADE_METRICS_KEY``) a server checks; ``forwardable``:
    whether it could forward auth (it has a URL teacher), for the refusal's advice.

    Refused with one line each (``CascadeError``): an API key with ``forward_auth`` (a caller
    sends one Authorization header: the upstream checks it, or this server does, not both), and a
    ``host`` other than loopback with no key checked, unless ``options.insecure_no_auth``, which
    gives the warning to log instead (the serve functions log it, once)."""
    from cascade.teachers.keys import is_loopback

    key = _sendable(options.api_key, "--api-key") or _sendable(os.environ.get(API_KEY_VARIABLE),
                                                                  f"${API_KEY_VARIABLE}")
    metrics_key = _sendable(options.metrics_key, "--metrics-key") or \
        _sendable(os.environ.get(METRICS_KEY_VARIABLE), f"${METRICS_KEY_VARIABLE}")
    if forward_auth and key is not None:
        given = "--api-key" if options.api_key else f"${API_KEY_VARIABLE} (set in this environment)"
        raise CascadeError(f"--forward-auth and {given} would both check the caller's one Authorization "
                           "header: either the upstream checks it (--forward-auth) or this server does "
                           "(--api-key); give one of them")
    if key is not None or forward_auth or is_loopback(options.host):
        return Auth(key, metrics_key)
    forward = ", or --forward-auth to have the upstream check each caller's key" if forwardable else ""
    if not options.insecure_no_auth:
        raise OpenPortError(f"--host {options.host} opens the port to other machines and no key would be "
                           f"checked: give --api-key KEY (or ${API_KEY_VARIABLE}){forward}; or "
                           "--insecure-no-auth to serve it open on purpose")
    return Auth(key, metrics_key, f"WARNING: --insecure-no-auth: serving on {options.host} with no key "
                "checked; anyone who reaches the port can ask it questions")


def _sendable(key: str | None, given: str) -> str | None:
    """``key`` (None where empty), refused in one line, never echoed, where no client could send it:
    a space or a newline in it (one read from a file with its newline, say) or a character outside
    printable ASCII (a header is not UTF-8), which would refuse every caller with a 401."""
    if not key:
        return None
    if not all(33 <= ord(character) <= 126 for character in key):
        raise CascadeError(f"the key given by {given} holds a space, a newline or a character outside "
                           "printable ASCII, which no client can send in an Authorization header: every "
                           "caller would be refused; give it without them (strip a key file's newline)")
    return key


def _checked(options: ServeOptions, forward_auth: bool, forwardable: bool) -> Auth:
    """``check_auth``, its warning logged."""
    auth = check_auth(options, forward_auth, forwardable)
    if auth.warning is not None:
        log.warning(auth.warning)
    return auth


def server_config(app: Any, options: ServeOptions) -> Any:
    """uvicorn's configuration of a server with these options: its address, at most
    ``max_connections`` at once, each request's head due within ``receive_timeout``, and no answer
    left unread for longer."""
    import uvicorn

    from cascade.serve.connections import connection_policy

    return uvicorn.Config(app, host=options.host, port=options.port, log_level="warning", access_log=False,
                          timeout_graceful_shutdown=options.grace,
                          http=connection_policy(options.receive_timeout, options.max_connections))


class _Run:
    """One uvicorn server: run until SIGTERM or Ctrl-C; a failure to load stops it and is raised."""

    def __init__(self, options: ServeOptions, what: str) -> None:
        self.options, self.what = options, what
        self.failures: list[BaseException] = []
        self.server: Any = None

    def failed(self, exc: BaseException) -> None:
        self.failures.append(exc)
        if self.server is not None:
            self.server.should_exit = True

    def serve(self, app: Any, banner: str, keyed: bool, hangup: Callable[[], None] | None = None) -> None:
        """Run ``app`` until a stop; ``keyed``: whether it checks a key of its own. One on loopback
        that does not answers this machine's programs only (with forwarded auth too: an upstream
        that takes callers with no key would answer a page as well)."""
        import uvicorn

        from cascade.serve.origin import LoopbackOnly
        from cascade.teachers.keys import is_loopback

        options = self.options
        if not keyed and is_loopback(options.host):
            app = LoopbackOnly(app)
        logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
        logging.getLogger("httpx").setLevel(logging.WARNING)  # else a line per upstream call
        self.server = uvicorn.Server(server_config(app, options))
        from cascade.private import redact_logs

        redact_logs("uvicorn", "uvicorn.error", "uvicorn.access")  # its configuration made their handlers
        log.info(banner)
        if threading.current_thread() is threading.main_thread():
            # uvicorn stops gracefully on SIGTERM and then raises the signal again under the handler
            # it found: this one, so that a requested stop returns instead of dying of the signal
            signal.signal(signal.SIGTERM, lambda *_: None)
            if hangup is not None:
                signal.signal(signal.SIGHUP, lambda *_: hangup())
        self.server.run()
        if self.failures:
            failure = self.failures[0]
            if isinstance(failure, CascadeError):
                raise failure
            raise CascadeError(f"loading {self.what} failed: {type(failure).__name__}: "
                               f"{failure}") from failure
