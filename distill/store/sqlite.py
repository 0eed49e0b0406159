"""The embedded backend: one SQLite file (WAL), for one machine's writers.

``synchronous=FULL``: WAL with NORMAL already survives a killed process, but may drop the last
commits on power loss; FULL makes every commit durable for one fsync, which is nothing next to
the teacher's cost per item, and imports amortise it over a batch. Writers on this machine line
up on ``BEGIN IMMEDIATE``; a claim's owner is its host and process, so a claim of a process that
died is taken over at once.

A store holds customer text: a new file is created 0600 (its owner alone reads it) before SQLite
opens it, and SQLite gives its ``-wal``, ``-shm`` and ``-journal`` files the database file's mode.
"""

from __future__ import annotations

import os
import socket
import sqlite3
import uuid
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from cascade.private import private_file
from distill.store.backend import Backend, foreign_tables
from distill.store.records import SCHEMA_VERSION, StoreError, StoreUnavailableError

BUSY_WAIT = 30.0
"""Seconds a write waits for another writer's lock before the store counts as unavailable."""
_TABLES = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT);
CREATE TABLE IF NOT EXISTS labels (
    item_id TEXT NOT NULL,
    question_id TEXT NOT NULL,
    probabilities TEXT NOT NULL,
    prompt_hash TEXT,
    created_at REAL NOT NULL,
    letter_mass REAL,
    PRIMARY KEY (item_id, question_id)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS audits (
    item_id TEXT PRIMARY KEY,
    state TEXT NOT NULL,
    calibration_version TEXT NOT NULL,
    system TEXT NOT NULL,
    created_at REAL NOT NULL,
    seq INTEGER
);
CREATE UNIQUE INDEX IF NOT EXISTS audits_seq ON audits (seq);
CREATE TABLE IF NOT EXISTS claims (item_id TEXT PRIMARY KEY, owner TEXT NOT NULL, expires REAL NOT NULL)
"""


class SqliteBackend(Backend):
    """A store in the SQLite file at ``path``."""

    now = "((julianday('now') - 2440587.5) * 86400.0)"

    def __init__(self, path: Path, read_only: bool, any_thread: bool) -> None:
        self.location, self.read_only = Path(path), read_only
        if self.location.is_dir():  # said "no label store ... label a corpus first", or sqlite's words
            raise StoreError(f"{path} is a folder, not a label store file: give --store the store's path")
        if read_only and not self.location.is_file():
            raise StoreError(f"no label store at {path}: check --store, or label a corpus first")
        uri = f"{self.location.resolve().as_uri()}?mode={'ro' if read_only else 'rwc'}"
        try:
            if not read_only:
                private_file(self.location)
            self._conn = sqlite3.connect(uri, uri=True, isolation_level=None, timeout=BUSY_WAIT,
                                         check_same_thread=not any_thread)
        except (sqlite3.Error, OSError) as exc:
            raise StoreError(f"cannot open label store {path}: {exc}") from exc
        self._owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        if not read_only:
            with self.opening():
                self._conn.execute("PRAGMA journal_mode=WAL")
                self._conn.execute("PRAGMA synchronous=FULL")

    def execute(self, sql: str, params: Sequence[Any] = ()) -> Any:
        return self._conn.execute(sql, params)

    def executemany(self, sql: str, rows: Iterable[Sequence[Any]]) -> None:
        self._conn.executemany(sql, rows)

    @contextmanager
    def transaction(self, durable: bool = True) -> Iterator[None]:
        """BEGIN IMMEDIATE ... COMMIT (the connection autocommits otherwise); a claim commits
        without its own fsync (synchronous=NORMAL for it), the next label's commit syncs both."""
        if not durable:
            self._conn.execute("PRAGMA synchronous=NORMAL")
        try:
            self._begin()
            try:
                yield
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
            self._conn.execute("COMMIT")
        finally:
            if not durable:
                self._conn.execute("PRAGMA synchronous=FULL")

    def _begin(self) -> None:
        """Take the write lock; another writer holding it past the 30 s wait leaves the store
        unavailable for now, not broken (the writer retries)."""
        try:
            self._conn.execute("BEGIN IMMEDIATE")
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) and "busy" not in str(exc):
                raise
            raise StoreUnavailableError(f"the label store {self.location} stayed locked by another writer "
                                        f"for {BUSY_WAIT:g} s ({exc})") from None

    def serialise(self) -> None:
        """Nothing to do: BEGIN IMMEDIATE already admits one writer at a time."""

    def tables(self) -> set[str]:
        return {r[0] for r in self._conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}

    def columns(self, table: str) -> set[str]:
        return {row[1] for row in self._conn.execute(f"PRAGMA table_info({table})")}

    def create_tables(self) -> None:
        tables = self.tables()
        if tables and "meta" not in tables:
            raise foreign_tables(self.location, tables)
        if "meta" in tables:
            row = self._conn.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
            if row is not None and row[0] in ("1", "2"):
                self._upgrade(tables)
        for statement in _TABLES.split(";"):
            self._conn.execute(statement)

    def _upgrade(self, tables: set[str]) -> None:
        """A schema-1 or -2 store made current: the letter mass column (unknown for its labels),
        and its audits numbered in the order they were written."""
        if "letter_mass" not in self.columns("labels"):
            self._conn.execute("ALTER TABLE labels ADD COLUMN letter_mass REAL")
        if "audits" in tables and "seq" not in self.columns("audits"):
            self._conn.execute("ALTER TABLE audits ADD COLUMN seq INTEGER")
            ids = self._conn.execute("SELECT item_id FROM audits ORDER BY created_at, item_id").fetchall()
            self._conn.executemany("UPDATE audits SET seq=? WHERE item_id=?",
                                   [(n, item) for n, (item,) in enumerate(ids, 1)])
        self._conn.execute("UPDATE meta SET value=? WHERE key='schema_version'", (str(SCHEMA_VERSION),))

    def owner(self) -> str:
        return self._owner

    def alive(self, owner: str) -> bool:
        host, pid, _ = owner.rsplit(":", 2)
        if host != socket.gethostname() or not pid.isdigit():
            return True  # another machine's process: its lease decides
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

    @contextmanager
    def opening(self) -> Iterator[None]:
        """Close the connection if opening fails, naming the file when it is not a store."""
        try:
            yield
        except sqlite3.OperationalError as exc:
            self._conn.close()
            if "unable to open" not in str(exc) and "readonly" not in str(exc):
                raise StoreError(f"{self.location} is not a label store ({exc}); check --store") from exc
            raise StoreError(f"cannot open the label store {self.location} ({exc}): SQLite must write "
                             "beside it (its -wal and -shm files) even to read, so its folder must be "
                             "writable by this user; a read-only mount or folder will not do") from exc
        except sqlite3.DatabaseError as exc:
            self._conn.close()
            raise StoreError(f"{self.location} is not a label store ({exc}); check --store") from exc
        except BaseException:
            self._conn.close()
            raise

    def close(self) -> None:
        self._conn.close()
