"""One drift watch over every replica's audits: the audits as one stream, in the store's order.

Replicas behind a load balancer each audit a share of their own traffic. Were each to watch only
its own audits, an alarm would need as many times more routed items to rise as there are
replicas, a demotion would hold on one replica while the others kept serving, and k alarms at
level delta could together raise a false alarm up to k x delta of the time. Instead every replica
appends its audits to one stream whose order the store sets (the order it committed them), and
every replica's ``DriftWatch`` counts the whole stream in that order. The alarm is then a function
of the stream's prefix: every replica computes the same one, its guarantee is the one alarm's
(false with probability at most delta, however many processes read it), a restart replays the
same state, and a question the stream's n-th record demoted is demoted on a replica as soon as it
has read n records: within one poll interval and one read of the store (``StreamFollower.follow``).

``cascade`` never writes a store itself: ``distill.loop.auditing.StoreSink`` is the stream the commands
pass (a label store, SQLite or PostgreSQL).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Protocol

from cascade.audit.record import AuditRecord
from cascade.audit.watch import DriftWatch

log = logging.getLogger("cascade.audit")
CLOSE_WAIT = 5.0
"""Seconds ``StreamFollower.close`` waits for a read under way before it leaves the read to end on
its own: a store that stalls never holds up a swap's retirement or a server's shutdown."""


class AuditStream(Protocol):
    """Where every writer's audits land, in one order the store gives them."""

    def append(self, record: AuditRecord) -> None:
        """Store ``record``; it takes the next place in the stream when its transaction commits."""

    def read_after(self, position: int) -> list[tuple[int, AuditRecord]]:
        """The next records past ``position`` (a page, in order, each with its position; empty
        at the end of the stream)."""


class StreamFollower:
    """Feeds a watch every record of a stream, in the stream's order, each once; ``on_raised``
    hears each question whose alarm a record raised. ``caught_up_at``: the ``time.time()`` of the
    last read that reached the end of the stream (what the demotion bound is counted from)."""

    def __init__(self, watch: DriftWatch, stream: AuditStream, on_raised: Callable[[str], None]) -> None:
        self.watch, self.stream, self.on_raised = watch, stream, on_raised
        self.position = 0
        self.caught_up_at: float | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def catch_up(self) -> int:
        """Read and count every record past the position; the number read."""
        read = 0
        with self._lock:
            while page := self.stream.read_after(self.position):
                for position, record in page:
                    for qid in self.watch.observe(record):
                        self.on_raised(qid)
                    self.position = position
                read += len(page)
            self.caught_up_at = time.time()
        return read

    def follow(self, every: float) -> None:
        """Catch up every ``every`` seconds in a thread until ``close``: the bound on how long a
        demotion raised elsewhere takes to hold here is ``every`` plus one read. A failed read is
        logged and retried at the next tick (the watch keeps its state meanwhile)."""
        if every <= 0:
            raise ValueError(f"the audit stream's poll interval must be > 0 seconds; got {every!r}")
        if self._thread is not None:
            return

        def run() -> None:
            failing = False
            while not self._stop.wait(every):
                try:
                    self.catch_up()
                    if failing:
                        log.warning("audit stream: reading again from position %d", self.position)
                    failing = False
                except Exception as exc:  # a store that is down for a while: retried, said once
                    if not failing:
                        log.warning("audit stream: cannot read the store (%s: %s); the drift watch keeps "
                                    "its state and retries every %g s", type(exc).__name__, exc, every)
                    failing = True

        self._thread = threading.Thread(target=run, name="cascade-audit-stream", daemon=True)
        self._thread.start()

    def close(self, wait: float = CLOSE_WAIT) -> None:
        """Stop following: the thread ends at once, or after the read under way, waited for at
        most ``wait`` seconds (past it, the thread ends when its read does, and is said)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(wait)
            if self._thread.is_alive():
                log.warning("audit stream: a read of the store is still under way after %g s; the watch "
                            "stops without it (the read ends on its own)", wait)
            self._thread = None
