"""A table rows are only appended to, numbered in the store's commit order: what the store's
``traffic`` and ``escalations`` share.

Each row's ``seq`` is the next number, taken inside the caller's transaction past
``db.serialise()``, so that every reader pages through the same order. The table is made on the
first write (one statement both engines read), so stores made before it existed open unchanged
and read as holding no rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from distill.store.backend import Backend


@dataclass(frozen=True)
class AppendedTable:
    """``name``'s columns past ``seq``, each (name, SQL type and constraints); ``added``: columns
    past the first ones, nullable, which a table made before them gets on its next write and reads
    as NULL until then (a reader of an older cascade does not select them)."""

    name: str
    columns: tuple[tuple[str, str], ...]
    added: tuple[tuple[str, str], ...] = ()

    def append(self, db: Backend, values: Sequence[Any], made: bool) -> None:
        """One row of ``values`` (in column order, the added ones last) as the next number;
        ``made``: the table is known to exist already, with every column. A row a unique column
        already holds is left as it is: a write retried after its commit's answer was lost (a
        connection that ended as it committed) is stored once."""
        if not made:
            body = ",\n".join(f"    {column} {kind}" for column, kind in self.columns + self.added)
            db.execute(f"CREATE TABLE IF NOT EXISTS {self.name} (\n    seq BIGINT PRIMARY KEY,\n{body}\n)")
            have = db.columns(self.name)
            for column, kind in self.added:
                if column not in have:
                    db.execute(f"ALTER TABLE {self.name} ADD COLUMN {column} {kind}")
        names = ", ".join(column for column, _ in self.columns + self.added)
        marks = ", ".join("?" for _ in self.columns + self.added)
        db.execute(f"INSERT INTO {self.name} (seq, {names}) SELECT COALESCE(MAX(seq), 0) + 1, {marks} "
                   f"FROM {self.name} WHERE TRUE ON CONFLICT DO NOTHING", tuple(values))

    def after(self, db: Backend, position: int, limit: int) -> list[tuple[Any, ...]]:
        """Up to ``limit`` rows past ``position``, in order, each (seq, *columns, *added; NULL for
        an added column the table lacks); none in a store without the table."""
        if self.name not in db.tables():
            return []
        have = db.columns(self.name) if self.added else set()
        names = ", ".join([column for column, _ in self.columns]
                          + [column if column in have else "NULL" for column, _ in self.added])
        return list(db.execute(f"SELECT seq, {names} FROM {self.name} WHERE seq > ? ORDER BY seq LIMIT ?",
                               (position, limit)).fetchall())

    def count(self, db: Backend) -> int:
        if self.name not in db.tables():
            return 0
        return int(db.execute(f"SELECT COUNT(*) FROM {self.name}").fetchone()[0])
