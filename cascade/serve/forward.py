"""The top tier's step when the teacher is an upstream URL: ONE request per job, holding only what
the local tiers left.

A job reaches the top with two kinds of question left: the bundle's questions no cheaper tier was
sure of (queued at the top by the router), and the questions the bundle does not hold. Both go in
one request, so a request costs the upstream at most one call, of only the questions it must
answer. Bundle questions go under the bundle's ids (the ids their certified prompt hashes are
known by: ``cascade.routing.endpoint``); the others under an id made from their content, never the
client's, so that two clients' "q1" of different content never look like one question whose
prompt hash changed. The answers are handed back to the router as the top tier's reply (the
bundle's part) and to the response as the teacher's own answers (the rest, ``covered: false``).

The jobs run on a pool (``PoolWorker``) of as many threads as the upstream client has calls in
flight: no job waits for another's call to finish, as a batch would make it.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

import numpy as np

from cascade.answers import Usage
from cascade.deferral import DeferralQueue
from cascade.questions import Question
from cascade.routing.budget import Run
from cascade.routing.router import Cascade
from cascade.serve.audit_pool import AuditPool, Busy
from cascade.serve.matching import Matched, content_key
from cascade.serve.responses import Foreign, foreign_answers
from cascade.tiers.base import Item, Reply
from cascade.tiers.upstream import UpstreamTier


class Forwarded(Protocol):
    """What the upstream step reads and fills of a job (``cascade.serve.engine.Job``)."""

    item: Item
    matched: Matched
    run: Run | None
    authorization: str | None
    foreign: Foreign | None


log = logging.getLogger("cascade.serve")
J = TypeVar("J")
A = TypeVar("A")


def wire_id(question: Question) -> str:
    """The id a question the bundle does not hold is sent upstream under: its content's hash."""
    return "x" + hashlib.sha256(repr(content_key(question)).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Sent:
    """What one job's call took upstream: questions sent and the call's seconds (0, 0.0: none)."""

    questions: int
    seconds: float


def forward(cascade: Cascade, tier: UpstreamTier, job: Forwarded) -> Sent:
    """Ask ``tier`` in one request the bundle questions ``job``'s run queued at the top and the
    questions the bundle does not hold; record the first with the router and keep the second as
    ``job.foreign``. Raises what the call raises (``TeacherChangedError`` included)."""
    top = len(cascade.tiers) - 1
    run = job.run
    mine = list(run.queued[top][0]) if run is not None and cascade.next_tier(run) == top else []
    theirs = {rid: wire_id(q) for rid, q in job.matched.foreign.items()}
    asked: dict[str, Question] = {qid: cascade.questions[qid] for qid in mine}
    asked.update({wid: job.matched.foreign[rid] for rid, wid in theirs.items()})
    if not asked:
        return Sent(0, 0.0)
    got = tier.ask(job.item, asked, job.authorization)
    if run is not None and mine:
        reply = Reply.empty(1)
        reply.answers[0] = {qid: got.distributions[qid] for qid in mine}
        reply.usage[0] = got.usage
        cascade.ask([run], top, reply=reply)
    if theirs:
        raw = {rid: got.distributions[wid] for rid, wid in theirs.items()}
        usage = Usage(questions=len(theirs), ran_on={tier.name: tier.ran_on})
        job.foreign = foreign_answers(cascade, job.matched.foreign, _one(raw), usage, job.matched.near)
    return Sent(len(asked), got.usage.seconds)


def _one(raw: Mapping[str, np.ndarray]) -> Reply:
    reply = Reply.empty(1)
    reply.answers[0] = dict(raw)
    return reply


class PoolWorker(Generic[J, A]):
    """The top tier's worker for an upstream: each live job on a thread of a pool of ``size``
    (``serve`` gets it alone); audits from ``deferred`` on an ``AuditPool`` of their own,
    ``audit_in_flight`` at once, never waiting for live jobs. ``depth`` counts live jobs queued
    and not yet taken, as ``_Worker``'s."""

    def __init__(self, name: str, serve: Callable[[list[J]], None], size: int,
                 deferred: DeferralQueue[A], audit: Busy[A], audit_in_flight: int) -> None:
        self.serve = serve
        self.depth = 0
        self.lock = threading.Lock()
        self._pool = ThreadPoolExecutor(size, f"cascade-{name}")
        self.audits = AuditPool(name, deferred, audit, audit_in_flight)

    def put(self, job: J) -> None:
        with self.lock:
            self.depth += 1
        self._pool.submit(self._run, job)

    def _run(self, job: J) -> None:
        with self.lock:
            self.depth -= 1
        try:
            self.serve([job])
        except Exception:  # serve settles its jobs itself; this is a bug, said loudly
            log.exception("the upstream worker failed")

    def audit_deferred(self) -> None:
        """An audit was deferred: an audit thread takes it when the upstream lets it."""
        self.audits.wake()

    def stop(self) -> None:
        """Finish the live jobs taken or queued and the audits in flight; audits still waiting
        are left (the engine counts them)."""
        self._pool.shutdown(wait=True)
        self.audits.stop()
