"""Which requests are collected, and the thread that writes them.

The same machinery keeps a pass-through's forwarded requests (``CollectedItem``) and a cascade's
escalations (``EscalationRecord``): a ``Collector`` is generic in what its sink takes.

A request is collected when a hash of (seed, its number among the requests answered) falls below
``share`` (the choice never depends on what the client sent), until the sink holds ``max_items``.
The request path only hands over what it already has (the body and the upstream's answer) and
returns: parsing, checking and writing happen on the collector's own thread, through a bounded
queue. A full queue drops the item and counts it; a store that refuses an item (another teacher
answered: the upstream's model changed) stops the collection with one alarm line, since every
later item would be refused alike. The answer to the client never waits for, or fails with, any
of it.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import queue
import threading
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

from cascade.errors import CascadeError

log = logging.getLogger("cascade.collect")
_SCALE = float(1 << 64)
QUEUE_SIZE = 1024
"""Items waiting for the writer at most: past it an item is dropped (and counted), never waited for."""


class Requested(Protocol):
    """What the collector says of an item it could not store: the request it came from."""

    @property
    def request_id(self) -> str: ...


T = TypeVar("T", bound=Requested)
T_in = TypeVar("T_in", contravariant=True)


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
    makes the item from what the request had; None where there is nothing to collect (a body
    that is not a System One request, an answer of the wrong shape). ``what``: what is collected,
    as its log lines and the store's refusal name it."""

    def __init__(self, sink: Sink[T], share: float = 1.0, max_items: int | None = None,
                 seed: str = "collect", what: str = "collect") -> None:
        if not 0 <= share <= 1 or (max_items is not None and max_items < 0):
            raise ValueError(f"{what} needs a share in [0, 1] and a size >= 0; got {share!r}, {max_items!r}")
        self.sink, self.share, self.max_items, self.seed, self.what = sink, share, max_items, seed, what
        self.held = sink.count()
        self.counts = {"collected": 0, "not_chosen": 0, "full": 0, "dropped": 0, "unreadable": 0,
                       "failed": 0}
        self.stopped: str | None = None
        self._numbers = itertools.count()
        self._queue: queue.Queue[Callable[[], T | None] | None] = queue.Queue(QUEUE_SIZE)
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._write, name=f"cascade-{what}", daemon=True)
        self._thread.start()

    def offer(self, build: Callable[[], T | None]) -> None:
        """Collect this request if it is chosen and there is room; never blocks."""
        chosen = self._chosen(str(next(self._numbers)))
        with self._lock:
            reason = ("not_chosen" if not chosen else "full" if self._full() else
                      "failed" if self.stopped else None)
            if reason is None:
                self.held += 1  # counted when queued, so the limit holds with items in flight
        if reason is not None:
            self._count(reason)
            return
        try:
            self._queue.put_nowait(build)
        except queue.Full:
            self._undo("dropped")

    def close(self) -> None:
        """Write what is queued, then stop the thread."""
        self._queue.put(None)
        self._thread.join()

    def _chosen(self, key: str) -> bool:
        if self.share >= 1:
            return True
        digest = hashlib.sha256(f"{self.seed}\x1e{key}".encode()).digest()
        return int.from_bytes(digest[:8], "big") / _SCALE < self.share

    def _full(self) -> bool:
        return self.max_items is not None and self.held >= self.max_items

    def _write(self) -> None:
        while (build := self._queue.get()) is not None:
            if self.stopped:
                self._undo("failed")
                continue
            try:
                item = build()
            except Exception as exc:  # a body or answer that is not readable: not collected
                log.info("%s: request not collected (%s: %s)", self.what, type(exc).__name__, exc)
                item = None
            if item is None:
                self._undo("unreadable")
                continue
            self._store(item)

    def _store(self, item: T) -> None:
        try:
            self.sink.append(item)
        except CascadeError as exc:
            self.stopped = str(exc)
            log.error("ALARM %s stopped: %s; the server goes on answering, and collects nothing "
                      "more until it is restarted with a store of this teacher", self.what, exc)
            self._undo("failed")
            return
        except Exception as exc:  # a store that is down for a while: this item is lost, said once
            log.warning("%s: item of request %s not stored (%s: %s)", self.what, item.request_id,
                        type(exc).__name__, exc)
            self._undo("failed")
            return
        self._count("collected")

    def _undo(self, reason: str) -> None:
        with self._lock:
            self.held -= 1
            self.counts[reason] += 1

    def _count(self, reason: str) -> None:
        with self._lock:
            self.counts[reason] += 1
