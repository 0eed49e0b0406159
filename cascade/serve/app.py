"""The ASGI application: System One routes over an ``Engine``, on FastAPI.

Routes: ``POST /v1/systemone`` (decide), ``GET /v1/models`` (the bundle), ``GET /health`` and
``/healthz`` (503 while the models load, then ``{"status": "ok"}``), ``GET /metrics``
(Prometheus); ``/docs``, ``/redoc`` and ``/openapi.json`` only where asked for (``docs``).

Auth (``check_caller``): with an API key configured, ``/v1/models``, ``/v1/systemone`` and
``/metrics`` need ``Authorization: Bearer KEY`` (``/metrics`` the metrics key instead, where one is
given); without one no header is checked. With forwarded auth, the upstream checks each caller's
own key instead, on every one of those routes: a key it refused lately is refused at once with its
refusal, and a route that sends nothing upstream (``/v1/models``, ``/metrics``) asks it about a
key it has not accepted lately (``UpstreamClient.vouch``). The two ways cannot be combined: a
caller sends one Authorization header, checked here or by the upstream. ``/health`` is open.
Every answer and error carries ``X-Request-Id`` (the client's, or a new one) and the same id as
``x-typesafe-request-id``, which typesafe-sdk reads.

A request may carry a budget: the body key ``x_budget`` (``{"ms_per_call": X,
"max_escalation_fraction": F}``) or the headers ``X-Cascade-Budget-Ms`` and
``X-Cascade-Max-Escalation``, a header winning over the body key for its bound.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response

from cascade.answers import DecisionResponse
from cascade.audit.auditor import Auditor
from cascade.collect.collector import Collector
from cascade.collect.escalation import EscalationRecord
from cascade.cost.upstream import UpstreamLedger
from cascade.errors import CascadeError, InputTooLongError, RequestError, ServiceError
from cascade.questions import DecisionRequest, load_json
from cascade.routing.budget import Budget
from cascade.routing.router import Cascade
from cascade.serve import memory
from cascade.serve.auth import BOTH_KEYS, KeyChecks, app_options, check_caller, check_metrics
from cascade.serve.edge import (
    DEFAULT_RECEIVE_TIMEOUT,
    add_wire,
    health,
    lifespan_of,
    request_body,
    still_loading,
    unprocessable,
)
from cascade.serve.engine import Engine, Retired
from cascade.serve.engine_settings import EngineSettings
from cascade.serve.gone import unless_gone
from cascade.serve.limits import RequestLimits, bounded_request
from cascade.serve.matching import Matched, QuestionIndex
from cascade.serve.metrics import CONTENT_TYPE, ServerMetrics
from cascade.serve.swap import DEFAULT_INTERVAL, BundleWatch, Version, version_of
from cascade.serve.transport import DEFAULT_MAX_BODY, HttpProblem, problems
from cascade.tiers.upstream import UpstreamTier

if TYPE_CHECKING:
    from cascade.teachers.client import UpstreamClient

log = logging.getLogger("cascade.serve")
_SUBMIT_TRIES = 3


@dataclass(frozen=True)
class BundleSource:
    """Where a server's bundle comes from when it follows promotions (``cascade.serve.swap``):
    ``path`` (a bundle folder, a link to one, or a pointer file), ``load`` (a bundle folder to its
    cascade) and ``interval`` (seconds between two looks at ``path``; 0: on SIGHUP only)."""

    path: Path
    load: Callable[[Path], Cascade]
    interval: float = DEFAULT_INTERVAL


@dataclass(frozen=True)
class ServeConfig:
    """How the server answers: ``api_key`` (None: no auth; with ``engine.forward_auth`` the
    upstream checks callers' keys instead), ``max_body`` in bytes (after inflating), the engine's
    batching, admission and overload settings, ``audit``, which makes the auditor of a loaded
    cascade (None, or returning None: no audit), ``bundle``: follow promotions of the bundle
    (None: serve the one ``load`` gives), ``ledger``: what the upstream costs, and
    ``escalations``: where the teacher's answers to escalated questions are kept (None: nowhere;
    the app closes it when it stops), ``limits``: the work one request may carry
    (``cascade.serve.limits``), and ``receive_timeout``: seconds a body may take to arrive.
    ``metrics_key``: the key ``/metrics`` needs (None: the API key, or a forwarded one);
    ``docs``: serve ``/docs``, ``/redoc`` and ``/openapi.json`` (off by default)."""

    api_key: str | None = None
    max_body: int = DEFAULT_MAX_BODY
    engine: EngineSettings = field(default_factory=EngineSettings)
    audit: Callable[[Cascade], Auditor | None] | None = None
    bundle: BundleSource | None = None
    ledger: UpstreamLedger = field(default_factory=UpstreamLedger)
    escalations: Collector[EscalationRecord] | None = None
    limits: RequestLimits = field(default_factory=RequestLimits)
    receive_timeout: float = DEFAULT_RECEIVE_TIMEOUT
    metrics_key: str | None = None
    docs: bool = False


@dataclass(frozen=True)
class Serving:
    """The engine answering new requests, the question index of its bundle, and its version."""

    engine: Engine
    index: QuestionIndex
    version: Version | None


class _Loaded:
    """The serving cascade once loaded (in a thread, so that /health answers while models load),
    swapped for each promoted bundle; the metrics and ledger outlive the swaps."""

    def __init__(self) -> None:
        self.serving: Serving | None = None
        self.metrics: ServerMetrics | None = None
        self.failure: BaseException | None = None
        self.watch: BundleWatch | None = None
        self.retiring: list[threading.Thread] = []  # engines a swap replaced, finishing their requests


def create_app(load: Callable[[], Cascade] | None, config: ServeConfig | None = None,
               on_failure: Callable[[BaseException], None] | None = None) -> FastAPI:
    """An app that loads its cascade in a thread at startup (``load``, or the bundle
    ``config.bundle`` names) and serves it, taking each promoted bundle where ``config.bundle``
    is given. ``on_failure`` hears of an exception the first load raised (the command stops the
    server then)."""
    config = config or ServeConfig()
    if config.engine.forward_auth and config.api_key is not None:
        raise CascadeError(BOTH_KEYS)
    loaded = _Loaded()

    def serving(cascade: Cascade, version: Version | None) -> Serving:
        auditor = None
        try:
            if config.engine.forward_auth and not isinstance(cascade.tiers[-1], UpstreamTier):
                raise CascadeError("forwarded auth sends callers' keys to an upstream teacher, and this "
                                   f"cascade's top tier {cascade.tiers[-1].name!r} is none: give a URL "
                                   "teacher")
            auditor = config.audit(cascade) if config.audit is not None else None
            engine = Engine(cascade, config.engine, auditor, config.ledger, config.escalations)
        except BaseException:
            if auditor is not None:  # its watch's thread and its store, which no engine will close
                auditor.close()
            cascade.close()
            raise
        return Serving(engine, QuestionIndex(cascade.questions), version)

    def load_cascade() -> None:
        source = config.bundle
        version = version_of(source.path) if source is not None else None
        if source is not None and version is not None:
            cascade = source.load(version.directory)
        elif load is not None:
            cascade = load()
        else:
            raise CascadeError("create_app needs load or config.bundle: give the cascade to serve")
        loaded.metrics = ServerMetrics(cascade.tiers[-1].name)
        loaded.serving = serving(cascade, version)
        loaded.metrics.serving(loaded.serving.engine, version)
        if source is not None and version is not None:
            loaded.watch = BundleWatch(source.path, version, swap, source.interval)

    def swap(version: Version) -> None:
        assert config.bundle is not None and loaded.serving is not None and loaded.metrics is not None
        new = serving(config.bundle.load(version.directory), version)
        old, loaded.serving = loaded.serving, new
        loaded.metrics.serving(new.engine, version, old.engine.cascade)
        before = old.version.directory if old.version is not None else None
        log.info(json.dumps({"event": "bundle_swapped", "from": str(before), "to": str(version.directory),
                             "calibration_version": new.engine.cascade.calibration_version}))
        # the requests it took finish on it (none is refused), on a thread of its own, so that the
        # swap counts as taken now and the watch can take the next one meanwhile; this frame lets it
        # go first: the retiring thread's collection would otherwise find it still held here (a
        # thread slow to return from swap) and leave it to live on in its cycles
        retiring = threading.Thread(target=memory.retire, args=([old.engine],), name="cascade-retire",
                                    daemon=True)
        del old
        retiring.start()
        loaded.retiring = [*(t for t in loaded.retiring if t.is_alive()), retiring]

    checks = KeyChecks()

    def close() -> None:
        checks.close()
        if loaded.watch is not None:
            loaded.watch.close()
        for retiring in loaded.retiring:
            retiring.join()
        if loaded.serving is not None:
            loaded.serving.engine.retire()
        if config.escalations is not None:
            config.escalations.close()

    def failed(exc: BaseException) -> None:  # reported to the command, which exits with it
        loaded.failure = exc
        if on_failure is not None:
            on_failure(exc)

    lifespan = lifespan_of(close, load_cascade, failed)
    app = FastAPI(title="cascade serve", version="1", lifespan=lifespan,
                  description="A tiered cascade behind the System One decision API.",
                  **app_options(config.docs))
    app.state.loaded = loaded
    _routes(app, loaded, config, checks)
    add_wire(app)
    app.openapi = lambda: _openapi(app, config.limits)  # type: ignore[method-assign]
    return app


def _routes(app: FastAPI, loaded: _Loaded, config: ServeConfig, checks: KeyChecks) -> None:
    def ready() -> Serving:
        if loaded.serving is None:
            raise still_loading("the models are")
        return loaded.serving

    @app.api_route("/health", methods=["GET", "HEAD"], include_in_schema=False)
    @app.api_route("/healthz", methods=["GET", "HEAD"], include_in_schema=False)
    async def healthy() -> Response:
        return health(loaded.serving is not None, loaded.failure)

    def forwarding() -> UpstreamClient | None:
        """The upstream's client where it checks callers' keys (forwarded auth, once loaded)."""
        engine = loaded.serving.engine if loaded.serving is not None and config.engine.forward_auth else None
        return engine.upstream.client if engine is not None and engine.upstream is not None else None

    @app.get("/metrics", include_in_schema=False)
    async def metrics(request: Request) -> Response:
        await check_metrics(request, config.metrics_key, config.api_key, forwarding(), checks)
        engine = ready().engine
        assert loaded.metrics is not None
        loaded.metrics.scraped(engine, config.ledger.ledger(), loaded.watch, config.escalations)
        return Response(loaded.metrics.text(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        await check_caller(request, config.api_key, forwarding(), checks)
        return JSONResponse({"models": [_model_entry(ready().engine.cascade)]})

    @app.post("/v1/systemone", openapi_extra=_REQUEST_DOC)
    async def systemone(request: Request) -> Response:
        started = time.perf_counter()
        try:
            await check_caller(request, config.api_key, forwarding())
            ready()
            body = await request_body(request, config.max_body, config.receive_timeout)
            response, matched, cascade = await _decide(loaded, body, request, config.limits)
        except (HttpProblem, ServiceError) as problem:
            if loaded.metrics is not None:
                loaded.metrics.requests.labels(str(problem.status)).inc()
            _log(request, problem.status, started, getattr(problem, "code", type(problem).__name__))
            raise
        except Exception:  # a bug: answered 500 by the wire's handler, counted and logged here too
            if loaded.metrics is not None:
                loaded.metrics.requests.labels("500").inc()
            _log(request, 500, started, "internal_error")
            raise
        metrics = loaded.metrics
        assert metrics is not None
        metrics.answered(response, matched.bundle, cascade)
        metrics.requests.labels("200").inc()
        metrics.request_seconds.observe(time.perf_counter() - started)
        _log(request, 200, started, None, response)
        return Response(response.model_dump_json(), media_type="application/json")


async def _decide(loaded: _Loaded, body: bytes, request: Request, limits: RequestLimits
                  ) -> tuple[DecisionResponse, Matched, Cascade]:
    """Parse, bound, match and route one request body on the serving engine, the CPU work of it
    (parsing, rendering the state, counting tokens for a budget) on a thread, never on the event
    loop; every bad input is an ``HttpProblem`` (413 or 422)."""
    headers, rid = request.headers, request.state.request_id
    future, matched, cascade = await asyncio.to_thread(_submit, loaded, body, headers, rid, limits)
    try:
        return await unless_gone(future, request), matched, cascade
    except (RequestError, InputTooLongError) as exc:
        raise unprocessable(exc) from None


def _submit(loaded: _Loaded, body: bytes, headers: Mapping[str, str], request_id: str,
            limits: RequestLimits) -> tuple[Future[DecisionResponse], Matched, Cascade]:
    """Start routing one request (on a worker thread). A swap between reading the engine and
    submitting to it only means submitting to the new one: no request is refused for it."""
    try:
        data = load_json(body)
        budget = _budget(data, headers)
        parsed = bounded_request(data, limits)
    except RequestError as exc:
        raise unprocessable(exc) from None
    for _ in range(_SUBMIT_TRIES):
        serving = loaded.serving
        assert serving is not None
        cascade = serving.engine.cascade
        matched = serving.index.match(parsed.questions)
        if matched.foreign and not cascade.tiers[-1].reads_any_question:
            raise _not_in_bundle(cascade, matched)
        try:
            future = serving.engine.submit(parsed.state, list(parsed.questions), matched, budget,
                                           request_id, headers.get("authorization"))
            return future, matched, cascade
        except Retired:
            continue
    raise HttpProblem(503, "swapping", "the server was swapping bundles; retry", {"Retry-After": "1"},
                      kind="unavailable_error")


def _budget(data: Any, headers: Mapping[str, str]) -> Budget:
    given = data.get("x_budget") if isinstance(data, dict) else None
    if given is not None and not isinstance(given, dict):
        raise RequestError(f"x_budget: must be an object with 'ms_per_call' and/or "
                           f"'max_escalation_fraction'; got {type(given).__name__}")
    bounds = dict(given or {})
    for header, key in (("x-cascade-budget-ms", "ms_per_call"),
                        ("x-cascade-max-escalation", "max_escalation_fraction")):
        if header in headers:
            try:
                bounds[key] = float(headers[header])
            except ValueError:
                raise RequestError(f"header {header}: must be a number; got {headers[header]!r}") from None
    return Budget(**bounds)


def _not_in_bundle(cascade: Cascade, matched: Matched) -> HttpProblem:
    qid = next(iter(matched.foreign))
    message = (f"questions.{qid}: not one of the bundle's questions (matched by type, instructions "
               f"and options), and this server's top tier {cascade.tiers[-1].name!r} replays recorded "
               f"labels, so nothing can answer it; ask the bundle's questions {list(cascade.questions)} "
               "as the bundle words them, or serve with --teacher PATH.gguf")
    return HttpProblem(422, "unknown_question", message, found=problems(message))


def _model_entry(cascade: Cascade) -> dict[str, str]:
    manifest = cascade.manifest
    tiers = " -> ".join(tier.name for tier in cascade.tiers)
    calibration = manifest.calibration
    if calibration.mode == "budget":
        promise = (f", budget mode: each cheap tier escalates {calibration.escalation_fraction} of the "
                   "items that reach it, no agreement certified")
    elif calibration.target:
        promise = f", agreement with the teacher certified at {calibration.target}"
    else:
        promise = ", not calibrated"
    return {"name": manifest.name, "description": f"cascade {tiers} over {len(cascade.questions)} "
            f"question(s){promise}", "release_date": manifest.created_at.date().isoformat()}


def _log(request: Request, status: int, started: float, code: str | None,
         response: DecisionResponse | None = None) -> None:
    line: dict[str, Any] = {"request_id": request.state.request_id, "status": status,
                            "ms": round(1e3 * (time.perf_counter() - started), 2)}
    if code:
        line["error"] = code
    if response is not None:
        line["tiers"] = {qid: a.routing.tier for qid, a in response.answers.items() if a.routing}
    log.info(json.dumps(line))


def _openapi(app: FastAPI, limits: RequestLimits) -> dict[str, Any]:
    """FastAPI's schema, with the request body's schema (parsed by hand, so that every problem
    gets this server's error shape), the request limits and the error answers written in."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, description=app.description,
                             routes=app.routes)
        request = DecisionRequest.model_json_schema(ref_template="#/components/schemas/{model}")
        response = DecisionResponse.model_json_schema(ref_template="#/components/schemas/{model}",
                                                      mode="serialization")
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for part in (request, response):
            components.update(part.pop("$defs", {}))
        limits.annotate(request, components)
        components["DecisionRequest"], components["DecisionResponse"] = request, response
        app.openapi_schema = schema
    return app.openapi_schema


_ERROR = {"content": {"application/json": {"schema": {"type": "object"}}}}
_REQUEST_DOC: dict[str, Any] = {
    "requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": "#/components/schemas/DecisionRequest"}}}},
    "responses": {
        "200": {"description": "The answers", "content": {"application/json": {
            "schema": {"$ref": "#/components/schemas/DecisionResponse"}}}},
        "401": {"description": "Missing or wrong API key", **_ERROR},
        "408": {"description": "The body did not arrive within the receive timeout", **_ERROR},
        "413": {"description": "Body over the size limit, or a request past a work limit (x-limits)",
                **_ERROR},
        "415": {"description": "Unsupported Content-Encoding", **_ERROR},
        "422": {"description": "A bad request: error and detail say where", **_ERROR},
        "429": {"description": "An upstream teacher rate-limits this key (Retry-After)", **_ERROR},
        "502": {"description": "An upstream teacher is unreachable or answered wrongly", **_ERROR},
        "503": {"description": "Loading, or the teacher's queue is full (Retry-After)", **_ERROR},
        "504": {"description": "An upstream teacher did not answer in time", **_ERROR},
    },
}
