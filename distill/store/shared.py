"""One label store written by a server's threads: opened at first use, one call at a time.

A server writes its store from several threads (the top tier's worker audits, a collector's
thread keeps escalations, the stream follower reads), and must ride out a PostgreSQL server
restarting: a call that failed with a ``StoreError`` drops the connection, and the next call
reconnects. A SQLite file is made at the first write, so a server that never writes makes none.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from distill.store.core import LabelStore
from distill.store.location import StoreLocation, is_url, store_location
from distill.store.places import exists
from distill.store.records import StoreError, Teacher


class SharedStore:
    """The store at ``path``, bound to ``teacher`` when it opens (another teacher's is refused)."""

    def __init__(self, path: StoreLocation | str, teacher: Teacher) -> None:
        self.path, self.teacher = store_location(path), teacher
        self._store: LabelStore | None = None
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def use(self) -> Iterator[LabelStore]:
        """The open store, for one call; a ``StoreError`` inside drops the connection."""
        with self._lock:
            if self._store is None:
                self._store = LabelStore(self.path, self.teacher, any_thread=True)
            try:
                yield self._store
            except StoreError:
                with contextlib.suppress(Exception):  # the connection is already gone
                    self._store.close()
                self._store = None
                raise

    def made(self) -> bool:
        """Whether there is a store to read yet (a database URL always is)."""
        return self._store is not None or is_url(self.path) or exists(self.path)

    def close(self) -> None:
        with self._lock:
            if self._store is not None:
                self._store.close()
                self._store = None
