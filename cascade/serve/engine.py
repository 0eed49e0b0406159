"""Routing requests concurrently: one worker per tier, the top tier's queue admitted by expected wait.

A request becomes a job: its questions matched to the bundle's, a router ``Run`` started for them.
The job visits the workers of the tiers its run needs, lowest first (``Cascade.next_tier``), and
each worker asks its tier about the jobs waiting for it. The encoder's worker takes every job
that is waiting when it looks, up to ``max_batch``, as ONE batch (``Cascade.ask`` of several runs:
a tier's answer about an item does not depend on the batch, so batching changes no answer, and
each request keeps its own budget); a GGUF tier's worker takes one job at a time, since llama.cpp
reads each state on its own anyway. Each worker owns its tier's model, so no llama.cpp context is
ever used by two threads. A job whose questions the encoder keeps is done at the encoder's
worker, however long the teacher's queue: it never waits behind another job's escalation. An
upstream teacher's worker runs each job on a pool instead, in ONE request holding only the
questions left (``cascade.serve.forward``).

The top tier's queue, a local GGUF or an upstream alike, admits a job only while its expected
wait (the measured service time per unit of work times the units of work ahead: the characters
the teacher reads, not the count of jobs; ``cascade.teachers.admission``) fits ``max_wait``,
below the 10 s clients wait. Past it a job is refused at once (``QueueFullError``: 503 with
``Retry-After``), or with ``overload="keep"`` keeps its best lower answers, marked
budget-limited, overloaded and uncertified, where every escalated question has one. A queue
below the top holds at most ``lower_queue`` jobs; past it a job is refused at once too. A job whose
client has gone (its future cancelled) is dropped by the next worker that takes it, uncomputed.

With an upstream teacher, an answer whose identity is not the bundle's teacher voids the
certificate at once (``void``): an alarm line, every question demoted to the upstream with the
reason, until the server loads a recalibrated bundle. With ``forward_auth``, a caller whose key
the upstream has not accepted lately gets every question from the upstream (which checks it).

With an ``Auditor``, the answered requests its sample chooses (keyed on the engine's count of
answered requests) are deferred in a queue of at most ``audit_queue`` (``cascade.deferral``):
a local GGUF teacher takes them on its worker at the lowest priority, when no live job waits; an
upstream teacher takes them on its own capacity, ``audit_in_flight`` at once, whatever the local
queue, pausing only when the upstream answers 429 or 503 (``cascade.serve.audit_pool``). Past
``audit_queue`` one audit is dropped at random, never the newest by rule, so each audited item's
inclusion probability is known and written with it, with the routed counts (``Auditor.route``).
An audit of a request the teacher answered on every bundle question (``Auditor.answered_above``)
needs no teacher: it never waits in that queue. No worker writes the store: every audit whose
answers are in hand (those, and a local teacher's once read) goes to one thread of its own
through a second such queue (``writes``), so a store that stalls holds up no request.
With an escalation ``Collector``, the teacher's answers to the questions a request escalated are
handed to it once answered (``cascade.routing.escalations``), to be written on its own thread.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field

from cascade.answers import DecisionResponse
from cascade.audit.auditor import Auditor, Known
from cascade.backoff import Backoff
from cascade.collect.collector import Collector, size_of
from cascade.collect.escalation import EscalationRecord
from cascade.cost.upstream import UpstreamLedger
from cascade.deferral import DeferralQueue, Deferred
from cascade.errors import CascadeError, QueueFullError, ServiceError, StoreUnavailable, TeacherChangedError
from cascade.questions import Question, State
from cascade.readout.prompts import read_chars
from cascade.routing.budget import Budget, Run
from cascade.routing.escalations import escalation_of, sent_up_whatever
from cascade.routing.router import Cascade
from cascade.serve.audit_pool import AuditPool
from cascade.serve.engine_settings import EngineSettings
from cascade.serve.forward import PoolWorker, Sent, forward
from cascade.serve.matching import Matched
from cascade.serve.responses import Foreign, answer_foreign, assemble
from cascade.serve.totals import Totals
from cascade.serve.worker import TierWorker
from cascade.teachers.admission import Admission, RateAdmission, Ticket, work_of
from cascade.tiers.base import Item
from cascade.tiers.upstream import UpstreamTier

log = logging.getLogger("cascade.serve")
_BUSY = (429, 503)  # what an upstream answers when an audit should wait
WRITE_DRAIN = 5.0
"""Seconds a stopping engine waits for its audits' store writes (a store that stalls may not end)."""
DRIFT_WHY = "a drift alarm on audited traffic: agreement with the teacher fell below the target"


class Retired(Exception):
    """This engine has handed over to another (a new bundle): submit to the current one."""


@dataclass
class Job:
    """One request on its way through the workers."""

    item: Item
    order: list[str]
    matched: Matched
    budget: Budget
    authorization: str | None = None
    future: Future[DecisionResponse] = field(default_factory=Future)
    run: Run | None = None
    foreign: Foreign | None = None
    ticket: Ticket | None = None
    sent: Sent = field(default_factory=lambda: Sent(0, 0.0))
    restarted: bool = False


@dataclass
class _Audit:
    """An answered request the teacher is to audit: its item, response, bundle ids and routed counts,
    and whether it holds the teacher's answer to every bundle question (``known``: nothing to ask)."""

    item: Item
    response: DecisionResponse
    bundle_ids: dict[str, str]
    routed: dict[str, int]
    authorization: str | None = None
    known: bool = False
    answers: Known | None = None  # the teacher's, once read: the audit then waits only for the store
    survival: float = 1.0  # of the teacher's queue, before the store's


class Engine:
    """The workers of one cascade; ``submit`` a request, get a future of its response."""

    def __init__(self, cascade: Cascade, settings: EngineSettings | None = None,
                 auditor: Auditor | None = None, ledger: UpstreamLedger | None = None,
                 escalations: Collector[EscalationRecord] | None = None) -> None:
        """``auditor``: audits its sampler's share of the answered requests on the top tier's worker,
        at the lowest priority, and writes them on a thread of its own (None: no audit). ``ledger``:
        counts what went upstream and ``escalations`` keeps the teacher's answers to escalated
        questions (a server keeps both across bundles)."""
        if escalations is not None and not cascade.tiers[-1].reads_any_question:
            raise CascadeError(f"keeping escalations needs a live teacher as the top tier; "
                               f"{cascade.tiers[-1].name!r} replays recorded labels (give --teacher, or "
                               "--escalation-share 0)")
        self.cascade = cascade
        self.settings = settings or EngineSettings()
        self.auditor, self.escalations = auditor, escalations
        self.ledger = ledger or UpstreamLedger()
        self.top = len(cascade.tiers) - 1
        top = cascade.tiers[-1]
        self.upstream = top if isinstance(top, UpstreamTier) else None
        parallel = self.upstream.settings.max_in_flight if self.upstream is not None else 1
        what = f"the teacher {top.name!r}"
        self.admission = Admission(self.settings.max_wait, what=what) if self.upstream is None else \
            RateAdmission(self.settings.max_wait, what=what)  # an upstream's parallelism is its own
        self.voided: str | None = None  # why the certificate is void (the teacher changed)
        self.totals = Totals()
        self.deferred: DeferralQueue[_Audit] = DeferralQueue(self.settings.audit_queue)
        self._answered = itertools.count()  # what the audit sample is keyed on
        self._gate = threading.Lock()
        self._sampling = threading.Lock()
        self._retired = False
        # at least a batch: the teacher's answers to a whole batch are handed over at once
        self.writes: DeferralQueue[_Audit] = DeferralQueue(max(self.settings.audit_queue,
                                                               self.settings.max_batch))
        self.writer = AuditPool("store", self.writes, self._write, 1, why=None)  # no worker waits for it
        self.store_down = Backoff()  # the audit store's outage, while one lasts (/metrics)
        self.workers: list[TierWorker[Job, _Audit] | PoolWorker[Job, _Audit]] = [
            TierWorker(tier.name, self._serving(t), self._batch_of(t))
            for t, tier in enumerate(cascade.tiers[:-1])]
        if self.upstream is not None:
            self.workers.append(PoolWorker(top.name, self._serving(self.top), parallel, self.deferred,
                                           self._ask, self.settings.audit_in_flight))
        else:
            self.workers.append(TierWorker(top.name, self._serving(self.top), self._batch_of(self.top),
                                           self.deferred, self._ask))

    def _batch_of(self, t: int) -> int:
        batched = self.settings.batch and not self.cascade.tiers[t].meters_tokens
        return self.settings.max_batch if batched else 1

    def queue_depths(self) -> dict[str, int]:
        return {tier.name: w.depth for tier, w in zip(self.cascade.tiers, self.workers, strict=True)}

    def submit(self, state: State, order: Sequence[str], matched: Matched, budget: Budget,
               request_id: str, authorization: str | None = None) -> Future[DecisionResponse]:
        """Start routing one request; its future holds the response or the error to answer.
        Cancelling the future (the client has gone) drops the job at the next worker. Raises
        ``Retired`` once this engine has handed over to another."""
        job = Job(Item(request_id, state), list(order), matched, budget, authorization)
        with self._gate:
            if self._retired:
                raise Retired
            try:
                self._start(job)
                self._forward(job)
            except Exception as exc:  # the future carries every failure back to the request
                self._fail(job, exc)
        return job.future

    def _start(self, job: Job) -> None:
        """The job's run: from the top where the caller's key is the upstream's to vouch for."""
        if not job.matched.asked:
            return
        vouched = (not self.settings.forward_auth or self.upstream is None
                   or self.upstream.client.accepted.accepted(job.authorization))
        job.run = self.cascade.start([job.item], [job.matched.asked], job.budget,
                                     first_tier=0 if vouched else self.top)

    def retire(self) -> None:
        """Take no more jobs; finish every job taken (in tier order, so none is left behind a
        stopped worker), then close the auditor and the cascade. Blocks until done."""
        with self._gate:
            self._retired = True
        self.close()
        if self.auditor is not None:
            self.auditor.close()
        self.cascade.close()

    def close(self) -> None:
        """Stop the workers, then give the store's thread ``WRITE_DRAIN`` seconds for the audits
        they handed it; the audits left waiting are counted dropped (stopped)."""
        for worker in self.workers:
            worker.stop()
        self.writer.stop(drain=WRITE_DRAIN)
        if left := len(self.deferred.clear()) + len(self.writes.clear()):  # said: /metrics ends with us
            log.warning("audits: %d left unwritten at stop (the store took none in %g s)", left, WRITE_DRAIN)
        self.totals.drop("stopped", left)

    def _serving(self, t: int) -> Callable[[list[Job]], None]:
        return lambda jobs: self._serve(t, jobs)

    def _serve(self, t: int, jobs: list[Job]) -> None:
        jobs = [job for job in jobs if not self._gone(job)]
        if not jobs:
            return
        if t == self.top:
            for job in jobs:
                self._serve_top(job)
            return
        try:
            self.cascade.ask([job.run for job in jobs if job.run is not None], t)
        except Exception as exc:
            if len(jobs) > 1:  # find the one that failed; the others get their answers
                for job in jobs:
                    self._serve(t, [job])
                return
            self._fail(jobs[0], exc)
            return
        for job in jobs:
            try:
                self._forward(job)
            except Exception as exc:
                self._fail(job, exc)

    def _gone(self, job: Job) -> bool:
        """Whether the job's client has gone: then it is dropped here, uncomputed."""
        if not job.future.cancelled():
            return False
        if job.ticket is not None:
            self.admission.done(job.ticket, None)
            job.ticket = None
        self.totals.abandoned += 1
        return True

    def _serve_top(self, job: Job) -> None:
        """One job at the top tier, its service timed for admission; one that waited past
        ``max_wait`` is refused (or kept below) instead: it would be answered too late."""
        late = self.admission.late(job.ticket) if job.ticket is not None else None
        if late is not None and job.ticket is not None:
            self.admission.done(job.ticket, None)
            job.ticket = None
            self._overloaded(job, late)
            return
        started = self.admission.started(job.ticket) if job.ticket is not None else None
        try:
            self._ask_top(job)
            self._forward(job, asked_top=True)
        except Exception as exc:
            self._fail(job, exc)
        finally:
            if job.ticket is not None:
                self.admission.done(job.ticket, started)
                job.ticket = None

    def _ask_top(self, job: Job) -> None:
        if self.upstream is None:
            if job.run is not None and self.cascade.next_tier(job.run) == self.top:
                self.cascade.ask([job.run], self.top)
            if job.matched.foreign:
                job.foreign = answer_foreign(self.cascade, job.item, job.matched.foreign, job.matched.near)
            return
        try:
            job.sent = forward(self.cascade, self.upstream, job)
        except TeacherChangedError as exc:
            if job.restarted:
                raise
            self._teacher_changed(exc)
            job.restarted = True
            if self.voided is not None:
                self._start(job)  # every question now goes up (demoted), its lower answers dropped
            job.sent = forward(self.cascade, self.upstream, job)

    def _teacher_changed(self, exc: TeacherChangedError) -> None:
        """Void the certificate (once): the alarm line, every bundle question demoted to the
        upstream, and the new teacher's answers taken from now on. A cascade already serving
        another teacher (accepted, uncertified) only says so."""
        assert self.upstream is not None
        with self._gate:
            first = self.voided is None and self.cascade.certified
            if self.cascade.certified:
                self.voided = (f"the upstream now answers as another teacher than the bundle was certified "
                               f"against: {'; '.join(exc.changes) or exc}; every question goes upstream "
                               "until a recalibrated bundle is served")
                self.cascade.certified = False
                self.cascade.demoted.update(self.cascade.questions)
            self.upstream.reset_identity()
        if first:
            log.error("ALARM certificate void: the upstream %s now answers as another teacher than the "
                      "bundle's (%s). Every question goes to the upstream, marked x_routing.demoted, "
                      "until a recalibrated bundle is served (or the server restarts with "
                      "--accept-other-teacher)", self.upstream.settings.shown, "; ".join(exc.changes) or exc)
        else:
            log.warning("the upstream's teacher changed again (%s); answers stay marked certified=false",
                        "; ".join(exc.changes) or exc)

    def _forward(self, job: Job, asked_top: bool = False) -> None:
        """Send a job to the next worker it needs, or finish it."""
        t = self.cascade.next_tier(job.run) if job.run is not None else None
        if t is None and job.matched.foreign and not asked_top:
            t = self.top
        if t is None:
            self._finish(job)
            return
        if t == self.top:
            try:
                work = work_of(read_chars(job.item.state, self._top_questions(job)))
                job.ticket = self.admission.enter(work)
            except QueueFullError as exc:
                self._overloaded(job, exc)
                return
        elif self.workers[t].depth >= self.settings.lower_queue:
            raise QueueFullError(f"the tier {self.cascade.tiers[t].name!r} has {self.workers[t].depth} "
                                 f"requests waiting, its limit (--lower-queue {self.settings.lower_queue}); "
                                 "retry after 1 s", retry_after=1)
        self.workers[t].put(job)

    def _top_questions(self, job: Job) -> list[Question]:
        """The questions a job takes to the top tier: its bundle questions queued there, and the
        questions the bundle does not hold."""
        queued = self.cascade.questions
        asked = [queued[qid] for qid in job.run.queued[self.top][0]] if job.run is not None else []
        return asked + list(job.matched.foreign.values())

    def _finish(self, job: Job) -> None:
        routed = self.cascade.responses(job.run)[0] if job.run is not None else None
        why = (dict.fromkeys(self.cascade.questions, self.voided) if self.voided else
               dict.fromkeys(self.cascade.demoted, DRIFT_WHY))
        response = assemble(self.cascade, job.order, job.matched, routed, job.foreign, why)
        if self.upstream is not None:
            self.ledger.request(len(job.order), job.sent.questions, job.sent.seconds)
        try:
            job.future.set_result(response)
        except InvalidStateError:  # the client went while the answer was made
            return
        self._sample(job, response)
        self._keep_escalation(job)

    def _keep_escalation(self, job: Job) -> None:
        """Hand the teacher's answers to the job's escalated questions to the collector (built on
        its thread); none unless the top tier is the teacher the certificate names."""
        run = job.run
        if (self.escalations is None or run is None or self.voided or not self.cascade.certified
                or not run.answered[self.top][0]):
            return
        cascade, request, at = self.cascade, job.item.id, time.time()
        census = sent_up_whatever(cascade, run)  # now: a drift alarm may demote a question before the build
        self.escalations.offer(lambda kept: escalation_of(cascade, run, 0, request, at, census, kept),
                               size=size_of(job.item.state))

    @staticmethod
    def _fail(job: Job, exc: BaseException) -> None:
        with contextlib.suppress(InvalidStateError):  # the client went while the answer was made
            job.future.set_exception(exc)

    def _sample(self, job: Job, response: DecisionResponse) -> None:
        """Count an answered request among the routed ones and defer its audit where the sample
        chose it (keyed on the count of answered requests, not on anything the client sent), or hand
        it to the store's thread where the response holds the teacher's answers; none while the
        certificate is void."""
        if self.auditor is None or self.voided:
            return
        bundle_ids = dict(job.matched.bundle)
        with self._sampling:  # the workers finishing jobs count at once
            routed = self.auditor.route(response, bundle_ids)
            self.totals.routed = routed
            self.totals.eligible += 1
            if not self.auditor.sampler.chosen(str(next(self._answered))):
                return
            self.totals.chosen += 1
        # a client may send the same X-Request-Id twice: the audit's id is the server's own
        item = Item(f"{job.item.id}.{uuid.uuid4().hex[:12]}", job.item.state)
        held = self.auditor.answered_above(response, bundle_ids)  # read once, written as is
        known = held is not None
        audit = _Audit(item, response, bundle_ids, routed, job.authorization, known, held)
        if known:  # it needs no teacher: it never waits for one
            self._write_later(audit)
            return
        dropped = self.deferred.put(audit)
        if dropped:
            with self._sampling:
                self.totals.drop("queue_full", len(dropped))
        if all(d is not audit for d in dropped):
            self.workers[self.top].audit_deferred()

    def _ask(self, deferred: Deferred[_Audit]) -> float | None:
        """On the teacher's worker (local) or an audit thread (upstream): read the teacher's
        answers, and leave the write to the store's thread. The seconds to pause where the
        upstream answered 429/503 (the audit is then put back, not counted), else None."""
        assert self.auditor is not None
        audit, started = deferred.item, time.perf_counter()
        try:
            if self.upstream is not None:
                with self.upstream.on_behalf_of(audit.authorization):
                    answers = self.auditor.ask(audit.item)
                self.ledger.audit(len(self.cascade.questions), time.perf_counter() - started)
            else:
                answers = self.auditor.ask(audit.item)
        except TeacherChangedError as exc:  # an audit's answer is an answer: the change is caught here too
            self._teacher_changed(exc)
            self._counted("failed")
            return None
        except ServiceError as exc:
            if self.upstream is not None and exc.status in _BUSY:
                self._counted("paused")
                return float(exc.retry_after or 1)
            self._failed(audit)
            return None
        except Exception:  # an audit never fails a request; it is logged and counted
            self._failed(audit)
            return None
        if answers is None:
            self._counted("unreadable")
            return None
        audit.answers = answers
        self._write_later(audit, deferred.survival)
        return None

    def _write_later(self, audit: _Audit, survival: float = 1.0) -> None:
        """Queue an audit whose answers are in hand for the store's thread: past ``audit_queue``
        waiting (a store that stalls), one is dropped at random."""
        audit.survival = survival
        dropped = self.writes.put(audit)
        if dropped:
            with self._sampling:
                self.totals.drop("store_behind", len(dropped))
        if all(d is not audit for d in dropped):
            self.writer.wake()

    def _write(self, deferred: Deferred[_Audit]) -> float | None:
        """On the store's thread: the record written (its inclusion: the share times its survival
        of both queues), and the drift watch told. The seconds to pause where the store cannot be
        reached now (the audit is put back and written once it answers), else None."""
        assert self.auditor is not None
        audit = deferred.item
        try:
            record = self.auditor.audit(audit.item, audit.response, audit.bundle_ids,
                                        audit.survival * deferred.survival, audit.routed, audit.answers)
        except StoreUnavailable as exc:
            if self.store_down.since is None:
                log.warning("the audit store is unavailable (%s): audits wait, kept in their queue, and "
                            "are written when it answers again", exc)
            return self.store_down.failed()
        except Exception:  # an audit never fails a request; it is logged and counted
            self._failed(audit)
            return None
        if (down := self.store_down.succeeded()) is not None:
            log.warning("the audit store answers again after %.1f s", down)
        self._counted("audited" if record is not None else "unreadable", audit.known)
        return None

    def _failed(self, audit: _Audit) -> None:
        log.exception("audit of request %s failed", audit.item.id)
        self._counted("failed")

    def _counted(self, outcome: str, known: bool = False) -> None:
        """One audit's outcome (or pause) counted, ``known`` where it recorded the answers the
        escalation held: audits run on several threads at once."""
        with self._sampling:
            if outcome == "paused":
                self.totals.paused += 1
            else:
                self.totals.audits[outcome] += 1
                self.totals.answered_above += int(known and outcome == "audited")

    def _overloaded(self, job: Job, exc: QueueFullError) -> None:
        keep = (self.settings.overload == "keep" and not job.matched.foreign and job.run is not None
                and self.cascade.keep_below_top(job.run))
        if keep:
            self._forward(job)
            return
        below = not job.matched.foreign and job.run is not None and self.cascade.can_keep_below_top(job.run)
        advice = ("or send a budget (x_budget) that keeps answers below, or start the server with --overload "
                  "keep") if below else ("no budget keeps this request below the teacher: its state or "
                                         "questions need it (an unfamiliar state, a question the bundle does "
                                         "not hold)")
        self._fail(job, type(exc)(f"{exc}; {advice}", retry_after=exc.retry_after))
