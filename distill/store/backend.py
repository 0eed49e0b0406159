"""One small interface over the two places a store lives, so that the store's logic
(``distill.store.core``) is written once: a connection, its transactions, the tables it holds,
and what differs between engines (types in the tables, how writers are put in one line, whose
claims are still alive). The logic speaks one SQL to both: ``?`` placeholders, ``ON CONFLICT``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from contextlib import AbstractContextManager
from typing import Any

from distill.store.location import StoreLocation, StoreURL
from distill.store.records import StoreError

STORE_TABLES = ("meta", "labels", "audits", "claims")


class Backend(ABC):
    """A connection to one store. ``now`` is SQL for the store's clock in seconds since the epoch
    (claims expire on it, so that writers on machines whose clocks differ agree)."""

    location: StoreLocation
    read_only: bool
    now: str

    @abstractmethod
    def execute(self, sql: str, params: Sequence[Any] = ()) -> Any:
        """Run one statement; the cursor has ``rowcount``, ``fetchone``, ``fetchall``, iteration."""

    @abstractmethod
    def executemany(self, sql: str, rows: Iterable[Sequence[Any]]) -> None: ...

    @abstractmethod
    def transaction(self, durable: bool = True) -> AbstractContextManager[None]:
        """One write transaction, rolled back on any exception. ``durable=False``: its commit may
        be lost on power loss (claims, which only say who is working on an item), and so costs
        no flush to disk."""

    @abstractmethod
    def serialise(self) -> None:
        """Inside a transaction: no other writer passes this point until it ends. The store's
        order of audits is the order their transactions passed it."""

    @abstractmethod
    def tables(self) -> set[str]: ...

    @abstractmethod
    def columns(self, table: str) -> set[str]: ...

    @abstractmethod
    def create_tables(self) -> None:
        """Inside the opening transaction, past ``serialise``: the tables of this schema version,
        an older store of this engine upgraded; a place holding other tables is refused."""

    @abstractmethod
    def owner(self) -> str:
        """This connection's name on the claims it takes."""

    @abstractmethod
    def alive(self, owner: str) -> bool:
        """Whether the writer that took a claim as ``owner`` may still be working (False only
        where it is known to be gone: its process ended, its connection closed)."""

    @abstractmethod
    def opening(self) -> AbstractContextManager[None]:
        """Around opening: the connection closed again on any error, the engine's errors told as
        a ``StoreError`` naming the store."""

    @abstractmethod
    def close(self) -> None: ...


def foreign_tables(location: StoreLocation, tables: set[str]) -> StoreError:
    """The error for a place that holds tables but no store: it belongs to something else."""
    where = "file" if not isinstance(location, StoreURL) else "database (its current schema)"
    fix = "give --store a new path" if not isinstance(location, StoreURL) else \
        "give --store an empty database, or a schema of its own (?options=-csearch_path%3DNAME)"
    return StoreError(f"{location} is not a label store: the {where} holds other tables "
                      f"{sorted(tables)}; {fix}")
