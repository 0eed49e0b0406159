"""Teacher label store: one SQLite file per teacher, safe to kill at any point.

Teacher labels are the most expensive data the project makes (most of a second of GPU per
item), so the store must never lose a committed label, never hold half an item, and let a
killed labelling run resume where it stopped. Each item's labels go in one transaction, rows
are keyed (item_id, question_id), and a store is bound to the one teacher that made it and to
the input policy it read with (context size, excerpt), so labels from two models or two cuts of
the inputs can never be mixed by pointing a run at the wrong file. Each label keeps the letter
mass of its readout, which the teacher check (``distill.teacher_check``) reads.
"""

from __future__ import annotations

import json
import math
import sqlite3
import time
from collections.abc import Collection, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, model_validator

from cascade.audit.record import AuditRecord, SystemAnswer
from cascade.checks import is_finite
from cascade.errors import CascadeError

SCHEMA_VERSION = 2
"""2 added each label's letter mass and the recorded input policy; a schema-1 store is upgraded
in place when opened for writing (its labels' letter mass and policy stay unknown)."""
SUM_TOLERANCE = 1e-3
TEACHER_FIELDS = ("kind", "model", "model_sha256", "prompt_version")

_SCHEMA = """
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
-- audited live items (their teacher labels are in labels), added within schema 1: a store
-- without the table reads as one without audits
CREATE TABLE IF NOT EXISTS audits (
    item_id TEXT PRIMARY KEY,
    state TEXT NOT NULL,
    calibration_version TEXT NOT NULL,
    system TEXT NOT NULL,
    created_at REAL NOT NULL
);
"""

class StoreError(CascadeError, ValueError):
    """A label store cannot be opened or written, or labels given to it are invalid."""


class StoreMismatchError(StoreError):
    """An existing store was made by a different teacher than the one now writing to it."""


class Teacher(BaseModel):
    """Who produced the labels; thresholds calibrated on them are only valid for this teacher."""

    model_config = ConfigDict(frozen=True, extra="forbid", protected_namespaces=())

    kind: Literal["gguf", "external"]
    model: str
    model_sha256: str | None = None
    prompt_version: str | None = None

    @model_validator(mode="after")
    def _gguf_is_pinned(self) -> Teacher:
        if self.kind == "gguf" and (not self.model_sha256 or not self.prompt_version):
            raise ValueError(
                "a teacher of kind 'gguf' needs both model_sha256 and prompt_version, because "
                f"labels are only reproducible from a pinned model and prompt; got "
                f"model_sha256={self.model_sha256!r}, prompt_version={self.prompt_version!r}"
            )
        return self


class InputPolicy(BaseModel):
    """How the teacher read each state: its context size and the excerpt of an over-long state
    (``head_tail:N``; None: whole states only, an over-long one is not labelled). Every path that
    reads a state for the bundle (calibration, routing, serving) must read it the same way."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    n_ctx: int
    excerpt: str | None = None

    def __str__(self) -> str:
        return f"n_ctx {self.n_ctx}, " + (f"excerpt {self.excerpt}" if self.excerpt else "no excerpt")


class Label(BaseModel):
    """One stored row: the teacher's distribution for one question about one item."""

    item_id: str
    question_id: str
    probabilities: dict[str, float]
    prompt_hash: str | None
    created_at: float


class LabelStore:
    """Labels of one teacher in a SQLite file (WAL), written one item per transaction.

    ``synchronous=FULL``: WAL with NORMAL already survives a killed process, but may drop the
    last commits on power loss; FULL makes every commit durable for one fsync, which is
    nothing next to the teacher's cost per item, and imports amortise it over a batch.
    """

    def __init__(self, path: Path, teacher: Teacher, any_thread: bool = False,
                 policy: InputPolicy | None = None) -> None:
        """``any_thread``: the connection may be used (and closed) from another thread than the
        one that opened it, for a caller that serialises its use (``distill.auditing.StoreSink``).
        ``policy``: how this run reads states (a labelling run); refused where the store's labels
        were read another way, recorded where the store has none yet."""
        self.path, self.teacher, self._read_only = Path(path), teacher, False
        self._conn = _connect(self.path, read_only=False, any_thread=any_thread)
        with _closed_on_error(self._conn, self.path):
            self._conn.execute("PRAGMA journal_mode=WAL")
            self._conn.execute("PRAGMA synchronous=FULL")
            with self._transaction():
                self._create_schema()
                meta = _read_meta(self._conn, self.path)
                self._check_teacher(meta)
                self.policy = self._bind_policy(meta, policy)

    @classmethod
    def open_existing(cls, path: Path) -> LabelStore:
        """Open a store for reading (export, training); the teacher comes from the file."""
        path = Path(path)
        if not path.is_file():
            raise StoreError(f"no label store at {path}: check --store, or label a corpus first")
        store = cls.__new__(cls)
        store.path, store._read_only = path, True
        store._conn = _connect(path, read_only=True)
        with _closed_on_error(store._conn, path):
            meta = _read_meta(store._conn, path)
        store.teacher = Teacher.model_validate({f: meta[f"teacher_{f}"] for f in TEACHER_FIELDS})
        store.policy = _policy_of(meta)
        return store

    def _create_schema(self) -> None:
        """Tables and teacher on first use; refuses SQLite files that belong to something else."""
        tables = [r[0] for r in self._conn.execute("SELECT name FROM sqlite_master")]
        if tables and "meta" not in tables:
            raise StoreError(f"{self.path} is an SQLite file but not a label store (tables "
                             f"{tables}); give --store a new path")
        if "labels" in tables and not _has_letter_mass(self._conn):  # schema 1: upgraded in place
            self._conn.execute("ALTER TABLE labels ADD COLUMN letter_mass REAL")
            self._conn.execute("UPDATE meta SET value=? WHERE key='schema_version' AND value='1'",
                               (str(SCHEMA_VERSION),))
        for statement in _SCHEMA.split(";")[:-1]:
            self._conn.execute(statement)
        rows = [("schema_version", str(SCHEMA_VERSION))]
        rows += [(f"teacher_{f}", getattr(self.teacher, f)) for f in TEACHER_FIELDS]
        self._conn.executemany("INSERT OR IGNORE INTO meta VALUES (?, ?)", rows)

    def _check_teacher(self, meta: Mapping[str, str | None]) -> None:
        differ = [
            f"{f} (store: {meta.get(f'teacher_{f}')!r}, this run: {getattr(self.teacher, f)!r})"
            for f in TEACHER_FIELDS
            if meta.get(f"teacher_{f}") != getattr(self.teacher, f)
        ]
        if differ:
            raise StoreMismatchError(
                f"label store {self.path} was made by another teacher; differs in "
                f"{', '.join(differ)}. Use a new --store path for this teacher's labels."
            )

    def _bind_policy(self, meta: Mapping[str, str | None], policy: InputPolicy | None) -> InputPolicy | None:
        """The store's input policy: ``policy`` recorded on first use; another one refused."""
        stored = _policy_of(meta)
        if policy is None or stored == policy:
            return stored
        if stored is not None:
            raise StoreMismatchError(
                f"label store {self.path} holds labels read with {stored}; this run reads with "
                f"{policy}. Labels of two input policies never mix in one store: label with the "
                "store's (--n-ctx, --excerpt), or use a new --store path.")
        self._conn.execute("INSERT OR REPLACE INTO meta VALUES ('input_policy', ?)",
                           (policy.model_dump_json(),))
        return policy

    @contextmanager
    def _transaction(self) -> Iterator[None]:
        """BEGIN IMMEDIATE ... COMMIT, rolled back on any exception (the connection autocommits)."""
        if self._read_only:
            raise StoreError(f"{self.path} was opened read-only; open LabelStore(path, teacher)")
        self._conn.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            self._conn.execute("ROLLBACK")
            raise
        self._conn.execute("COMMIT")

    def done_items(self, question_ids: Collection[str]) -> set[str]:
        """Items labelled for every one of ``question_ids``: what a resumed run may skip."""
        qids = sorted(set(question_ids))
        if not qids:
            return {r[0] for r in self._conn.execute("SELECT DISTINCT item_id FROM labels")}
        marks = ",".join("?" * len(qids))
        rows = self._conn.execute(
            f"SELECT item_id FROM labels WHERE question_id IN ({marks}) "
            "GROUP BY item_id HAVING COUNT(*) = ?",
            [*qids, len(qids)],
        )
        return {r[0] for r in rows}

    def put_item(
        self,
        item_id: str,
        labels: Mapping[str, Mapping[str, float]],
        prompt_hash: Mapping[str, str] | None = None,
        letter_mass: Mapping[str, float] | None = None,
    ) -> None:
        """Store all of one item's labels atomically, so a kill never leaves half an item.

        Re-putting a label equal to the stored one does nothing; a different one raises,
        because a store never silently changes a teacher's answer. ``letter_mass``: per question,
        the share of the readout's probability on the option letters (None where unknown).
        """
        with self._transaction():
            conflicts = self._insert(item_id, labels, prompt_hash or {}, letter_mass or {})
            if conflicts:
                raise StoreError(conflict_message(item_id, conflicts))

    def _insert(
        self, item_id: str, labels: Mapping[str, Mapping[str, float]], hashes: Mapping[str, str],
        masses: Mapping[str, float] | None = None,
    ) -> list[str]:
        """Insert inside the caller's transaction; return question ids whose stored row differs."""
        now, conflicts = time.time(), []
        for qid, probs in labels.items():
            text = json.dumps(check_probabilities(probs, f"labels[{qid!r}]"))
            row = (item_id, qid, text, hashes.get(qid), now, (masses or {}).get(qid))
            sql = ("INSERT OR IGNORE INTO labels (item_id, question_id, probabilities, prompt_hash, "
                   "created_at, letter_mass) VALUES (?,?,?,?,?,?)")
            if self._conn.execute(sql, row).rowcount:
                continue
            old = self._conn.execute(
                "SELECT probabilities, prompt_hash FROM labels WHERE item_id=? AND question_id=?",
                (item_id, qid),
            ).fetchone()
            if json.loads(old[0]) != json.loads(text) or old[1] != hashes.get(qid):
                conflicts.append(qid)
        return conflicts

    def put_many(self, items: Mapping[str, Mapping[str, Mapping[str, float]]]) -> dict[str, list[str]]:
        """Store several items' labels in ONE transaction (an import's batch); per item, the
        question ids whose stored label differs and was left as it was."""
        with self._transaction():
            found = {item: self._insert(item, labels, {}) for item, labels in items.items()}
        return {item: qids for item, qids in found.items() if qids}

    def put_audit(self, record: AuditRecord) -> None:
        """Store an audited item in one transaction: the teacher's labels (in ``labels``, as every
        teacher label) and the audit row tagging them, with the state and what the system
        answered, so that a kill never leaves labels without their audit or the reverse."""
        with self._transaction():
            conflicts = self._insert(record.item_id, record.teacher, record.prompt_hashes)
            if conflicts:
                raise StoreError(conflict_message(record.item_id, conflicts))
            system = json.dumps({q: a.model_dump() for q, a in record.system.items()})
            self._conn.execute("INSERT OR IGNORE INTO audits VALUES (?,?,?,?,?)",
                               (record.item_id, json.dumps(record.state), record.calibration_version,
                                system, record.at))

    def audits(self) -> list[AuditRecord]:
        """Every audited item, oldest first, its teacher labels joined back (none in a store made
        before audits existed)."""
        try:
            rows = self._conn.execute("SELECT * FROM audits ORDER BY created_at, item_id").fetchall()
        except sqlite3.OperationalError:  # a read-only store from before the audits table
            return []
        records = []
        for item_id, state, version, system, created in rows:
            sql = "SELECT question_id, probabilities, prompt_hash FROM labels WHERE item_id=?"
            labels = self._conn.execute(sql, (item_id,)).fetchall()
            records.append(AuditRecord(
                item_id=item_id, state=json.loads(state), calibration_version=version, at=created,
                teacher={q: json.loads(p) for q, p, _ in labels},
                prompt_hashes={q: h for q, _, h in labels if h},
                system={q: SystemAnswer.model_validate(a) for q, a in json.loads(system).items()}))
        return records

    def labels(self, question_id: str) -> dict[str, dict[str, float]]:
        """item_id -> probabilities for one question (empty if the store has none)."""
        sql = "SELECT item_id, probabilities FROM labels WHERE question_id=? ORDER BY item_id"
        return {item: json.loads(text) for item, text in self._conn.execute(sql, (question_id,))}

    def letter_masses(self, question_id: str) -> dict[str, float]:
        """item_id -> the letter mass of its readout for one question, where it was recorded."""
        if not _has_letter_mass(self._conn):
            return {}
        sql = "SELECT item_id, letter_mass FROM labels WHERE question_id=? AND letter_mass IS NOT NULL"
        return dict(self._conn.execute(sql, (question_id,)).fetchall())

    def iter_labels(self) -> Iterator[Label]:
        """Every row, ordered by item then question."""
        rows = self._conn.execute("SELECT item_id, question_id, probabilities, prompt_hash, created_at "
                                  "FROM labels ORDER BY item_id, question_id")
        for item, qid, text, phash, created in rows:
            yield Label(item_id=item, question_id=qid, probabilities=json.loads(text),
                        prompt_hash=phash, created_at=created)

    def question_ids(self) -> list[str]:
        rows = self._conn.execute("SELECT DISTINCT question_id FROM labels ORDER BY question_id")
        return [r[0] for r in rows]

    def __len__(self) -> int:
        return int(self._conn.execute("SELECT COUNT(*) FROM labels").fetchone()[0])

    def close(self) -> None:
        self._conn.close()

    def __enter__(self) -> LabelStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextmanager
def removed_on_failure(path: Path) -> Iterator[None]:
    """Delete the store at ``path`` again if the block fails and the store did not exist before
    it: a first import that fails must not leave an empty store behind, which a later run would
    take for this teacher's (or refuse as another teacher's). Close the store inside the block."""
    path = Path(path)
    created = not path.exists()
    try:
        yield
    except BaseException:
        if created:
            for leftover in (path, *(path.with_name(path.name + end) for end in ("-wal", "-shm"))):
                leftover.unlink(missing_ok=True)
        raise


def _connect(path: Path, read_only: bool, any_thread: bool = False) -> sqlite3.Connection:
    uri = f"{path.resolve().as_uri()}?mode={'ro' if read_only else 'rwc'}"
    try:
        return sqlite3.connect(uri, uri=True, isolation_level=None, timeout=30.0,
                               check_same_thread=not any_thread)
    except sqlite3.Error as exc:
        raise StoreError(f"cannot open label store {path}: {exc}") from exc


@contextmanager
def _closed_on_error(conn: sqlite3.Connection, path: Path) -> Iterator[None]:
    """Close the connection if opening fails, naming the file when it is not a store."""
    try:
        yield
    except sqlite3.DatabaseError as exc:
        conn.close()
        raise StoreError(f"{path} is not a label store ({exc}); check --store") from exc
    except BaseException:
        conn.close()
        raise


def _has_letter_mass(conn: sqlite3.Connection) -> bool:
    return any(row[1] == "letter_mass" for row in conn.execute("PRAGMA table_info(labels)"))


def _policy_of(meta: Mapping[str, str | None]) -> InputPolicy | None:
    text = meta.get("input_policy")
    return InputPolicy.model_validate_json(text) if text else None


def _read_meta(conn: sqlite3.Connection, path: Path) -> dict[str, str | None]:
    """The metadata table; a store of another schema version is refused, not guessed at (a
    schema-1 store opened read-only is read as it is)."""
    meta = dict(conn.execute("SELECT key, value FROM meta").fetchall())
    version = meta.get("schema_version")
    if version not in (str(SCHEMA_VERSION), "1"):
        newer = version is not None and version.isdigit() and int(version) > SCHEMA_VERSION
        raise StoreError(
            f"label store {path} has schema version {version!r}; this code reads version "
            f"{SCHEMA_VERSION}" + (": it was made by a newer cascade, upgrade this one." if newer
                                   else ". Relabel into a new --store path."))
    return meta


def check_probabilities(probs: Any, where: str) -> dict[str, float]:
    """Finite, non-negative, summing to 1 within SUM_TOLERANCE; returned renormalised."""
    if not isinstance(probs, Mapping) or not probs:
        raise StoreError(f"{where} must be a non-empty object of option -> probability")
    for key, p in probs.items():
        if not is_finite(p) or p < 0:
            raise StoreError(f"{where}[{key!r}] must be a finite number >= 0, got {p!r}")
    total = math.fsum(probs.values())
    if abs(total - 1.0) > SUM_TOLERANCE:
        raise StoreError(f"{where} must sum to 1 (within {SUM_TOLERANCE}), sums to {total!r}")
    return {str(k): float(p) / total for k, p in probs.items()}


def conflict_message(item_id: str, question_ids: list[str]) -> str:
    return (f"item {item_id!r} already has different labels for {question_ids}; stored labels "
            "are never overwritten. Use a new --store path to relabel.")
