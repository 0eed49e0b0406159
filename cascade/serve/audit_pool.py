"""Audits against an upstream teacher: on the upstream's capacity, never behind local requests.

An upstream's audit costs this machine a thread waiting on a socket, so audits do not wait for
the live queue to be empty (as a local GGUF's must, on its one model): ``in_flight`` threads take
them from the deferral queue (``cascade.deferral``) as fast as the upstream answers. The
only brake is the upstream's own: an audit it answers 429 or 503 (after the client's retries) is
put back at the head of the queue, and every audit thread pauses for its Retry-After (1 s where it
gave none) before taking the next one.

The engine runs one more pool, of one thread, as the store's writer: it takes the audits whose
answers are in hand and writes them, so that no worker waits for the store; a store that cannot
be reached pauses it the same way (``cascade.backoff``'s pauses), with the audit put back; stopping,
it is given a few seconds to write what waits (``stop``'s ``drain``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

from cascade.deferral import DeferralQueue, Deferred

log = logging.getLogger("cascade.serve")
A = TypeVar("A")
Busy = Callable[[Deferred[A]], "float | None"]
"""Runs one audit; the seconds the upstream asked to wait (429/503), or None when it is done."""


class AuditPool(Generic[A]):
    """``in_flight`` threads running ``run`` on the audits of ``deferred``, paused while the
    upstream asks to wait (each pause said with ``why``; None: ``run`` says it)."""

    def __init__(self, name: str, deferred: DeferralQueue[A], run: Busy[A], in_flight: int,
                 why: str | None = "the upstream asked to wait (429/503)") -> None:
        if in_flight < 1:
            raise ValueError(f"audits in flight must be at least 1; got {in_flight!r}")
        self.deferred, self.run, self.why = deferred, run, why
        self._resume_at = 0.0
        self._stopping = False
        self._drain_until = 0.0
        self._ready = threading.Condition()
        self._threads = [threading.Thread(target=self._loop, name=f"cascade-{name}-audit-{n}", daemon=True)
                         for n in range(in_flight)]
        for thread in self._threads:
            thread.start()

    def wake(self) -> None:
        """An audit was deferred: one thread takes it (unless paused)."""
        with self._ready:
            self._ready.notify()

    def _next(self) -> Deferred[A] | None:
        """The next audit to run, waiting out a pause; None once stopping (with a drain: once none
        waits or the drain is spent)."""
        with self._ready:
            while True:
                if self._stopping and (not len(self.deferred) or time.monotonic() >= self._drain_until):
                    return None
                paused = self._resume_at - time.monotonic()
                if paused > 0:
                    self._ready.wait(paused)
                    continue
                deferred = self.deferred.take()
                if deferred is not None:
                    return deferred
                self._ready.wait()

    def _loop(self) -> None:
        while (deferred := self._next()) is not None:
            wait = self.run(deferred)
            if wait is not None:
                self._pause(deferred, wait)

    def _pause(self, deferred: Deferred[A], wait: float) -> None:
        """Put the audit back and hold every audit thread for ``wait`` seconds."""
        self.deferred.put_back(deferred)
        with self._ready:
            resume = time.monotonic() + wait
            if resume > self._resume_at:
                if self._resume_at <= time.monotonic() and self.why is not None:
                    log.warning("audits paused for %g s: %s; the audits waiting are kept, and resume "
                                "after", wait, self.why)
                self._resume_at = resume
            self._ready.notify_all()

    def stop(self, drain: float = 0.0) -> None:
        """Let each thread finish its audit, and take those still waiting for up to ``drain``
        seconds, then end; the audits still waiting are left. With ``drain``, waits at most that
        long (a thread held past it by a stalled call ends when the call does)."""
        ends = time.monotonic() + drain
        with self._ready:
            self._stopping, self._drain_until = True, ends
            self._ready.notify_all()
        for thread in self._threads:
            thread.join(max(ends - time.monotonic(), 0.0) if drain else None)
