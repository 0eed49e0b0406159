"""The teacher's own System One server: ``cascade serve --teacher X.gguf`` with no bundle.

It serves the raw logit readout of one GGUF (``cascade.readout.scorer``) at ``POST
/v1/systemone``, so that a GPU box and the CPU cascade in front of it run the same program, and
the cascade can take that box's URL as its teacher: every answer's audit carries the GGUF's
sha256 as ``model_hash`` and each question's ``prompt_template_sha256``, which is what a bundle
certified against that GGUF checks (``cascade.teachers.identity``).

One worker thread owns the llama.cpp context (a context is never used by two threads) and reads
one request at a time. Its queue admits a request only while the expected wait, the measured
service time times the requests ahead, fits ``max_wait`` (``cascade.teachers.admission``);
past that it answers 503 with ``Retry-After`` at once, instead of computing answers that the
client, which gave up after its 10 s, will never read.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from cascade.answers import DecisionResponse
from cascade.errors import InputTooLongError, RequestError
from cascade.questions import DecisionRequest
from cascade.readout.prompts import read_chars
from cascade.readout.scorer import Scorer
from cascade.serve.auth import app_options, authorize
from cascade.serve.edge import (
    DEFAULT_RECEIVE_TIMEOUT,
    add_wire,
    health,
    lifespan_of,
    request_body,
    still_loading,
    unprocessable,
)
from cascade.serve.gone import unless_gone
from cascade.serve.limits import RequestLimits, read_request
from cascade.serve.transport import DEFAULT_MAX_BODY
from cascade.teachers.admission import TEACHER_MAX_WAIT, Admission, work_of


@dataclass(frozen=True)
class TeacherConfig:
    """``api_key`` (None: no auth), ``max_body`` in bytes (after inflating), ``max_wait``: the
    expected wait past which a request is refused with 503 and Retry-After, ``limits``: the work
    one request may carry (``cascade.serve.limits``), ``receive_timeout``: seconds a body may take,
    ``docs``: serve ``/docs``, ``/redoc`` and ``/openapi.json`` (off by default)."""

    api_key: str | None = None
    max_body: int = DEFAULT_MAX_BODY
    max_wait: float = TEACHER_MAX_WAIT
    limits: RequestLimits = field(default_factory=RequestLimits)
    receive_timeout: float = DEFAULT_RECEIVE_TIMEOUT
    docs: bool = False


class _Loaded:
    """The scorer once loaded (in a thread, so that /health answers while it loads), its worker
    and its queue's admission."""

    def __init__(self, max_wait: float) -> None:
        self.scorer: Scorer | None = None
        self.failure: BaseException | None = None
        self.worker = ThreadPoolExecutor(1, "cascade-teacher")
        self.admission = Admission(max_wait, what="the teacher")


def create_teacher_app(load: Callable[[], Scorer], config: TeacherConfig | None = None,
                       on_failure: Callable[[BaseException], None] | None = None) -> FastAPI:
    """An app that calls ``load`` in a thread at startup and serves the scorer it returns;
    ``on_failure`` hears of an exception ``load`` raised."""
    config = config or TeacherConfig()
    loaded = _Loaded(config.max_wait)

    def load_scorer() -> None:
        loaded.scorer = load()

    def close() -> None:
        loaded.worker.shutdown(wait=True)
        if loaded.scorer is not None:
            loaded.scorer.close()

    def failed(exc: BaseException) -> None:  # reported to the command, which exits with it
        loaded.failure = exc
        if on_failure is not None:
            on_failure(exc)

    lifespan = lifespan_of(close, load_scorer, failed)
    app = FastAPI(title="cascade serve (teacher)", version="1", lifespan=lifespan,
                  description="A GGUF's logit readout behind the System One decision API.",
                  **app_options(config.docs))
    _routes(app, loaded, config)
    add_wire(app)
    return app


def _routes(app: FastAPI, loaded: _Loaded, config: TeacherConfig) -> None:
    def ready() -> Scorer:
        if loaded.scorer is None:
            raise still_loading("the teacher model is")
        return loaded.scorer

    @app.api_route("/health", methods=["GET", "HEAD"], include_in_schema=False)
    @app.api_route("/healthz", methods=["GET", "HEAD"], include_in_schema=False)
    async def healthy() -> Response:
        return health(loaded.scorer is not None, loaded.failure, waiting=loaded.admission.inside)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        authorize(request, config.api_key)
        scorer = ready()
        return JSONResponse({"models": [{"name": scorer.model.path.name, "description": (
            f"logit readout of {scorer.model.path.name} (sha256 {scorer.model_sha256[:12]}...), prompt "
            f"{scorer.prompt_version}, uncalibrated")}]})

    @app.post("/v1/systemone")
    async def systemone(request: Request) -> Response:
        authorize(request, config.api_key)
        scorer = ready()
        body = await request_body(request, config.max_body, config.receive_timeout)
        try:  # CPU work, off the event loop
            parsed, work = await asyncio.to_thread(_read, body, config.limits)
        except RequestError as exc:
            raise unprocessable(exc) from None
        response = await _score(loaded, scorer, parsed, work, request)
        return Response(response.model_dump_json(), media_type="application/json")


def _read(body: bytes, limits: RequestLimits) -> tuple[DecisionRequest, float]:
    """A body parsed, validated and bounded, and its work in units (on a thread: CPU work)."""
    request = read_request(body, limits)
    return request, work_of(read_chars(request.state, request.questions.values()))


async def _score(loaded: _Loaded, scorer: Scorer, request: DecisionRequest, work: float,
                 http: Request) -> DecisionResponse:
    """Read ``request`` on the worker once admitted (``QueueFullError`` when not: 503). The
    worker marks the service's start and end itself, so that a request whose handler is gone
    still leaves the queue when its read ends, and one whose client went before it started is
    never read (``cascade.serve.gone``) and leaves the queue too."""
    admission = loaded.admission
    ticket = admission.enter(work)

    def read() -> DecisionResponse:
        late = admission.late(ticket)
        if late is not None:  # waited past max_wait: refused now rather than answered too late
            admission.done(ticket, None)
            raise late
        start = admission.started(ticket)
        try:
            return scorer.score(request)
        finally:
            admission.done(ticket, start)

    job = loaded.worker.submit(read)
    job.add_done_callback(lambda done: admission.done(ticket, None) if done.cancelled() else None)
    try:
        return await unless_gone(job, http)
    except (RequestError, InputTooLongError) as exc:
        raise unprocessable(exc) from None
