"""A tier's worker thread: the live jobs it takes at once, and deferred audits only when no live
job waits.

Each worker owns its tier's model, so no llama.cpp context is ever used by two threads. The
engine (``cascade.serve.engine``) gives it ``serve`` for a batch of live jobs and, on the top tier
of a local teacher, ``audit`` for one deferred audit; an upstream teacher's worker is a pool
instead (``cascade.serve.forward.PoolWorker``).
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

from cascade.deferral import DeferralQueue, Deferred

J = TypeVar("J")
A = TypeVar("A")
_LIVE, _STOP, _AUDIT = 0, 1, 2  # a worker takes live jobs first, audits only when none waits


class TierWorker(Generic[J, A]):
    """A thread serving one tier's queue: ``serve`` gets the live jobs it takes at once (at most
    ``batch``), ``audit`` one audit of ``deferred`` at a time, taken only when no live job waits
    (an ``_AUDIT`` entry says one was deferred). ``depth`` counts live jobs queued and not yet
    taken."""

    def __init__(self, name: str, serve: Callable[[list[J]], None], batch: int,
                 deferred: DeferralQueue[A] | None = None,
                 audit: Callable[[Deferred[A]], object] | None = None) -> None:
        self.queue: queue.PriorityQueue[tuple[int, int, J | None]] = queue.PriorityQueue()
        self.serve, self.batch = serve, batch
        self.deferred, self.audit = deferred, audit
        self.depth = 0
        self.lock = threading.Lock()
        self._order = itertools.count()
        self.thread = threading.Thread(target=self._loop, name=f"cascade-{name}", daemon=True)
        self.thread.start()

    def put(self, job: J) -> None:
        with self.lock:
            self.depth += 1
        self.queue.put((_LIVE, next(self._order), job))

    def audit_deferred(self) -> None:
        """An audit was deferred: taken when no live job waits."""
        self.queue.put((_AUDIT, next(self._order), None))

    def _loop(self) -> None:
        while True:
            kind, _, first = self.queue.get()
            if kind == _STOP:
                return
            if kind == _AUDIT:  # the audit it stood for may have been dropped since: then none
                deferred = self.deferred.take() if self.deferred is not None else None
                if deferred is not None and self.audit is not None:
                    self.audit(deferred)
                continue
            jobs = [first] if first is not None else []
            while len(jobs) < self.batch:
                try:
                    entry = self.queue.get_nowait()
                except queue.Empty:
                    break
                if entry[0] != _LIVE or entry[2] is None:
                    self.queue.put(entry)
                    break
                jobs.append(entry[2])
            with self.lock:
                self.depth -= len(jobs)
            self.serve(jobs)

    def stop(self) -> None:
        """Stop after the live jobs queued; audits still waiting are left (the engine counts them)."""
        self.queue.put((_STOP, next(self._order), None))
        self.thread.join()
