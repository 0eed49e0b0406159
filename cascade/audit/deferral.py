"""Audits waiting for the teacher: a bounded queue that drops at random, so that every audited
item keeps a known inclusion probability.

An audit the teacher cannot take yet is deferred, not dropped. Only when ``limit`` audits already
wait is one dropped, and then one drawn uniformly among the waiting ones and the newcomer: never
the newcomer by rule (that would drop the audits of busy periods, which are the hard ones). Each
such draw among ``n`` waiting and the newcomer spares a waiting audit with probability
``n / (n + 1)``, so an audit survived the queue with the product of those over the draws it
witnessed. That product of conditional probabilities is what ``take`` hands back: its inverse is an unbiased
weight (the product of ``1{spared} / p`` over the draws is a martingale of mean 1), which is what
makes the audited stream a design-based sample of the traffic however the load varied.
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
    """An audit taken from the queue, with the probability it survived the queue's random drops."""

    audit: A
    survival: float


class DeferralQueue(Generic[A]):
    """At most ``limit`` audits, taken oldest first; ``put`` past the limit drops one at random.
    Thread-safe: the request path puts, the teacher's workers take."""

    def __init__(self, limit: int, rng: random.Random | None = None) -> None:
        if limit < 1:
            raise ValueError(f"the audit queue must hold at least 1 audit; got {limit!r}")
        self.limit = limit
        self._rng = rng or random.Random()
        # each audit with ``_spared`` when it came in, and the probability it had survived before
        self._waiting: deque[tuple[A, float, float]] = deque()
        self._spared = 0.0  # the sum of log(n / (n + 1)) over the draws so far
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._waiting)

    def put(self, audit: A) -> A | None:
        """Defer ``audit``; the audit dropped to make room (``audit`` itself, or a waiting one),
        or None where there was room."""
        with self._lock:
            if len(self._waiting) < self.limit:
                self._waiting.append((audit, self._spared, 1.0))
                return None
            n, came = len(self._waiting), self._spared  # the newcomer is in this draw too
            self._spared += math.log(n / (n + 1))
            drop = self._rng.randrange(n + 1)
            if drop == n:
                return audit
            dropped = self._waiting[drop][0]
            del self._waiting[drop]
            self._waiting.append((audit, came, 1.0))
            return dropped

    def take(self) -> Deferred[A] | None:
        """The oldest waiting audit and its survival probability; None when none waits."""
        with self._lock:
            if not self._waiting:
                return None
            audit, came, before = self._waiting.popleft()
            return Deferred(audit, before * math.exp(self._spared - came))

    def put_back(self, deferred: Deferred[A]) -> None:
        """Return an audit taken but not done (its upstream asked to wait) to the head of the
        queue, past the limit if need be; it keeps the probability it had survived with, and is
        drawn from again like any waiting audit."""
        with self._lock:
            self._waiting.appendleft((deferred.audit, self._spared, deferred.survival))

    def clear(self) -> list[A]:
        """Every waiting audit, removed (left undone when the teacher's worker stops)."""
        with self._lock:
            left = [audit for audit, _, _ in self._waiting]
            self._waiting.clear()
            return left
