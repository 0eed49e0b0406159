"""Which requests are collected, and the thread that writes them.

The same machinery keeps a pass-through's forwarded requests (``CollectedItem``) and a cascade's
escalations (``EscalationRecord``): a ``Collector`` is generic in what its sink takes.

A request is collected when a hash of (seed, its number among the requests answered) falls below
``share`` (the choice never depends on what the client sent), until the sink holds ``max_items``.
The request path only hands over what it already has (the body and the upstream's answer) and
returns: parsing, checking and writing happen on the collector's own thread, through a queue
bounded twice: at most ``QUEUE_SIZE`` items, and at most ``QUEUE_BYTES`` bytes of what they hold
(the bodies and answers they will be built from, which a caller states as ``size``), so that a
slow store under large requests cannot fill the memory. Past either bound one item, drawn at
random among those waiting and the newcomer, is dropped (``cascade.deferral``), never the
newcomer by rule: the items a slow store loses are then a random draw, and each item kept carries
its inclusion probability (``share`` times its survival of the queue), which ``build`` is given
to record with it. Collected traffic and census escalations certify as uniform draws, and a queue
that dropped the newcomer would have lost the busy periods' items, the hard ones. A drop is counted
as ``dropped`` and said in one log line until the queue takes items again. A store that cannot be
reached now (``StoreUnavailable``: a database restarting) is waited out, the item written again
after each of ``cascade.backoff``'s pauses while the queue holds what comes meanwhile; a store that
refuses an item (another teacher answered: the upstream's model changed) stops the collection with
one alarm line, since every later item would be refused alike. The answer to the client never waits for, or
fails with, any of it.
"""

from __future__ import annotations

import itertools
import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

from cascade.backoff import Backoff
from cascade.deferral import DeferralQueue, Deferred
from cascade.errors import CascadeError, StoreUnavailable
from cascade.hashing import seeded_unit

log = logging.getLogger("cascade.collect")
QUEUE_SIZE = 1024
"""Items waiting for the writer at most: past it one is dropped at random (and counted), never waited for."""
QUEUE_BYTES = 64 * 1024 * 1024
"""Bytes the items waiting for the writer hold at most (their ``size``): past it, dropped alike."""
DRAIN = 5.0
"""Seconds a stopping collector gives its writer for what is queued, as the audits' (``WRITE_DRAIN``)."""


class Requested(Protocol):
    """What the collector says of an item it could not store: the request it came from."""

    @property
    def request_id(self) -> str: ...


T = TypeVar("T", bound=Requested)
T_in = TypeVar("T_in", contravariant=True)
Build = Callable[[float], T | None]
"""Makes the item from what its request had, given its inclusion probability; None where there is
nothing to collect."""


class Sink(Protocol[T_in]):
    """Where collected items go, in the order they are appended (a label store's ``traffic`` or
    ``escalations``)."""

    def append(self, item: T_in) -> None:
        """Store ``item``; raise (a ``CascadeError``) where it cannot be stored, e.g. when its
        teacher is not the one the store holds."""

    def count(self) -> int:
        """Items the sink holds already (a restarted server keeps counting toward its limit)."""


class Collector(Generic[T]):
    """Keeps a seeded ``share`` of the requests offered, up to ``max_items`` in ``sink`` (None: no
    limit). ``counts`` says what became of every offered request. ``build`` given to ``offer``
    makes the item from what the request had and its inclusion probability; None where there is
    nothing to collect (a body that is not a System One request, an answer of the wrong shape).
    ``what``: what is collected, as its log lines and the store's refusal name it.
    ``max_queue_bytes``: the queue's byte budget."""

    def __init__(self, sink: Sink[T], share: float = 1.0, max_items: int | None = None,
                 seed: str = "collect", what: str = "collect", max_queue_bytes: int = QUEUE_BYTES) -> None:
        if not 0 <= share <= 1 or (max_items is not None and max_items < 0) or max_queue_bytes < 0:
            raise ValueError(f"{what} needs a share in [0, 1], a size >= 0 and a queue budget >= 0 bytes; "
                             f"got {share!r}, {max_items!r}, {max_queue_bytes!r}")
        self.sink, self.share, self.max_items, self.seed, self.what = sink, share, max_items, seed, what
        self.max_queue_bytes = max_queue_bytes
        self.held = sink.count()
        self.counts = {"collected": 0, "not_chosen": 0, "full": 0, "dropped": 0, "unreadable": 0,
                       "failed": 0}
        self.stopped: str | None = None
        self._numbers = itertools.count()
        self._queue: DeferralQueue[Build[T]] = DeferralQueue(QUEUE_SIZE, max_size=max_queue_bytes)
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)
        self._closing = False
        self._drain_until = 0.0
        self.backoff = Backoff()  # the store's outage, while one lasts
        self._dropping = False  # said once per run of drops
        self._thread = threading.Thread(target=self._write, name=f"cascade-{what}", daemon=True)
        self._thread.start()

    @property
    def queued_bytes(self) -> int:
        """What the items waiting for the writer hold."""
        return self._queue.size

    def offer(self, build: Build[T], size: int = 0) -> None:
        """Collect this request if it is chosen and there is room; never blocks. ``size``: the
        bytes ``build`` holds until it runs (the request's body and answer), counted against the
        queue's byte budget."""
        chosen = self._chosen(str(next(self._numbers)))
        with self._lock:
            reason = ("not_chosen" if not chosen else "full" if self._full() else
                      "failed" if self.stopped else None)
            if reason is None:
                self.held += 1  # counted when queued, so the limit holds with items in flight
                dropped = self._queue.put(build, size)
                for _ in dropped:
                    self.held -= 1
                    self.counts["dropped"] += 1
                said, self._dropping = self._dropping, bool(dropped)
                self._ready.notify()
        if reason is not None:
            self._count(reason)
        elif dropped and not said:
            log.warning("%s: the writer's queue is full (%d items, %d bytes of a %d-byte budget, the "
                        "item %d bytes): items drawn at random are dropped to make room, counted as "
                        "dropped in /metrics, until the store keeps up again",
                        self.what, len(self._queue), self._queue.size, self.max_queue_bytes, size)

    def close(self, drain: float = DRAIN) -> None:
        """Write what is queued for up to ``drain`` seconds, then stop: a store that stalls (a
        SQLite lock another writer holds, a PostgreSQL server that stopped answering) never holds
        up a server's shutdown. What is left is counted as dropped, and said in one line."""
        with self._ready:
            self._closing, self._drain_until = True, time.monotonic() + drain
            self._ready.notify_all()
        self._thread.join(drain)
        with self._ready:  # a write waiting out an outage gives up now
            self._ready.notify_all()
        left = len(self._queue.clear())
        if left:
            with self._lock:
                self.held -= left
                self.counts["dropped"] += left
            log.warning("%s: %d items left unwritten: the store took none of them within %g s of "
                        "stopping", self.what, left, drain)

    def _chosen(self, key: str) -> bool:
        if self.share >= 1:
            return True
        return seeded_unit(self.seed, key) < self.share

    def _full(self) -> bool:
        return self.max_items is not None and self.held >= self.max_items

    def _next(self) -> Deferred[Build[T]] | None:
        """The next item to write, waiting for one; None once closing and none waits."""
        with self._ready:
            while (queued := self._queue.take()) is None:
                if self._closing:
                    return None
                self._ready.wait()
            return queued

    def _write(self) -> None:
        while (queued := self._next()) is not None:
            self._take(queued.item, self.share * queued.survival)

    def _take(self, build: Build[T], inclusion: float) -> None:
        if self.stopped:
            self._undo("failed")
            return
        try:
            item = build(inclusion)
        except Exception as exc:  # a body or answer that is not readable: not collected
            log.info("%s: request not collected (%s: %s)", self.what, type(exc).__name__, exc)
            item = None
        if item is None:
            self._undo("unreadable")
            return
        self._store(item)

    def _store(self, item: T) -> None:
        try:
            self._append(item)
        except StoreUnavailable:  # still unavailable as the collector stopped: dropped, as what waits
            self._undo("dropped")
            return
        except CascadeError as exc:
            self.stopped = str(exc)
            log.error("ALARM %s stopped: %s; the server goes on answering, and collects nothing "
                      "more until it is restarted with a store of this teacher", self.what, exc)
            self._undo("failed")
            return
        except Exception as exc:  # an item the store cannot take (not an outage): lost, said
            log.warning("%s: item of request %s not stored (%s: %s)", self.what, item.request_id,
                        type(exc).__name__, exc)
            self._undo("failed")
            return
        self._count("collected")

    def _append(self, item: T) -> None:
        """Write ``item``, waiting out a store that is unavailable (``StoreUnavailable``: the write
        is tried again, whole, until it is taken or the collector stops past its drain), so that an
        outage loses nothing while the queue holds what comes meanwhile."""
        while True:
            try:
                self.sink.append(item)
            except StoreUnavailable as exc:
                if self._give_up():
                    raise
                first = self.backoff.since is None
                wait = self.backoff.failed()
                if first:
                    log.warning("%s: the store is unavailable (%s); the items wait and are written when "
                                "it answers again, tried every %g s at most", self.what, exc,
                                self.backoff.longest)
                with self._ready:
                    self._ready.wait_for(self._give_up, wait)
                continue
            down = self.backoff.succeeded()
            if down is not None:
                log.warning("%s: the store answers again after %.1f s; %d items wait", self.what, down,
                            len(self._queue))
            return

    def _give_up(self) -> bool:
        """Whether a write to an unavailable store stops being retried: the collector is stopping and
        its drain is spent."""
        return self._closing and time.monotonic() >= self._drain_until

    def _undo(self, reason: str) -> None:
        with self._lock:
            self.held -= 1
            self.counts[reason] += 1

    def _count(self, reason: str) -> None:
        with self._lock:
            self.counts[reason] += 1


def size_of(value: object) -> int:
    """Bytes a request's part holds, for ``Collector.offer``'s ``size``: a body's length, a text's
    UTF-8 length, a JSON value's serialised length."""
    if isinstance(value, bytes | bytearray):
        return len(value)
    if isinstance(value, str):
        return len(value.encode("utf-8", "surrogatepass"))
    return len(json.dumps(value, ensure_ascii=False, default=str).encode("utf-8", "surrogatepass"))
