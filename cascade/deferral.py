"""Items waiting for a thread (audits for the teacher, records for the store): a bounded queue that
drops at random, so that every item taken keeps a known inclusion probability.

An item the taker cannot take yet is deferred, not dropped. Only when ``limit`` items already
wait, or their ``size`` would pass ``max_size``, is one dropped, and then one drawn uniformly among
the waiting ones and the newcomer: never the newcomer by rule (that would drop the items of busy
periods, which are the hard ones). Each such draw among ``n`` waiting and the newcomer spares each
of them with probability ``n / (n + 1)``; past the size budget the draws go on (the newcomer in
each) until what waits fits. An item survived the queue with the product of those probabilities
over the draws it witnessed. That product of conditional probabilities is what ``take`` hands
back: its inverse is an unbiased weight (the product of ``1{spared} / p`` over the draws is a
martingale of mean 1, whatever the sizes that set how many draws there were), which is what makes
the stream taken a design-based sample of what came however the load varied. The one exception is
an item larger than the whole budget: it can never wait, and is dropped without a draw.
"""

from __future__ import annotations

import math
import random
import threading
from collections import deque
from dataclasses import dataclass
from typing import Generic, TypeVar

A = TypeVar("A")


@dataclass(frozen=True)
class Deferred(Generic[A]):
    """An item taken from the queue, with the probability it survived the queue's random drops and
    the size it was put with."""

    item: A
    survival: float
    size: int = 0


class DeferralQueue(Generic[A]):
    """At most ``limit`` items holding at most ``max_size`` (their ``size`` summed), taken oldest
    first; ``put`` past either drops at random. Thread-safe: one side puts, the other takes."""

    def __init__(self, limit: int, rng: random.Random | None = None, max_size: float = math.inf) -> None:
        if limit < 1 or max_size < 0:
            raise ValueError(f"a deferral queue must hold at least 1 item and a size budget >= 0; "
                             f"got {limit!r} and {max_size!r}")
        self.limit, self.max_size = limit, max_size
        self.size = 0  # what the waiting items hold
        self._rng = rng or random.Random()
        # each item with ``_spared`` when it came in, the probability it had survived before, its size
        self._waiting: deque[tuple[A, float, float, int]] = deque()
        self._spared = 0.0  # the sum of log(n / (n + 1)) over the draws so far
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._waiting)

    def put(self, item: A, size: int = 0) -> list[A]:
        """Defer ``item`` (holding ``size``); the items dropped to make room (``item`` itself,
        waiting ones, or none)."""
        with self._lock:
            if size > self.max_size:
                return [item]
            came, dropped = self._spared, list[A]()  # the newcomer is in every draw it makes
            while len(self._waiting) >= self.limit or self.size + size > self.max_size:
                n = len(self._waiting)
                self._spared += math.log(n / (n + 1))
                drop = self._rng.randrange(n + 1)
                if drop == n:
                    return [*dropped, item]
                dropped.append(self._waiting[drop][0])
                self.size -= self._waiting[drop][3]
                del self._waiting[drop]
            self._waiting.append((item, came, 1.0, size))
            self.size += size
            return dropped

    def take(self) -> Deferred[A] | None:
        """The oldest waiting item and its survival probability; None when none waits."""
        with self._lock:
            if not self._waiting:
                return None
            item, came, before, size = self._waiting.popleft()
            self.size -= size
            return Deferred(item, before * math.exp(self._spared - came), size)

    def put_back(self, deferred: Deferred[A]) -> None:
        """Return an item taken but not done (its upstream asked to wait) to the head of the
        queue, past the limits if need be; it keeps the probability it had survived with, and is
        drawn from again like any waiting item."""
        with self._lock:
            self._waiting.appendleft((deferred.item, self._spared, deferred.survival, deferred.size))
            self.size += deferred.size

    def clear(self) -> list[A]:
        """Every waiting item, removed (left undone when the taker stops)."""
        with self._lock:
            left = [item for item, _, _, _ in self._waiting]
            self._waiting.clear()
            self.size = 0
            return left
