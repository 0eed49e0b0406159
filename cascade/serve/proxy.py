"""A transparent pass-through in front of an upstream System One URL: ``cascade serve --teacher
URL`` with no bundle, where a user with only a URL and a key starts from zero data.

Every request is validated and bounded first, as the cascade reads one
(``cascade.serve.limits.read_request``): one that is not a System One request, or one past a
limit, is refused with 422 or 413 in the cascade's error shape and never sent. A valid one is
forwarded as the client sent it (its body, inflated, then compressed as the upstream client
compresses every body it sends: ``UpstreamSettings.compress``; its request id; the settings'
``model`` added where it names none),
and the upstream's answer comes back unchanged: status, body, and the upstream's own request-id
and rate-limit headers. Auth is this server's key (``api_key``; ``/metrics`` takes
``metrics_key`` where given), or with forwarded auth the upstream's check of each caller's key
(a key it refused lately is refused at once, with its refusal: ``cascade.serve.app.check_caller``);
``/docs``, ``/redoc`` and ``/openapi.json`` are served only where asked for. What the proxy adds
is what a client can act on when the upstream fails
(502 unreachable, 504 timeout, 429 and 503 with their ``Retry-After``, another 4xx passed back
unchanged: ``cascade.teachers.client``), one admission rule for its queue (a request is admitted
only while its expected wait fits ``max_wait``; past it 503 with ``Retry-After`` at once:
``cascade.teachers.admission``), dropping requests whose client has gone before they are sent,
and, with a ``Collector``, a record of each request's state, questions and the upstream's answers
and identity, to train a cascade from (``cascade.collect``).
"""

from __future__ import annotations

import asyncio
import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from cascade.backoff import down_for
from cascade.collect.collector import Collector
from cascade.collect.record import CollectedItem, collected_item
from cascade.cost.upstream import UpstreamLedger
from cascade.errors import CascadeError, RequestError
from cascade.questions import load_json, parse_request
from cascade.readout.prompts import read_chars
from cascade.serve.auth import BOTH_KEYS, KeyChecks, app_options, check_caller, check_metrics
from cascade.serve.edge import DEFAULT_RECEIVE_TIMEOUT, add_wire, lifespan_of, request_body, unprocessable
from cascade.serve.engine_settings import DEFAULT_MAX_WAIT
from cascade.serve.gone import unless_gone
from cascade.serve.limits import RequestLimits, read_request
from cascade.serve.metrics import CONTENT_TYPE, Total
from cascade.serve.transport import DEFAULT_MAX_BODY, HttpProblem
from cascade.teachers.admission import Admission, RateAdmission, work_of
from cascade.teachers.client import UpstreamClient, UpstreamReply, passed_headers
from cascade.teachers.wire import distributions, read_response

_PASSED = ("content-type", "retry-after")
"""Headers of the upstream's answer passed back besides every ``x-`` and ``ratelimit`` one."""


@dataclass(frozen=True)
class ProxyConfig:
    """``api_key``: the key clients must send (None: none; with the client's ``forward_auth``,
    the upstream checks each caller's own instead); ``max_body`` in bytes after inflating;
    ``max_wait``: the expected wait past which a request is refused; ``collector``: where
    forwarded traffic is collected (None: nowhere); ``ledger``: what the upstream cost;
    ``metrics_key``: the key ``/metrics`` needs (None: as the other routes); ``docs``: serve
    ``/docs``, ``/redoc`` and ``/openapi.json`` (off by default); ``limits``: the work one request
    may carry (``cascade.serve.limits``); ``receive_timeout``: seconds a body may take."""

    api_key: str | None = None
    max_body: int = DEFAULT_MAX_BODY
    max_wait: float = DEFAULT_MAX_WAIT
    collector: Collector[CollectedItem] | None = None
    ledger: UpstreamLedger | None = None
    metrics_key: str | None = None
    docs: bool = False
    limits: RequestLimits = field(default_factory=RequestLimits)
    receive_timeout: float = DEFAULT_RECEIVE_TIMEOUT


class _ProxyMetrics:
    """The pass-through's Prometheus metrics (a registry of its own)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("cascade_requests", "Requests answered, by HTTP status code", ["code"],
                                registry=self.registry)
        self.seconds = Histogram("cascade_request_seconds", "Seconds from a request's body read to its "
                                 "answer", registry=self.registry)
        self.waiting = Gauge("cascade_queue_depth", "Requests admitted and not yet answered", ["tier"],
                             registry=self.registry)
        self.upstream = Total("cascade_upstream", "Since the server started: requests answered, questions "
                              "in them, calls and questions sent upstream", ["count"], registry=self.registry)
        self.collect = Total("cascade_collect", "Forwarded requests by what collection made of them: "
                             "collected, not_chosen (outside --collect-share), full (--collect-max reached), "
                             "dropped (the writer's queue was full: too many requests, or too many bytes, "
                             "waiting for the store; or the store was still down when the server "
                             "stopped), unreadable, failed (the store refused it)", ["outcome"],
                             registry=self.registry)
        self.store_down = Gauge("cascade_store_unavailable_seconds", "Seconds the store has not answered "
                                "the collector, whose writes wait to be retried; 0 while it answers",
                                registry=self.registry)


def create_proxy_app(client: UpstreamClient, config: ProxyConfig | None = None) -> FastAPI:
    """A System One app forwarding every request to ``client``'s upstream (see the module)."""
    config = config or ProxyConfig()
    settings = client.settings
    if settings.forward_auth and config.api_key is not None:
        raise CascadeError(BOTH_KEYS)
    forwarding = client if settings.forward_auth else None
    admission = RateAdmission(config.max_wait, what=f"the upstream {settings.shown}")
    pool = ThreadPoolExecutor(settings.max_in_flight, "cascade-proxy")
    checks = KeyChecks()
    metrics, ledger = _ProxyMetrics(), config.ledger or UpstreamLedger()

    def close() -> None:
        checks.close()
        pool.shutdown(wait=True)
        if config.collector is not None:
            config.collector.close()
        client.close()

    app = FastAPI(title="cascade serve (pass-through)", version="1", lifespan=lifespan_of(close),
                  description=f"A pass-through to the System One server at {settings.shown}.",
                  **app_options(config.docs))

    @app.api_route("/health", methods=["GET", "HEAD"], include_in_schema=False)
    @app.api_route("/healthz", methods=["GET", "HEAD"], include_in_schema=False)
    async def health() -> Response:
        return JSONResponse({"status": "ok", "waiting": admission.inside})

    @app.get("/metrics", include_in_schema=False)
    async def scrape(request: Request) -> Response:
        await check_metrics(request, config.metrics_key, config.api_key, forwarding, checks)
        _scraped(metrics, ledger, admission, config.collector)
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        authorization = await _caller(request, config, forwarding)
        known = forwarding is None or forwarding.accepted.accepted(authorization)
        if known:
            status, content, kind = await _in_pool(pool, client.get, client.models_url, authorization)
        else:  # a key the upstream has not answered lately: a check, never a forwarding thread
            status, content, kind = await checks.run(client.get, client.models_url, authorization)
        return Response(content, status, media_type=kind)

    @app.post("/v1/systemone")
    async def systemone(request: Request) -> Response:
        started = time.perf_counter()
        try:
            authorization = await _caller(request, config, forwarding)
            body = await request_body(request, config.max_body, config.receive_timeout)
            model = client.settings.model
            asked, work, body = await asyncio.to_thread(_validated, body, config.limits, model)
            reply = await _forwarded(request, body, work, authorization, client, admission, pool)
        except HttpProblem as problem:
            metrics.requests.labels(str(problem.status)).inc()
            raise
        except Exception as exc:  # an upstream's failure: its status is the ServiceError's
            metrics.requests.labels(str(getattr(exc, "status", 500))).inc()
            raise
        ledger.request(asked, asked, reply.seconds)
        metrics.requests.labels(str(reply.status)).inc()
        metrics.seconds.observe(time.perf_counter() - started)
        if config.collector is not None:
            rid = request.state.request_id
            config.collector.offer(lambda kept: _item(rid, body, reply, settings.shown, kept),
                                   size=len(body) + len(reply.content))
        return Response(reply.content, reply.status, passed_headers(reply.headers, _PASSED))

    add_wire(app)
    return app


async def _caller(request: Request, config: ProxyConfig, forwarding: UpstreamClient | None) -> str | None:
    """The Authorization to send on: the caller's own with forwarded auth (the upstream checks
    it; one it refused lately is refused here at once), else this server's key is checked here
    and the client sends the upstream's."""
    await check_caller(request, config.api_key, forwarding)
    return request.headers.get("authorization") if forwarding is not None else None


def _validated(body: bytes, limits: RequestLimits, model: str | None) -> tuple[int, float, bytes]:
    """The number of questions and the work (units) of a body that reads as a System One request
    within the limits, as the cascade reads one, and the body to forward: as sent, or with
    ``model`` (``--upstream-model``) where it names none (a client whose SDK names no model, as
    avrik-sdk's, got the 422 of an upstream that requires one). Else the 422 or 413 the cascade
    answers (nothing invalid is sent upstream). CPU work: on a thread."""
    try:
        request = read_request(body, limits)
    except RequestError as exc:
        raise unprocessable(exc) from None
    if model is not None and request.model is None:
        body = json.dumps({**json.loads(body), "model": model}, ensure_ascii=False).encode()
    return len(request.questions), work_of(read_chars(request.state, request.questions.values())), body


async def _forwarded(request: Request, body: bytes, work: float, authorization: str | None,
                     client: UpstreamClient, admission: Admission, pool: ThreadPoolExecutor) -> UpstreamReply:
    """The upstream's reply, once admitted by its ``work`` (``QueueFullError`` when not); a
    request whose client goes before its call starts is never sent."""
    ticket = admission.enter(work)
    rid = request.state.request_id

    def call() -> UpstreamReply:
        late = admission.late(ticket)
        if late is not None:  # waited past max_wait for a slot: refused now rather than answered too late
            admission.done(ticket, None)
            raise late
        start = admission.started(ticket)
        try:
            return client.send(body, authorization, headers={"X-Request-Id": rid})
        finally:
            admission.done(ticket, start)

    job = pool.submit(call)
    job.add_done_callback(lambda done: admission.done(ticket, None) if done.cancelled() else None)
    return await unless_gone(job, request)


async def _in_pool(pool: ThreadPoolExecutor, fn: Any, *args: Any) -> Any:
    return await asyncio.wrap_future(pool.submit(fn, *args))


def _item(request_id: str, body: bytes, reply: UpstreamReply, url: str, inclusion: float) -> CollectedItem:
    """The collected record of one forwarded request (on the collector's thread), kept with
    probability ``inclusion``: a body that is not a System One request, or an answer of the wrong
    shape, raises and is not collected."""
    parsed = parse_request(load_json(body))
    response = read_response(reply.data, url)
    found = distributions(response, parsed.questions, url)
    return collected_item(request_id, parsed.questions, parsed.state, found, response.identity(), time.time(),
                          inclusion)


def _scraped(metrics: _ProxyMetrics, ledger: UpstreamLedger, admission: Admission,
             collector: Collector[CollectedItem] | None) -> None:
    metrics.waiting.labels("upstream").set(admission.inside)
    book = ledger.ledger()
    for name, value in (("requests", book.requests), ("asked_questions", book.asked),
                        ("calls", book.calls), ("sent_questions", book.sent)):
        metrics.upstream.set(value, name)
    if collector is not None:
        for outcome, n in collector.counts.items():
            metrics.collect.set(n, outcome)
        metrics.store_down.set(down_for(collector.backoff))
