"""Admission to a top tier's queue by expected wait, not by count.

A queue bounded by count lets a request in that will wait longer than its client does: with a
teacher taking a second per request, 32 waiting is half a minute, and an SDK gives up after 10 s
while the teacher still computes the answer nobody reads. So a request is admitted only while its
expected wait, the measured service time times the requests ahead of it (over the tier's
parallel slots), fits ``max_wait``; past that it is refused at once with a ``Retry-After`` of the
seconds until it would fit. Until a service time is measured, ``first_guess`` stands in for it,
or the age of the oldest request in service where that is longer (a service takes at least as
long as the one running has run). An estimate can be short (the tier slows under the very load
that fills its queue): a request that has waited past ``max_wait`` when its service would start
is refused then (``late``), so an answer never comes later than ``max_wait`` plus one service.

Requests are counted by their work, not by their number: one request may ask one question about
a short email or a hundred about a long one. A request's ``work`` is the characters the teacher
reads for it (``cascade.readout.prompts.read_chars``: the state once, each question's blocks) in
units of ``WORK_UNIT_CHARS``, at least one (a request's template and forward pass); service times
are measured per unit, and a newcomer's wait is the units ahead of it times that.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass

from cascade.errors import QueueFullError, WorkTooLargeError
from cascade.teachers.keys import Clock

WORK_UNIT_CHARS = 1000
"""Characters read that make one unit of work: a short email and its questions is one."""
ALONE_FROM = 4.0
"""Units from which a request is refused for its own work (413) where that alone would pass
``max_wait``: an ordinary request (an email and a few questions, one to three units) is only
ever queued, its wait bounded as every request's; one many times that is an outlier that would
hold the teacher past its client's patience."""
SMOOTHING = 0.2
"""Weight of the newest service time in the running mean: it follows a change of load within
a few requests without jumping at one slow one."""
TEACHER_MAX_WAIT = 5.0
"""Seconds of expected wait a teacher served alone admits by default. Its clients are cascades
whose reads of it end at 8 s (``UpstreamSettings.read_timeout``), so a request admitted here must
wait and be read within that: admitted at 8 s, as a cascade's own queue is (below the SDKs' 10 s),
one read more would end past the client's timeout, a 504 where a 503 with Retry-After was due."""


@dataclass(frozen=True)
class Ticket:
    """An admitted request: when it entered, and its work in units."""

    entered: float
    work: float = 1.0


def work_of(chars: int) -> float:
    """Units of work of a request whose teacher reads ``chars`` characters (at least one)."""
    return max(1.0, chars / WORK_UNIT_CHARS)


class Admission:
    """Admits requests to a queue served ``parallel`` at a time while their wait fits ``max_wait``;
    ``first_guess``: seconds per unit of work until one is measured."""

    def __init__(self, max_wait: float, parallel: int = 1, first_guess: float = 1.0,
                 what: str = "the teacher", clock: Clock = time.monotonic) -> None:
        if not max_wait > 0 or parallel < 1 or not first_guess > 0:
            raise ValueError(f"Admission needs max_wait > 0, parallel >= 1 and first_guess > 0; got "
                             f"{max_wait!r}, {parallel!r}, {first_guess!r}")
        self.max_wait, self.parallel, self.what, self.clock = max_wait, parallel, what, clock
        self.first_guess = first_guess
        self.service: float | None = None  # running mean of measured service seconds per unit
        self._inside: list[Ticket] = []  # the requests admitted and not yet done
        self._started: list[tuple[float, float]] = []  # start time and work of those in service
        self._lock = threading.Lock()

    def enter(self, work: float = 1.0) -> Ticket:
        """Admit one request of ``work`` units, or raise ``QueueFullError`` with the seconds to
        wait (``WorkTooLargeError`` where a request of ``ALONE_FROM`` units or more would take,
        alone, past ``max_wait`` at the measured time per unit)."""
        with self._lock:
            alone = self._alone(work)
            if alone is not None and work >= ALONE_FROM and alone > self.max_wait:
                chars = work * WORK_UNIT_CHARS
                raise WorkTooLargeError(
                    f"this request is {work:.0f} unit(s) of work for {self.what} ({chars:,.0f} characters "
                    f"to read), about {alone:.1f} s at the measured {alone / work:.2f} s a unit, past the "
                    f"{self.max_wait:g} s this server admits; send fewer questions or a shorter state per "
                    "request")
            wait = self._expected_wait(self._inside)
            if wait > self.max_wait:
                retry = max(1, math.ceil(wait - self.max_wait))
                raise QueueFullError(
                    f"{self.what} is busy: {len(self._inside)} request(s) ahead "
                    f"({self._units(self._inside):.0f} unit(s) of work), an expected wait of "
                    f"{wait:.1f} s, past the {self.max_wait:g} s this server admits; retry after "
                    f"{retry} s", retry_after=retry)
            ticket = Ticket(self.clock(), max(1.0, work))
            self._inside.append(ticket)
            return ticket

    def late(self, ticket: Ticket) -> QueueFullError | None:
        """The refusal of a request that has already waited past ``max_wait`` when its service
        would start (the estimate that admitted it was short: the tier slowed under the load),
        or None. Refused then, an answer never comes later than ``max_wait`` plus one service;
        the caller releases its ticket (``done(ticket, None)``)."""
        with self._lock:
            waited = self.clock() - ticket.entered
            if waited <= self.max_wait:
                return None
            retry = max(1, math.ceil(waited - self.max_wait))  # the queue is behind by about that
        return QueueFullError(f"{self.what} is busy: this request waited {waited:.1f} s in its queue, past "
                              f"the {self.max_wait:g} s this server admits; retry after {retry} s",
                              retry_after=retry)

    def started(self, ticket: Ticket) -> float:
        """Mark that a request's service starts (the worker took it); returns the start time."""
        with self._lock:
            now = self.clock()
            self._started.append((now, ticket.work))
            return now

    def done(self, ticket: Ticket, started: float | None) -> None:
        """A request left: ``started`` (from ``started()``) when it was served, None when it failed
        before its service began. Its service time feeds the running mean."""
        with self._lock:
            self._inside.remove(ticket)
            if started is None:
                return
            self._started.remove((started, ticket.work))
            took = (self.clock() - started) / ticket.work
            self.service = took if self.service is None else (1 - SMOOTHING) * self.service + SMOOTHING * took

    def _expected_wait(self, ahead: list[Ticket]) -> float:
        """Seconds a newcomer would wait with ``ahead`` admitted before it: none while a slot is
        free, else their units over the slots times the seconds per unit (at least the oldest
        service's so far)."""
        if len(ahead) < self.parallel:
            return 0.0
        per = self.service if self.service is not None else self.first_guess
        if self._started:
            began, work = min(self._started)
            per = max(per, (self.clock() - began) / work)
        return per * self._units(ahead) / self.parallel

    def _alone(self, work: float) -> float | None:
        """Seconds a request of ``work`` units would take in service, once a time is measured."""
        return self.service * max(1.0, work) if self.service is not None else None

    @staticmethod
    def _units(tickets: list[Ticket]) -> float:
        return math.fsum(ticket.work for ticket in tickets)

    @property
    def inside(self) -> int:
        """Requests admitted and not yet done."""
        with self._lock:
            return len(self._inside)


class RateAdmission(Admission):
    """Admission to a server of unknown parallelism (an upstream, which may read one request at a
    time or many): a request's wait is the units of work ahead of it times the measured time
    between two completions while the queue is busy, per unit of the one completed: ahead over
    throughput (Little's law). A service time
    would not do: with calls in flight on a one-slot upstream each call's latency grows with the
    queue behind the upstream's door, and with many slots it overstates the wait by their number.
    Until two completions are measured, ``first_guess`` stands in; while nothing completes, the
    time since the last completion (or since the queue became busy) does, where longer."""

    def __init__(self, max_wait: float, first_guess: float = 1.0, what: str = "the upstream",
                 clock: Clock = time.monotonic) -> None:
        super().__init__(max_wait, 1, first_guess, what, clock)
        self._mark: float | None = None  # the last completion while busy, or when it became busy

    def done(self, ticket: Ticket, started: float | None) -> None:
        with self._lock:
            self._inside.remove(ticket)
            if started is not None:
                self._started.remove((started, ticket.work))
                now = self.clock()
                if self._mark is not None:
                    gap = (now - self._mark) / ticket.work
                    self.service = gap if self.service is None else \
                        (1 - SMOOTHING) * self.service + SMOOTHING * gap
                self._mark = now
            if not self._inside:
                self._mark = None

    def _alone(self, work: float) -> float | None:
        """None: a throughput says how long the queue takes, not how long one call does."""
        return None

    def _expected_wait(self, ahead: list[Ticket]) -> float:
        now = self.clock()
        if not ahead:
            self._mark = now  # the queue becomes busy with this request
            return 0.0
        per = self.service if self.service is not None else self.first_guess
        if self._mark is not None:
            per = max(per, now - self._mark)
        return per * self._units(ahead)
