"""One label store written by a server's threads: opened at first use, one call at a time.

A server writes its store from several threads (the top tier's worker audits, a collector's
thread keeps escalations, the stream follower reads), and must ride out a PostgreSQL server
restarting: a call that failed with a ``StoreError`` drops the connection, and the next call
reconnects. A SQLite file is made at the first write, so a server that never writes makes none.
Closing never waits long for a call that stalls (a lock another session holds, a server that
stopped answering): the call under way closes the connection as it ends.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from distill.store.core import LabelStore
from distill.store.location import StoreLocation, is_url, store_location
from distill.store.places import exists
from distill.store.records import StoreError, Teacher

CLOSE_WAIT = 5.0
"""Seconds ``close`` waits for a call under way before it leaves the closing to that call."""


class SharedStore:
    """The store at ``path``, bound to ``teacher`` when it opens (another teacher's is refused)."""

    def __init__(self, path: StoreLocation | str, teacher: Teacher) -> None:
        self.path, self.teacher = store_location(path), teacher
        self._store: LabelStore | None = None
        self._lock = threading.Lock()
        self._close_after = False  # a close came while a call held the store

    @contextlib.contextmanager
    def use(self) -> Iterator[LabelStore]:
        """The open store, for one call; a ``StoreError`` inside drops the connection."""
        with self._lock:
            if self._store is None:
                self._store = LabelStore(self.path, self.teacher, any_thread=True)
            try:
                yield self._store
            except StoreError:
                self._drop()
                raise
            finally:
                if self._close_after:
                    self._close_after = False
                    self._drop()

    def _drop(self) -> None:
        """Let go of the connection (one already gone included)."""
        if self._store is not None:
            with contextlib.suppress(Exception):
                self._store.close()
        self._store = None

    def made(self) -> bool:
        """Whether there is a store to read yet (a database URL always is)."""
        return self._store is not None or is_url(self.path) or exists(self.path)

    def close(self, wait: float = CLOSE_WAIT) -> None:
        """Close the connection; where a call holds it past ``wait`` seconds, that call closes it
        as it ends."""
        if not self._lock.acquire(timeout=wait):
            self._close_after = True
            return
        try:
            if self._store is not None:
                self._store.close()
                self._store = None
        finally:
            self._lock.release()
