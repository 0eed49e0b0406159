"""The shared backend: a store in a PostgreSQL database, through psycopg 3 (the postgres extra),
for writers on many machines (serve replicas, Ray actors, several labelling runs).

Writers that must be put in one line (the store's first creation, audits, whose order every
replica's drift watch reads) take one transaction-scoped advisory lock. A claim's owner is the
server's process for this connection, so a claim of a writer whose connection ended (killed, say)
is taken over at once: the server knows which sessions are alive. The URL's password never
leaves ``StoreURL``: every message here names the store as it prints, without it.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from distill.store.backend import STORE_TABLES, Backend, foreign_tables
from distill.store.location import StoreURL
from distill.store.records import StoreError, StoreUnavailableError

EXTRA = "pip install -e '.[postgres]'"
CONNECT_TIMEOUT_S = 10
TCP_DEFAULTS = {"connect_timeout": CONNECT_TIMEOUT_S, "keepalives": 1, "keepalives_idle": 10,
                "keepalives_interval": 5, "keepalives_count": 3, "tcp_user_timeout": 30_000}
"""libpq's settings where the URL gives none: a server that went away mid-query (its host down,
the network cut) ends the query within about 30 s (``tcp_user_timeout``, unacknowledged data;
keepalives for an idle connection) instead of holding the command forever. A server whose
process is frozen while its host's kernel still acknowledges is not detected this way."""
LOCK_KEY = 0x63617363616465  # "cascade": one advisory lock per database, for the store's writers
_TABLES = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT);
CREATE TABLE IF NOT EXISTS labels (
    item_id TEXT NOT NULL,
    question_id TEXT NOT NULL,
    probabilities TEXT NOT NULL,
    prompt_hash TEXT,
    created_at DOUBLE PRECISION NOT NULL,
    letter_mass DOUBLE PRECISION,
    PRIMARY KEY (item_id, question_id)
);
CREATE TABLE IF NOT EXISTS audits (
    item_id TEXT PRIMARY KEY,
    state TEXT NOT NULL,
    calibration_version TEXT NOT NULL,
    system TEXT NOT NULL,
    created_at DOUBLE PRECISION NOT NULL,
    seq BIGINT
);
CREATE UNIQUE INDEX IF NOT EXISTS audits_seq ON audits (seq);
CREATE TABLE IF NOT EXISTS claims (item_id TEXT PRIMARY KEY, owner TEXT NOT NULL,
                                   expires DOUBLE PRECISION NOT NULL)
"""
_REFUSED = re.compile(r"password authentication failed|no pg_hba\.conf entry|role .* does not exist|"
                      r"no password supplied|authentication failed|permission denied for database")
_NO_DATABASE = re.compile(r'database "(.*)" does not exist')


class PostgresBackend(Backend):
    """A store in the database ``url`` names (in its current schema)."""

    now = "extract(epoch from clock_timestamp())::float8"

    location: StoreURL

    def __init__(self, url: StoreURL, read_only: bool) -> None:
        try:
            import psycopg
        except ImportError:
            raise StoreError(f"the store {url} is on PostgreSQL, which needs psycopg: {EXTRA}") from None
        self.location, self.read_only, self._psycopg = url, read_only, psycopg
        options: dict[str, Any] = {"autocommit": True, "application_name": "cascade"}
        options |= {key: value for key, value in TCP_DEFAULTS.items() if key not in url.conninfo()}
        try:
            self._conn = psycopg.connect(url.conninfo(), **options)
        except psycopg.ProgrammingError as exc:  # the URL itself (an unencoded space, say): no retry cures it
            raise StoreError(f"invalid store URL {url}: {url.scrub(_one_line(exc))}") from None
        except psycopg.Error as exc:
            raise _connect_failure(url, exc) from None
        self._owner = f"pg:{self._conn.info.backend_pid}:{uuid.uuid4().hex[:8]}"
        self._sql: dict[str, str] = {}
        if read_only:
            with self.opening():
                self._conn.execute("SET default_transaction_read_only = on")

    def _translated(self, sql: str) -> str:
        """``?`` placeholders as psycopg's ``%s`` (the store's SQL holds no other ``?`` or ``%``)."""
        if sql not in self._sql:
            self._sql[sql] = sql.replace("?", "%s")
        return self._sql[sql]

    def execute(self, sql: str, params: Sequence[Any] = ()) -> Any:
        try:
            return self._conn.execute(self._translated(sql), params)
        except self._psycopg.OperationalError as exc:
            raise self._lost(exc) from None

    def executemany(self, sql: str, rows: Iterable[Sequence[Any]]) -> None:
        try:
            with self._conn.cursor() as cursor:
                cursor.executemany(self._translated(sql), rows)
        except self._psycopg.OperationalError as exc:
            raise self._lost(exc) from None

    @contextmanager
    def transaction(self, durable: bool = True) -> Iterator[None]:
        try:
            with self._conn.transaction():
                if not durable:
                    self._conn.execute("SET LOCAL synchronous_commit TO off")
                yield
        except self._psycopg.OperationalError as exc:
            raise self._lost(exc) from None

    def serialise(self) -> None:
        self.execute("SELECT pg_advisory_xact_lock(?)", (LOCK_KEY,))

    def tables(self) -> set[str]:
        rows = self.execute("SELECT table_name FROM information_schema.tables "
                            "WHERE table_schema = current_schema()")
        return {r[0] for r in rows}

    def columns(self, table: str) -> set[str]:
        rows = self.execute("SELECT column_name FROM information_schema.columns "
                            "WHERE table_schema = current_schema() AND table_name = ?", (table,))
        return {r[0] for r in rows}

    def create_tables(self) -> None:
        tables = self.tables()
        if tables and "meta" not in tables:
            raise foreign_tables(self.location, tables)
        if "meta" in tables and set(STORE_TABLES) - tables:
            missing = sorted(set(STORE_TABLES) - tables)
            raise StoreError(f"label store {self.location} lacks tables {missing}; it was damaged or made "
                             "by another program: give --store another database")
        for statement in _TABLES.split(";"):
            self.execute(statement)

    def owner(self) -> str:
        return self._owner

    def alive(self, owner: str) -> bool:
        kind, pid, _ = owner.split(":", 2)
        if kind != "pg" or not pid.isdigit():
            return True
        row = self.execute("SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE pid = ?)", (int(pid),))
        return bool(row.fetchone()[0])

    @contextmanager
    def opening(self) -> Iterator[None]:
        try:
            yield
        except self._psycopg.Error as exc:
            self._conn.close()
            raise StoreError(f"cannot open label store {self.location}: "
                             f"{self.location.scrub(_one_line(exc))}") from None
        except BaseException:
            self._conn.close()
            raise

    def _lost(self, exc: Exception) -> StoreUnavailableError:
        return StoreUnavailableError(f"the PostgreSQL store {self.location} failed: "
                                     f"{self.location.scrub(_one_line(exc))}; what was committed is kept "
                                     "(a command run again resumes from it)")

    def close(self) -> None:
        self._conn.close()


def _connect_failure(url: StoreURL, exc: Exception) -> StoreError:
    """One line for a connection the server refused or never answered, with what to check; only a
    server that did not answer may answer later (``StoreUnavailableError``)."""
    text = url.scrub(_one_line(exc))
    if _REFUSED.search(text):
        return StoreError(f"PostgreSQL refused the credentials for {url}: {_reason(text)}; check the user "
                          "and password in the URL (or PGPASSWORD, ~/.pgpass)")
    missing = _NO_DATABASE.search(text)
    if missing:
        return StoreError(f"the PostgreSQL server has no database {missing.group(1)!r} for {url}: create it "
                          f"(createdb {missing.group(1)}) or fix the URL's path")
    if "invalid" in text or "missing" in text:
        return StoreError(f"invalid store URL {url}: {_reason(text)}")
    return StoreUnavailableError(f"cannot reach the PostgreSQL store {url}: {_reason(text)}; check the host "
                                 "and port, and that the server runs and accepts TCP connections")


def _one_line(exc: Exception) -> str:
    return " ".join(str(exc).split())


def _reason(text: str) -> str:
    """The server's or libpq's own words, without psycopg's prefix."""
    if "FATAL:" in text:
        return text.split("FATAL: ", 1)[-1].strip()
    return text.removeprefix("connection failed: ")
