"""Where a store lives, picked by its location: a path opens the SQLite backend, a URL the
PostgreSQL one (imported only then: psycopg is an optional extra). Also whether a store is there,
and deleting one (a first import that failed)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from distill.store.backend import STORE_TABLES, Backend
from distill.store.location import StoreLocation, StoreURL


def connect(location: StoreLocation, read_only: bool = False, any_thread: bool = False) -> Backend:
    """A connection to the store at ``location``; ``any_thread`` (SQLite): usable from another
    thread than the one that opened it, for a caller that serialises its use."""
    if isinstance(location, StoreURL):
        from distill.store.postgres import PostgresBackend

        return PostgresBackend(location, read_only)
    from distill.store.sqlite import SqliteBackend

    return SqliteBackend(location, read_only, any_thread)


def exists(location: StoreLocation) -> bool:
    """Whether a store (or anything) is there already: a file, or a database holding a store."""
    if not isinstance(location, StoreURL):
        return location.exists()
    with _closing(connect(location)) as db:
        return "meta" in db.tables()


def drop(location: StoreLocation) -> None:
    """Delete the store at ``location``: its files, or its tables."""
    if not isinstance(location, StoreURL):
        for leftover in (location, *(location.with_name(location.name + end) for end in ("-wal", "-shm"))):
            leftover.unlink(missing_ok=True)
        return
    with _closing(connect(location)) as db, db.transaction():
        db.serialise()
        db.execute("DROP TABLE IF EXISTS " + ", ".join((*STORE_TABLES, "traffic", "escalations")))


@contextmanager
def _closing(db: Backend) -> Iterator[Backend]:
    try:
        yield db
    finally:
        db.close()
