"""Routing requests concurrently: one worker thread per tier, the top tier's queue bounded.

A request becomes a job: its questions matched to the bundle's, a router ``Run`` started for them.
The job visits the workers of the tiers its run needs, lowest first (``Cascade.next_tier``), and
each worker asks its tier about the jobs waiting for it. The encoder's worker takes every job
that is waiting when it looks, up to ``max_batch``, as ONE batch (``Cascade.ask`` of several runs:
a tier's answer about an item does not depend on the batch, so batching changes no answer, and
each request keeps its own budget); a GGUF tier's worker takes one job at a time, since llama.cpp
reads each state on its own anyway. Each worker owns its tier's model, so no llama.cpp context is
ever used by two threads. A job whose questions the encoder keeps is done at the encoder's
worker, however long the teacher's queue: it never waits behind another job's escalation.

The top tier's queue holds at most ``teacher_queue`` jobs. A job that would go past it is refused
(``Overloaded``: the server answers 503 with ``Retry-After``), or with ``overload="keep"`` keeps
its best lower answers, marked budget-limited, overloaded and uncertified, where every escalated
question has one. Questions the bundle does not hold are answered by the top tier alone, on its
worker, after the job's routed questions.

With an ``Auditor``, the answered requests its sample chooses (keyed on the engine's count of
answered requests) are audited on the top tier's worker at the lowest priority: a worker takes an
audit only when no live job waits, so a live escalation waits at most for the one audit being
read. At most ``audit_queue`` audits wait; one past it is dropped and counted.
"""

from __future__ import annotations

import itertools
import logging
import math
import queue
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Literal

from cascade.answers import DecisionResponse
from cascade.audit.auditor import Auditor
from cascade.questions import State
from cascade.routing.budget import Budget, Run
from cascade.routing.router import Cascade
from cascade.serve.matching import Matched
from cascade.serve.responses import Foreign, answer_foreign, assemble
from cascade.serve.transport import HttpProblem
from cascade.tiers.base import Item

log = logging.getLogger("cascade.serve")
Overload = Literal["refuse", "keep"]
_LIVE, _STOP, _AUDIT = 0, 1, 2  # a worker takes live jobs first, audits only when none waits


@dataclass(frozen=True)
class EngineSettings:
    """``batch``: route the requests waiting at the encoder together (False: one at a time).
    ``max_batch``: most requests in one encoder batch. ``teacher_queue``: most requests waiting
    for the top tier. ``overload``: what a request gets past that bound (see the module).
    ``audit_queue``: most audits waiting for the top tier; past it an audit is dropped (and
    counted), which depends on the queue only, never on the item."""

    batch: bool = True
    max_batch: int = 64
    teacher_queue: int = 32
    overload: Overload = "refuse"
    audit_queue: int = 64


class Overloaded(HttpProblem):
    """The top tier's queue is full: retry after about the time it takes to drain it."""

    def __init__(self, retry_after: int, queued: int) -> None:
        super().__init__(503, "overloaded",
                         f"the teacher's queue is full ({queued} requests waiting); retry after "
                         f"{retry_after} s, send a budget (x_budget) that keeps answers below, or "
                         "start the server with --overload keep", {"Retry-After": str(retry_after)},
                         kind="overloaded_error")


@dataclass
class Job:
    """One request on its way through the workers."""

    item: Item
    order: list[str]
    matched: Matched
    budget: Budget
    future: Future[DecisionResponse] = field(default_factory=Future)
    run: Run | None = None
    foreign: Foreign | None = None


@dataclass
class _Audit:
    """An answered request the teacher is to audit: the item, its response, its bundle ids."""

    item: Item
    response: DecisionResponse
    bundle_ids: dict[str, str]


_Entry = tuple[int, int, "Job | _Audit | None"]


class _Worker:
    """A thread serving one tier's queue: ``serve`` gets the live jobs it takes at once, ``audit``
    one audit at a time, taken only when no live job waits."""

    def __init__(self, name: str, serve: Callable[[list[Job]], None], batch: int,
                 audit: Callable[[_Audit], None]) -> None:
        self.queue: queue.PriorityQueue[_Entry] = queue.PriorityQueue()
        self.serve, self.audit, self.batch = serve, audit, batch
        self.depth = 0  # live jobs queued and not yet taken
        self.audits = 0  # audits queued and not yet taken
        self.lock = threading.Lock()
        self._order = itertools.count()
        self.thread = threading.Thread(target=self._loop, name=f"cascade-{name}", daemon=True)
        self.thread.start()

    def put(self, job: Job) -> None:
        with self.lock:
            self.depth += 1
        self.queue.put((_LIVE, next(self._order), job))

    def put_audit(self, audit: _Audit) -> None:
        with self.lock:
            self.audits += 1
        self.queue.put((_AUDIT, next(self._order), audit))

    def _loop(self) -> None:
        while True:
            kind, _, first = self.queue.get()
            if kind == _STOP:
                return
            if isinstance(first, _Audit):
                with self.lock:
                    self.audits -= 1
                self.audit(first)
                continue
            jobs = [first] if isinstance(first, Job) else []
            while len(jobs) < self.batch:
                try:
                    entry = self.queue.get_nowait()
                except queue.Empty:
                    break
                if not isinstance(entry[2], Job):
                    self.queue.put(entry)
                    break
                jobs.append(entry[2])
            with self.lock:
                self.depth -= len(jobs)
            self.serve(jobs)

    def stop(self) -> None:
        """Stop after the live jobs queued; audits still waiting are left undone."""
        self.queue.put((_STOP, next(self._order), None))
        self.thread.join()


class Engine:
    """The workers of one cascade; ``submit`` a request, get a future of its response."""

    def __init__(self, cascade: Cascade, settings: EngineSettings | None = None,
                 auditor: Auditor | None = None) -> None:
        """``auditor``: audits its sampler's share of the answered requests on the top tier's
        worker, at the lowest priority (None: no audit)."""
        self.cascade = cascade
        self.settings = settings or EngineSettings()
        self.auditor = auditor
        self.top = len(cascade.tiers) - 1
        self._top_seconds = 1.0  # running mean of a top-tier job, for Retry-After
        self._answered = itertools.count()  # what the audit sample is keyed on
        self.audit_counts = {"audited": 0, "dropped": 0, "failed": 0, "unreadable": 0}
        self.workers = [
            _Worker(tier.name, self._serving(t), self._batch_of(t), self._audit)
            for t, tier in enumerate(cascade.tiers)
        ]

    def _batch_of(self, t: int) -> int:
        batched = self.settings.batch and not self.cascade.tiers[t].meters_tokens
        return self.settings.max_batch if batched else 1

    def queue_depths(self) -> dict[str, int]:
        return {tier.name: w.depth for tier, w in zip(self.cascade.tiers, self.workers, strict=True)}

    def submit(self, state: State, order: Sequence[str], matched: Matched, budget: Budget,
               request_id: str) -> Future[DecisionResponse]:
        """Start routing one request; its future holds the response or the error to answer."""
        job = Job(Item(request_id, state), list(order), matched, budget)
        try:
            if matched.asked:
                job.run = self.cascade.start([job.item], [matched.asked], budget)
            self._forward(job)
        except Exception as exc:  # the future carries every failure back to the request
            job.future.set_exception(exc)
        return job.future

    def close(self) -> None:
        for worker in self.workers:
            worker.stop()

    def _serving(self, t: int) -> Callable[[list[Job]], None]:
        return lambda jobs: self._serve(t, jobs)

    def _serve(self, t: int, jobs: list[Job]) -> None:
        started = time.perf_counter()
        routed = [job for job in jobs if job.run is not None and self.cascade.next_tier(job.run) == t]
        try:
            if routed:
                self.cascade.ask([job.run for job in routed if job.run is not None], t)
        except Exception as exc:
            if len(jobs) > 1:  # find the one that failed; the others get their answers
                for job in jobs:
                    self._serve(t, [job])
                return
            jobs[0].future.set_exception(exc)
            return
        for job in jobs:
            try:
                if t == self.top and job.matched.foreign:
                    job.foreign = answer_foreign(self.cascade, job.item, job.matched.foreign,
                                                 job.matched.near)
                self._forward(job, asked_top=t == self.top)
            except Exception as exc:
                job.future.set_exception(exc)
        if t == self.top:
            self._top_seconds = 0.8 * self._top_seconds + 0.2 * (time.perf_counter() - started) / len(jobs)

    def _forward(self, job: Job, asked_top: bool = False) -> None:
        """Send a job to the next worker it needs, or finish it."""
        t = self.cascade.next_tier(job.run) if job.run is not None else None
        if t is None and job.matched.foreign and not asked_top:
            t = self.top
        if t is None:
            routed = self.cascade.responses(job.run)[0] if job.run is not None else None
            response = assemble(self.cascade, job.order, job.matched, routed, job.foreign)
            job.future.set_result(response)
            self._sample(job, response)
            return
        if t == self.top and self.workers[t].depth >= self.settings.teacher_queue:
            self._overloaded(job)
            return
        self.workers[t].put(job)

    def _sample(self, job: Job, response: DecisionResponse) -> None:
        """Queue the audit of an answered request where the sample chose it (keyed on the count of
        answered requests, not on anything the client sent)."""
        if self.auditor is None or not self.auditor.sampler.chosen(str(next(self._answered))):
            return
        top = self.workers[self.top]
        if top.audits >= self.settings.audit_queue:
            self.audit_counts["dropped"] += 1
            return
        # a client may send the same X-Request-Id twice: the audit's id is the server's own
        item = Item(f"{job.item.id}.{uuid.uuid4().hex[:12]}", job.item.state)
        top.put_audit(_Audit(item, response, dict(job.matched.bundle)))

    def _audit(self, audit: _Audit) -> None:
        assert self.auditor is not None
        try:
            record = self.auditor.audit(audit.item, audit.response, audit.bundle_ids)
            self.audit_counts["audited" if record is not None else "unreadable"] += 1
        except Exception:  # an audit never fails a request; it is logged and counted
            log.exception("audit of request %s failed", audit.item.id)
            self.audit_counts["failed"] += 1

    def _overloaded(self, job: Job) -> None:
        keep = (self.settings.overload == "keep" and not job.matched.foreign and job.run is not None
                and self.cascade.keep_below_top(job.run))
        if keep:
            self._forward(job)
            return
        depth = self.workers[self.top].depth
        retry = max(1, min(60, math.ceil(depth * self._top_seconds)))
        job.future.set_exception(Overloaded(retry, depth))
