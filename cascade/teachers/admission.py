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
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass

from cascade.errors import QueueFullError
from cascade.teachers.keys import Clock

SMOOTHING = 0.2
"""Weight of the newest service time in the running mean: it follows a change of load within
a few requests without jumping at one slow one."""


@dataclass(frozen=True)
class Ticket:
    """An admitted request: when it entered."""

    entered: float


class Admission:
    """Admits requests to a queue served ``parallel`` at a time while their wait fits ``max_wait``."""

    def __init__(self, max_wait: float, parallel: int = 1, first_guess: float = 1.0,
                 what: str = "the teacher", clock: Clock = time.monotonic) -> None:
        if not max_wait > 0 or parallel < 1 or not first_guess > 0:
            raise ValueError(f"Admission needs max_wait > 0, parallel >= 1 and first_guess > 0; got "
                             f"{max_wait!r}, {parallel!r}, {first_guess!r}")
        self.max_wait, self.parallel, self.what, self.clock = max_wait, parallel, what, clock
        self.first_guess = first_guess
        self.service: float | None = None  # running mean of measured service seconds
        self._inside: list[float] = []  # entry times of the requests admitted and not yet done
        self._started: list[float] = []  # start times of those in service
        self._lock = threading.Lock()

    def enter(self) -> Ticket:
        """Admit one request, or raise ``QueueFullError`` with the seconds to wait."""
        with self._lock:
            wait = self._expected_wait(len(self._inside))
            if wait > self.max_wait:
                retry = max(1, math.ceil(wait - self.max_wait))
                raise QueueFullError(
                    f"{self.what} is busy: {len(self._inside)} request(s) ahead, an expected wait of "
                    f"{wait:.1f} s, past the {self.max_wait:g} s this server admits; retry after "
                    f"{retry} s", retry_after=retry)
            ticket = Ticket(self.clock())
            self._inside.append(ticket.entered)
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

    def started(self) -> float:
        """Mark that a request's service starts (the worker took it); returns the start time."""
        with self._lock:
            now = self.clock()
            self._started.append(now)
            return now

    def done(self, ticket: Ticket, started: float | None) -> None:
        """A request left: ``started`` (from ``started()``) when it was served, None when it failed
        before its service began. Its service time feeds the running mean."""
        with self._lock:
            self._inside.remove(ticket.entered)
            if started is None:
                return
            self._started.remove(started)
            took = self.clock() - started
            self.service = took if self.service is None else (1 - SMOOTHING) * self.service + SMOOTHING * took

    def _expected_wait(self, ahead: int) -> float:
        """Seconds a newcomer would wait with ``ahead`` requests admitted before it."""
        per = self.service if self.service is not None else self.first_guess
        if self._started:
            per = max(per, self.clock() - min(self._started))
        return per * (ahead // self.parallel) if ahead >= self.parallel else 0.0

    @property
    def inside(self) -> int:
        """Requests admitted and not yet done."""
        with self._lock:
            return len(self._inside)


class RateAdmission(Admission):
    """Admission to a server of unknown parallelism (an upstream, which may read one request at a
    time or many): a request's wait is the requests ahead of it times the measured time between
    two completions while the queue is busy, ahead over throughput (Little's law). A service time
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
            self._inside.remove(ticket.entered)
            if started is not None:
                self._started.remove(started)
                now = self.clock()
                if self._mark is not None:
                    gap = now - self._mark
                    self.service = gap if self.service is None else \
                        (1 - SMOOTHING) * self.service + SMOOTHING * gap
                self._mark = now
            if not self._inside:
                self._mark = None

    def _expected_wait(self, ahead: int) -> float:
        now = self.clock()
        if ahead == 0:
            self._mark = now  # the queue becomes busy with this request
            return 0.0
        per = self.service if self.service is not None else self.first_guess
        if self._mark is not None:
            per = max(per, now - self._mark)
        return per * ahead
