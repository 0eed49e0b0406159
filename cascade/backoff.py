"""How long a writer waits before it tries an unavailable store again.

A store that cannot be reached (a database restarting, a lock held past its wait) is tried again
after a pause that doubles from ``FIRST`` up to ``LONGEST``: soon enough that a failover of a few
seconds costs a few seconds, and seldom enough that a store down for an hour costs one failed
connection every few seconds, not a busy loop. What waits meanwhile is held by the writer's
bounded queue (``cascade.deferral``), which drops at random past its bound.
"""

from __future__ import annotations

import time

FIRST = 0.25
LONGEST = 5.0


class Backoff:
    """The pauses between tries at one store, and since when it has been unavailable."""

    def __init__(self, first: float = FIRST, longest: float = LONGEST) -> None:
        self.first, self.longest = first, longest
        self._next = first
        self.since: float | None = None  # monotonic time of the first failure of this outage

    def failed(self) -> float:
        """One more failed try: the seconds to wait before the next."""
        if self.since is None:
            self.since = time.monotonic()
        wait, self._next = self._next, min(self._next * 2, self.longest)
        return wait

    def succeeded(self) -> float | None:
        """The store took a write: the seconds it had been unavailable (None: it never was)."""
        since, self.since, self._next = self.since, None, self.first
        return None if since is None else time.monotonic() - since


def down_for(*backoffs: Backoff | None) -> float:
    """Seconds since the longest of these outages began (0: every store answers): what
    ``/metrics`` states, so that an alert can fire on a store down for a while."""
    since = [b.since for b in backoffs if b is not None and b.since is not None]
    return time.monotonic() - min(since) if since else 0.0
