"""The ASGI application: System One routes over an ``Engine``, on FastAPI.

Routes: ``POST /v1/systemone`` (decide), ``GET /v1/models`` (the bundle), ``GET /health`` and
``/healthz`` (503 while the models load, then ``{"status": "ok"}``), ``GET /metrics``
(Prometheus). With an API key configured, the ``/v1`` routes need ``Authorization: Bearer KEY``;
without one no header is checked. Every answer and error carries ``X-Request-Id`` (the client's,
or a new one) and the same id as ``x-typesafe-request-id``, which typesafe-sdk reads.

A request may carry a budget: the body key ``x_budget`` (``{"ms_per_call": X,
"max_escalation_fraction": F}``) or the headers ``X-Cascade-Budget-Ms`` and
``X-Cascade-Max-Escalation``, a header winning over the body key for its bound.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
import threading
import time
from collections.abc import Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cascade.answers import DecisionResponse
from cascade.audit.auditor import Auditor
from cascade.collect.collector import Collector
from cascade.collect.escalation import EscalationRecord
from cascade.cost.upstream import UpstreamLedger
from cascade.errors import CascadeError, InputTooLongError, RequestError, ServiceError
from cascade.questions import DecisionRequest, load_json, parse_request
from cascade.routing.budget import Budget
from cascade.routing.router import Cascade
from cascade.serve.engine import Engine, EngineSettings, Retired
from cascade.serve.gone import unless_gone
from cascade.serve.matching import Matched, QuestionIndex
from cascade.serve.metrics import CONTENT_TYPE, ServerMetrics
from cascade.serve.swap import DEFAULT_INTERVAL, BundleWatch, Version, version_of
from cascade.serve.transport import DEFAULT_MAX_BODY, HttpProblem, error_body, problems, read_body, request_id

log = logging.getLogger("cascade.serve")
LOADING_RETRY_AFTER = "5"
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
    the app closes it when it stops)."""

    api_key: str | None = None
    max_body: int = DEFAULT_MAX_BODY
    engine: EngineSettings = field(default_factory=EngineSettings)
    audit: Callable[[Cascade], Auditor | None] | None = None
    bundle: BundleSource | None = None
    ledger: UpstreamLedger = field(default_factory=UpstreamLedger)
    escalations: Collector[EscalationRecord] | None = None


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


def loading_lifespan(load: Callable[[], None], close: Callable[[], None],
                     failed: Callable[[BaseException], None]) -> Callable[[FastAPI], Any]:
    """A lifespan that runs ``load`` in a thread, so that /health answers while models load,
    hands an exception it raises to ``failed``, and calls ``close`` at shutdown once it is done."""

    def load_in_thread() -> None:
        try:
            load()
        except BaseException as exc:
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


def create_app(load: Callable[[], Cascade] | None, config: ServeConfig | None = None,
               on_failure: Callable[[BaseException], None] | None = None) -> FastAPI:
    """An app that loads its cascade in a thread at startup (``load``, or the bundle
    ``config.bundle`` names) and serves it, taking each promoted bundle where ``config.bundle``
    is given. ``on_failure`` hears of an exception the first load raised (the command stops the
    server then)."""
    config = config or ServeConfig()
    loaded = _Loaded()

    def serving(cascade: Cascade, version: Version | None) -> Serving:
        try:
            auditor = config.audit(cascade) if config.audit is not None else None
            engine = Engine(cascade, config.engine, auditor, config.ledger, config.escalations)
        except BaseException:
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
        loaded.metrics.serving(cascade, version)
        if source is not None and version is not None:
            loaded.watch = BundleWatch(source.path, version, swap, source.interval)

    def swap(version: Version) -> None:
        assert config.bundle is not None and loaded.serving is not None and loaded.metrics is not None
        new = serving(config.bundle.load(version.directory), version)
        old, loaded.serving = loaded.serving, new
        loaded.metrics.serving(new.engine.cascade, version, old.engine.cascade)
        before = old.version.directory if old.version is not None else None
        log.info(json.dumps({"event": "bundle_swapped", "from": str(before), "to": str(version.directory),
                             "calibration_version": new.engine.cascade.calibration_version}))
        # the requests it took finish on it (none is refused), on a thread of its own, so that the
        # swap counts as taken now and the watch can take the next one meanwhile
        retiring = threading.Thread(target=old.engine.retire, name="cascade-retire", daemon=True)
        retiring.start()
        loaded.retiring.append(retiring)

    def close() -> None:
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

    lifespan = loading_lifespan(load_cascade, close, failed)
    app = FastAPI(title="cascade serve", version="1", lifespan=lifespan,
                  description="A tiered cascade behind the System One decision API.")
    app.state.loaded = loaded
    _routes(app, loaded, config)
    add_wire(app)
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    return app


def add_wire(app: FastAPI) -> None:
    """What every System One app of this package answers with: its error bodies (a refused
    request, a failed upstream or a full queue with its status and Retry-After, a bug) and the
    request id on every answer."""
    app.add_exception_handler(HttpProblem, _problem_handler)  # type: ignore[arg-type]
    app.add_exception_handler(ServiceError, _service_handler)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, _http_handler)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, _bug_handler)
    app.add_middleware(_RequestIds)


def _routes(app: FastAPI, loaded: _Loaded, config: ServeConfig) -> None:
    def ready() -> Serving:
        if loaded.serving is None:
            raise still_loading("the models are")
        return loaded.serving

    @app.get("/health", include_in_schema=False)
    @app.get("/healthz", include_in_schema=False)
    async def healthy() -> Response:
        return health(loaded.serving is not None, loaded.failure)

    @app.get("/metrics", include_in_schema=False)
    async def metrics() -> Response:
        engine = ready().engine
        assert loaded.metrics is not None
        loaded.metrics.scraped(engine, config.ledger.ledger(), loaded.watch, config.escalations)
        return Response(loaded.metrics.text(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        if not config.engine.forward_auth:
            authorize(request, config.api_key)
        return JSONResponse({"models": [_model_entry(ready().engine.cascade)]})

    @app.post("/v1/systemone", openapi_extra=_REQUEST_DOC)
    async def systemone(request: Request) -> Response:
        started = time.perf_counter()
        try:
            if not config.engine.forward_auth:
                authorize(request, config.api_key)
            ready()
            body = await request_body(request, config.max_body)
            response, matched, cascade = await _decide(loaded, body, request)
        except (HttpProblem, ServiceError) as problem:
            if loaded.metrics is not None:
                loaded.metrics.requests.labels(str(problem.status)).inc()
            _log(request, problem.status, started, getattr(problem, "code", type(problem).__name__))
            raise
        metrics = loaded.metrics
        assert metrics is not None
        metrics.answered(response, matched.bundle, cascade)
        metrics.requests.labels("200").inc()
        metrics.request_seconds.observe(time.perf_counter() - started)
        _log(request, 200, started, None, response)
        return Response(response.model_dump_json(), media_type="application/json")


async def _decide(loaded: _Loaded, body: bytes, request: Request
                  ) -> tuple[DecisionResponse, Matched, Cascade]:
    """Parse, match and route one request body on the serving engine; every bad input is an
    ``HttpProblem`` (422). A swap between reading the engine and submitting to it only means
    submitting to the new one: no request is refused for it."""
    try:
        data = load_json(body)
        budget = _budget(data, request.headers)
        parsed = parse_request(data)
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
                                           request.state.request_id, request.headers.get("authorization"))
            break
        except Retired:
            continue
    else:
        raise HttpProblem(503, "swapping", "the server was swapping bundles; retry", {"Retry-After": "1"},
                          kind="unavailable_error")
    try:
        return await unless_gone(future, request), matched, cascade
    except (RequestError, InputTooLongError) as exc:
        raise unprocessable(exc) from None


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


def unprocessable(exc: CascadeError) -> HttpProblem:
    return HttpProblem(422, "invalid_request", str(exc), found=problems(str(exc)))


def _not_in_bundle(cascade: Cascade, matched: Matched) -> HttpProblem:
    qid = next(iter(matched.foreign))
    message = (f"questions.{qid}: not one of the bundle's questions (matched by type, instructions "
               f"and options), and this server's top tier {cascade.tiers[-1].name!r} replays recorded "
               f"labels, so nothing can answer it; ask the bundle's questions {list(cascade.questions)} "
               "as the bundle words them, or serve with --teacher PATH.gguf")
    return HttpProblem(422, "unknown_question", message, found=problems(message))


async def request_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    encoding = request.headers.get("content-encoding")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise HttpProblem(413, "request_too_large", f"request body of {declared} bytes is over the "
                          f"server's limit of {limit} bytes; send fewer or shorter states per request")
    return await read_body(request.stream(), encoding, limit)


def authorize(request: Request, key: str | None) -> None:
    if key is None:
        return
    given = request.headers.get("authorization", "")
    scheme, _, token = given.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
        raise HttpProblem(401, "unauthorized", "missing or wrong API key; send Authorization: Bearer KEY",
                          {"WWW-Authenticate": "Bearer"}, kind="authentication_error")


def _model_entry(cascade: Cascade) -> dict[str, str]:
    manifest = cascade.manifest
    tiers = " -> ".join(tier.name for tier in cascade.tiers)
    target = manifest.calibration.target
    promise = f", agreement with the teacher certified at {target}" if target else ", not calibrated"
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


async def _problem_handler(request: Request, problem: HttpProblem) -> Response:
    return JSONResponse(error_body(problem), problem.status, problem.headers)


async def _service_handler(request: Request, exc: ServiceError) -> Response:
    """An upstream's own 4xx passed back unchanged (status, body, type); any other failure a
    client can act on as an error body with its status and Retry-After."""
    if exc.body is not None:
        return Response(exc.body, exc.status, exc.headers, media_type=exc.content_type)
    code = re.sub(r"(?<!^)(?=[A-Z])", "_", type(exc).__name__).lower().removesuffix("_error")
    kind = "rate_limit_error" if exc.status == 429 else "server_error"
    problem = HttpProblem(exc.status, code, str(exc), exc.headers, kind=kind)
    return JSONResponse(error_body(problem), exc.status, exc.headers)


async def _http_handler(request: Request, exc: StarletteHTTPException) -> Response:
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, f"http_{exc.status_code}")
    problem = HttpProblem(exc.status_code, code, str(exc.detail))
    return JSONResponse(error_body(problem), exc.status_code, dict(exc.headers or {}))


async def _bug_handler(request: Request, exc: Exception) -> Response:
    log.exception("request %s failed", getattr(request.state, "request_id", "?"))
    problem = HttpProblem(500, "internal_error", f"the server failed ({type(exc).__name__}: {exc}); "
                          "this is a bug in cascade serve", kind="server_error")
    return JSONResponse(error_body(problem), 500)


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


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema, with the request body's schema (parsed by hand, so that every problem
    gets this server's error shape) and the error answers written in."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, description=app.description,
                             routes=app.routes)
        request = DecisionRequest.model_json_schema(ref_template="#/components/schemas/{model}")
        response = DecisionResponse.model_json_schema(ref_template="#/components/schemas/{model}",
                                                      mode="serialization")
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for part in (request, response):
            components.update(part.pop("$defs", {}))
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
        "413": {"description": "Body over the size limit", **_ERROR},
        "415": {"description": "Unsupported Content-Encoding", **_ERROR},
        "422": {"description": "A bad request: error and detail say where", **_ERROR},
        "429": {"description": "An upstream teacher rate-limits this key (Retry-After)", **_ERROR},
        "502": {"description": "An upstream teacher is unreachable or answered wrongly", **_ERROR},
        "503": {"description": "Loading, or the teacher's queue is full (Retry-After)", **_ERROR},
        "504": {"description": "An upstream teacher did not answer in time", **_ERROR},
    },
}
