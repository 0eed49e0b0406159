"""The label store's logic, written once for both backends (``distill.store.backend``).

Teacher labels are the most expensive data the project makes (most of a second of GPU per
item), so the store must never lose a committed label, never hold half an item, and let a
killed labelling run resume where it stopped. Each item's labels go in one transaction, rows
are keyed (item_id, question_id), and a store is bound to the one teacher that made it and to
the input policy it read with (context size, excerpt), so labels from two models or two cuts of
the inputs can never be mixed by pointing a run at the wrong store. Each label keeps the letter
mass of its readout, which the teacher check (``distill.calibration.teacher_check``) reads.

Many writers may share a store: a writer claims an item before the teacher reads it
(``claim``), so two labelling runs never label one item twice, and audits are numbered in the
order the store committed them, the one order every replica's drift watch reads them in.
"""

from __future__ import annotations

import json
import time
from collections.abc import Collection, Iterator, Mapping
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import TypeVar

from cascade.audit.record import AuditRecord
from cascade.collect.escalation import EscalationRecord
from cascade.collect.record import CollectedItem
from cascade.questions import Question, wording_sha256
from distill.store.audit_rows import audit_records
from distill.store.backend import foreign_tables
from distill.store.escalations import (
    ESCALATION_PAGE,
    escalation_count,
    escalation_rows_after,
    put_escalation_row,
)
from distill.store.location import StoreLocation, StoreURL, store_location
from distill.store.places import connect, drop, exists
from distill.store.records import (
    SCHEMA_VERSION,
    TEACHER_FIELDS,
    InputPolicy,
    Label,
    LabelConflictError,
    StoreError,
    StoreMismatchError,
    Teacher,
    check_probabilities,
    check_version,
    conflict_message,
    policy_of,
    stored_probabilities,
)
from distill.store.texts import add_column, record_hashes, stored_hashes
from distill.store.traffic import TRAFFIC_PAGE, put_traffic, traffic_after, traffic_count

CLAIM_LEASE_S = 3600.0
"""How long a claim keeps other writers off an item when its writer cannot be told dead (a
process on another machine that hangs): far longer than the teacher takes for one item."""
AUDIT_PAGE = 400
"""Audits read per query (each with its labels, looked up by an IN list of that many ids)."""
ROWS_PER_INSERT = 100
T = TypeVar("T")
_DESIGN = (("inclusion", "DOUBLE PRECISION"), ("routed", "TEXT"))
"""The audits' columns past the first schema-3 ones: the sampling design of each audit."""
_LABEL_COLUMNS = "item_id, question_id, probabilities, prompt_hash, created_at, letter_mass, text_sha256"


class LabelStore:
    """Labels of one teacher, written one item per transaction, in a SQLite file or a PostgreSQL
    database (``path``: a path, or a ``postgresql://`` URL; ``distill.store.location``)."""

    _design: str | None = None  # the design columns to select (``_design_columns``)

    def __init__(self, path: StoreLocation | str, teacher: Teacher, any_thread: bool = False,
                 policy: InputPolicy | None = None) -> None:
        """``any_thread``: the connection may be used (and closed) from another thread than the
        one that opened it, for a caller that serialises its use (``distill.loop.auditing.StoreSink``).
        ``policy``: how this run reads states (a labelling run); refused where the store's labels
        were read another way, recorded where the store has none yet."""
        self.path: StoreLocation = store_location(path)
        self.teacher, self._read_only, self._claims = teacher, False, False
        self._appended: set[str] = set()  # appended tables this store made or wrote (they exist)
        self._db = connect(self.path, read_only=False, any_thread=any_thread)
        with self._db.opening(), self._transaction():
            self._db.serialise()
            self._db.create_tables()
            self._add_design()
            add_column(self._db)
            rows = [("schema_version", str(SCHEMA_VERSION))]
            rows += [(f"teacher_{f}", getattr(self.teacher, f)) for f in TEACHER_FIELDS]
            self._db.executemany("INSERT INTO meta (key, value) VALUES (?, ?) ON CONFLICT (key) DO NOTHING",
                                 rows)
            meta = self._read_meta()
            self._check_teacher(meta)
            self.policy = self._bind_policy(meta, policy)

    def _add_design(self) -> None:
        """The audits' design columns, added to a store made before them (left NULL there): each
        audit's inclusion probability and the routed counts it was drawn from. Added columns a
        reader of an older cascade does not select, so the schema version stays."""
        have = self._db.columns("audits")
        for name, kind in _DESIGN:
            if name not in have:
                self._db.execute(f"ALTER TABLE audits ADD COLUMN {name} {kind}")

    def _design_columns(self) -> str:
        """What to select for the design columns: NULLs in a read-only store made before them."""
        if self._design is None:
            have = self._db.columns("audits")
            self._design = ", ".join(name if name in have else "NULL" for name, _ in _DESIGN)
        return self._design

    @classmethod
    def open_existing(cls, path: StoreLocation | str) -> LabelStore:
        """Open a store for reading (export, training); the teacher comes from the store."""
        store = cls.__new__(cls)
        store.path, store._read_only, store._claims = store_location(path), True, False
        store._appended = set()
        store._db = connect(store.path, read_only=True)
        with store._db.opening():
            tables = store._db.tables()
            if not tables:
                raise StoreError(f"no label store at {store.path}: check --store, or label a corpus first")
            if "meta" not in tables:
                raise foreign_tables(store.path, tables)
            meta = store._read_meta()
        store.teacher = Teacher.model_validate({f: meta.get(f"teacher_{f}") for f in TEACHER_FIELDS})
        store.policy = policy_of(meta)
        return store

    @property
    def shared(self) -> bool:
        """Whether writers on other machines can reach this store (PostgreSQL), so that workers
        elsewhere (Ray actors) may write to it themselves."""
        return isinstance(self.path, StoreURL)

    def _read_meta(self) -> dict[str, str | None]:
        """The metadata table; a store of another schema version is refused, not guessed at (an
        older SQLite store opened read-only is read as it is)."""
        meta = dict(self._db.execute("SELECT key, value FROM meta").fetchall())
        check_version(meta, self.path)
        return meta

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
        stored = policy_of(meta)
        if policy is None or stored == policy:
            return stored
        if stored is not None:
            raise StoreMismatchError(
                f"label store {self.path} holds labels read with {stored}; this run reads with "
                f"{policy}. Labels of two input policies never mix in one store: label with the "
                "store's (--n-ctx, --excerpt), or use a new --store path.")
        self._db.execute("INSERT INTO meta (key, value) VALUES ('input_policy', ?) ON CONFLICT (key) "
                         "DO UPDATE SET value = excluded.value", (policy.model_dump_json(),))
        return policy

    def check_questions(self, questions: Mapping[str, Question]) -> None:
        """Refuse a question whose wording (``wording_sha256``) differs from the one this store's
        labels of it were read with (``wording_ID`` in its metadata; a store made before they were
        recorded records them at its next labelling)."""
        meta = self._read_meta()
        changed = sorted(qid for qid, question in questions.items()
                         if meta.get(f"wording_{qid}") not in (None, wording_sha256(question)))
        if changed:
            raise StoreMismatchError(
                f"label store {self.path} holds labels of {', '.join(changed)} read with another wording "
                "(its instructions, options or their texts changed since): labels of one wording are not "
                "answers to another. Give the changed question a new id, or label into a new --store")

    def bind_questions(self, questions: Mapping[str, Question]) -> None:
        """Record each question's wording where none is yet, then ``check_questions``: a labelling
        run's, before it labels anything."""
        with self._transaction():
            self._db.executemany("INSERT INTO meta (key, value) VALUES (?, ?) ON CONFLICT (key) DO NOTHING",
                                 [(f"wording_{qid}", wording_sha256(q)) for qid, q in questions.items()])
        self.check_questions(questions)

    @contextmanager
    def _transaction(self, durable: bool = True) -> Iterator[None]:
        if self._read_only:
            raise StoreError(f"{self.path} was opened read-only; open LabelStore(path, teacher)")
        with self._db.transaction(durable):
            yield

    def done_items(self, question_ids: Collection[str]) -> set[str]:
        """Items labelled for every one of ``question_ids``: what a resumed run may skip."""
        qids = sorted(set(question_ids))
        if not qids:
            return {r[0] for r in self._db.execute("SELECT DISTINCT item_id FROM labels")}
        marks = ",".join("?" * len(qids))
        rows = self._db.execute(
            f"SELECT item_id FROM labels WHERE question_id IN ({marks}) "
            "GROUP BY item_id HAVING COUNT(*) = ?",
            [*qids, len(qids)],
        )
        return {r[0] for r in rows}

    def claim(self, item_id: str, questions: Mapping[str, T]) -> dict[str, T] | None:
        """Claim ``item_id`` for this writer before its teacher reads it: the ``questions`` it
        still lacks (empty: another writer labelled them meanwhile, nothing is claimed), or None
        while another writer that is alive holds it. ``put_item`` releases the claim with the
        labels, ``release`` or closing the store without them; a claim of a writer known to be
        gone (its process or connection ended) is taken over at once, any other after
        CLAIM_LEASE_S. Reads first, so that an item done or held costs no write lock."""
        missing = self._missing(item_id, questions)
        if not missing or self._held_by_another(item_id):
            return missing if not missing else None
        me = self._db.owner()
        with self._transaction(durable=False):
            taken = self._db.execute(
                f"INSERT INTO claims (item_id, owner, expires) VALUES (?, ?, {self._db.now} + ?) "
                "ON CONFLICT (item_id) DO UPDATE SET owner = excluded.owner, expires = excluded.expires "
                f"WHERE claims.owner = excluded.owner OR claims.expires < {self._db.now}",
                (item_id, me, CLAIM_LEASE_S)).rowcount
            if not taken:
                row = self._db.execute("SELECT owner FROM claims WHERE item_id = ?", (item_id,)).fetchone()
                if row is not None and (self._db.alive(row[0]) or not self._db.execute(
                        f"UPDATE claims SET owner = ?, expires = {self._db.now} + ? WHERE item_id = ? "
                        "AND owner = ?", (me, CLAIM_LEASE_S, item_id, row[0])).rowcount):
                    return None
            self._claims = True
            missing = self._missing(item_id, questions)  # labelled between the first look and the claim?
            if not missing:
                self._db.execute("DELETE FROM claims WHERE item_id = ? AND owner = ?", (item_id, me))
        return missing

    def _missing(self, item_id: str, questions: Mapping[str, T]) -> dict[str, T]:
        rows = self._db.execute("SELECT question_id FROM labels WHERE item_id = ?", (item_id,))
        have = {r[0] for r in rows}
        return {qid: value for qid, value in questions.items() if qid not in have}

    def _held_by_another(self, item_id: str) -> bool:
        """Whether another writer that may be alive holds an unexpired claim on ``item_id`` (a
        read: the claim itself is then taken, or refused, in a write transaction)."""
        row = self._db.execute(f"SELECT owner, expires > {self._db.now} FROM claims WHERE item_id = ?",
                               (item_id,)).fetchone()
        return row is not None and row[0] != self._db.owner() and bool(row[1]) and self._db.alive(row[0])

    def release(self, item_id: str) -> None:
        """Give up this writer's claim on ``item_id`` (its item was not labelled: too long, say)."""
        with self._transaction(durable=False):
            self._db.execute("DELETE FROM claims WHERE item_id = ? AND owner = ?",
                             (item_id, self._db.owner()))

    def put_item(
        self,
        item_id: str,
        labels: Mapping[str, Mapping[str, float]],
        prompt_hash: Mapping[str, str] | None = None,
        letter_mass: Mapping[str, float] | None = None,
        text_sha256: str | None = None,
    ) -> None:
        """Store all of one item's labels atomically, so a kill never leaves half an item, and
        release the item's claim with them.

        Re-putting a label equal to the stored one does nothing; a different one raises,
        because a store never silently changes a teacher's answer. ``letter_mass``: per question,
        the share of the readout's probability on the option letters (None where unknown);
        ``text_sha256``: the item's ``distill.store.texts.state_sha256``, which later readers of
        the corpus check the item against.
        """
        with self._transaction():
            conflicts = self._insert(item_id, labels, prompt_hash or {}, letter_mass or {}, text_sha256)
            if conflicts:
                raise LabelConflictError(conflict_message(item_id, conflicts))
            self._db.execute("DELETE FROM claims WHERE item_id = ?", (item_id,))

    def _insert(
        self, item_id: str, labels: Mapping[str, Mapping[str, float]], hashes: Mapping[str, str],
        masses: Mapping[str, float] | None = None, text: str | None = None,
    ) -> list[str]:
        """Insert inside the caller's transaction; return question ids whose stored row differs."""
        now = time.time()
        rows = [(item_id, qid, json.dumps(check_probabilities(probs, f"labels[{qid!r}]")), hashes.get(qid),
                 now, (masses or {}).get(qid), text) for qid, probs in labels.items()]
        inserted = 0
        for start in range(0, len(rows), ROWS_PER_INSERT):
            part = rows[start:start + ROWS_PER_INSERT]
            marks = ",".join(["(?,?,?,?,?,?,?)"] * len(part))
            inserted += self._db.execute(
                f"INSERT INTO labels ({_LABEL_COLUMNS}) VALUES {marks} "
                "ON CONFLICT (item_id, question_id) DO NOTHING", [v for row in part for v in row]).rowcount
        if inserted == len(rows):
            return []
        stored = {q: (json.loads(p), h) for q, p, h in self._db.execute(
            "SELECT question_id, probabilities, prompt_hash FROM labels WHERE item_id = ?", (item_id,))}
        return [qid for _, qid, probs, phash, _, _, _ in rows if stored[qid] != (json.loads(probs), phash)]

    def put_many(self, items: Mapping[str, Mapping[str, Mapping[str, float]]]) -> dict[str, list[str]]:
        """Store several items' labels in ONE transaction (an import's batch); per item, the
        question ids whose stored label differs and was left as it was."""
        with self._transaction():
            found = {item: self._insert(item, labels, {}) for item, labels in items.items()}
        return {item: qids for item, qids in found.items() if qids}

    def put_audit(self, record: AuditRecord) -> None:
        """Store an audited item in one transaction: the teacher's labels (in ``labels``, as every
        teacher label) and the audit row tagging them, with the state and what the system
        answered, so that a kill never leaves labels without their audit or the reverse. Its
        place in the store's order of audits (``seq``) is the order the transactions committed:
        one audit writer at a time, whatever the process."""
        with self._transaction():
            self._db.serialise()
            conflicts = self._insert(record.item_id, record.teacher, record.prompt_hashes)
            if conflicts:
                raise StoreError(conflict_message(record.item_id, conflicts))
            system = json.dumps({q: a.model_dump() for q, a in record.system.items()})
            self._db.execute(
                "INSERT INTO audits (item_id, state, calibration_version, system, created_at, inclusion, "
                "routed, seq) SELECT ?, ?, ?, ?, ?, ?, ?, COALESCE(MAX(seq), 0) + 1 FROM audits WHERE TRUE "
                "ON CONFLICT (item_id) DO NOTHING",
                (record.item_id, json.dumps(record.state), record.calibration_version, system, record.at,
                 record.inclusion, json.dumps(record.routed)))

    def audits_after(self, position: int, limit: int = AUDIT_PAGE) -> list[tuple[int, AuditRecord]]:
        """Up to ``limit`` audits past ``position`` in the store's order, each with its position:
        the stream every replica's drift watch follows (``cascade.audit.stream``)."""
        rows = self._db.execute(
            f"SELECT seq, item_id, state, calibration_version, system, created_at, {self._design_columns()} "
            "FROM audits WHERE seq > ? ORDER BY seq LIMIT ?", (position, limit)).fetchall()
        return list(zip([r[0] for r in rows], self._records([r[1:] for r in rows]), strict=True))

    def audits(self) -> list[AuditRecord]:
        """Every audited item, in the store's order, its teacher labels joined back (none in a
        store made before audits existed; a read-only older store in the order written)."""
        return list(self.each_audit())

    def each_audit(self) -> Iterator[AuditRecord]:
        """``audits``, read a page at a time: a caller that folds over them (a drift watch
        replayed by ``promote`` and ``retrain``) holds one page of customer text, not a store's
        whole history of it."""
        tables = self._db.tables()
        if "audits" not in tables:
            return
        if "seq" not in self._db.columns("audits"):
            rows = self._db.execute("SELECT item_id, state, calibration_version, system, created_at, "
                                    "NULL, NULL FROM audits ORDER BY created_at, item_id").fetchall()
            yield from self._records(rows)
            return
        position = 0
        while page := self.audits_after(position):
            position = page[-1][0]
            yield from (record for _, record in page)

    def _records(self, rows: list[tuple]) -> list[AuditRecord]:
        """Audit rows as records, their labels looked up (``distill.store.audit_rows``)."""
        return audit_records(rows, self._labels_of([r[0] for r in rows]), self.path)

    def _labels_of(self, items: list[str]) -> dict[str, list[tuple[str, str, str | None]]]:
        """Per item, its label rows (question, probabilities JSON, prompt hash) by question id."""
        labels: dict[str, list[tuple[str, str, str | None]]] = {}
        if items:
            marks = ",".join("?" * len(items))
            for item, qid, text, phash in self._db.execute(
                    "SELECT item_id, question_id, probabilities, prompt_hash FROM labels "
                    f"WHERE item_id IN ({marks})", items):
                labels.setdefault(item, []).append((qid, text, phash))
        return {item: sorted(rows) for item, rows in labels.items()}

    def put_traffic(self, item: CollectedItem) -> None:
        """Append one request a pass-through collected (``distill.store.traffic``), in one
        transaction, numbered in the order the store commits them."""
        with self._transaction():
            self._db.serialise()
            put_traffic(self._db, item, made="traffic" in self._appended)
        self._appended.add("traffic")

    def traffic_after(self, position: int, limit: int = TRAFFIC_PAGE) -> list[tuple[int, CollectedItem]]:
        """Up to ``limit`` collected requests past ``position``, in the store's order."""
        return traffic_after(self._db, position, limit)

    def traffic_count(self) -> int:
        """Collected requests in the store."""
        return traffic_count(self._db)

    def put_escalation(self, record: EscalationRecord) -> None:
        """Store an escalated request in one transaction: the teacher's labels of the questions it
        answered (in ``labels``) and the row naming them an escalation, with the state
        (``distill.store.escalations``); numbered in the order the store commits them."""
        with self._transaction():
            self._db.serialise()
            conflicts = self._insert(record.item_id, record.teacher, record.prompt_hashes)
            if conflicts:
                raise StoreError(conflict_message(record.item_id, conflicts))
            put_escalation_row(self._db, record, made="escalations" in self._appended)
        self._appended.add("escalations")

    def escalations_after(self, position: int, limit: int = ESCALATION_PAGE
                          ) -> list[tuple[int, EscalationRecord]]:
        """Up to ``limit`` escalations past ``position``, in the store's order, labels joined back."""
        rows = escalation_rows_after(self._db, position, limit)
        labels = self._labels_of([row[1] for row in rows])
        return [(seq, EscalationRecord(
            item_id=item, request_id=request, state=json.loads(state), calibration_version=version, at=at,
            teacher={q: json.loads(p) for q, p, _ in labels.get(item, [])},
            prompt_hashes={q: h for q, _, h in labels.get(item, []) if h},
            census=tuple(json.loads(census or "[]")), inclusion=inclusion))
            for seq, item, request, state, version, at, census, inclusion in rows]

    def escalation_count(self) -> int:
        """Escalated requests the store holds."""
        return escalation_count(self._db)

    def audit_count(self) -> int:
        """Audited items the store holds (none in a store made before audits existed)."""
        if "audits" not in self._db.tables():
            return 0
        return int(self._db.execute("SELECT COUNT(*) FROM audits").fetchone()[0])

    def labels(self, question_id: str) -> dict[str, dict[str, float]]:
        """item_id -> probabilities for one question (empty if the store has none)."""
        sql = "SELECT item_id, probabilities FROM labels WHERE question_id = ? ORDER BY item_id"
        return {item: stored_probabilities(text, item, question_id, self.path)
                for item, text in self._db.execute(sql, (question_id,))}

    def letter_masses(self, question_id: str) -> dict[str, float]:
        """item_id -> the letter mass of its readout for one question, where it was recorded."""
        if "letter_mass" not in self._db.columns("labels"):
            return {}
        sql = "SELECT item_id, letter_mass FROM labels WHERE question_id = ? AND letter_mass IS NOT NULL"
        return dict(self._db.execute(sql, (question_id,)).fetchall())

    def iter_labels(self) -> Iterator[Label]:
        """Every row, ordered by item then question."""
        rows = self._db.execute("SELECT item_id, question_id, probabilities, prompt_hash, created_at "
                                "FROM labels ORDER BY item_id, question_id")
        for item, qid, text, phash, created in rows:
            yield Label(item_id=item, question_id=qid,
                        probabilities=stored_probabilities(text, item, qid, self.path),
                        prompt_hash=phash, created_at=created)

    def text_hashes(self) -> dict[str, str]:
        """item_id -> the hash of the state its labels answered, where recorded (``texts``)."""
        return stored_hashes(self._db)

    def record_texts(self, hashes: Mapping[str, str]) -> None:
        """Record ``hashes`` on labelled items that record none (labels made before the column)."""
        with self._transaction():
            record_hashes(self._db, hashes)

    def labelled_at(self) -> dict[str, float]:
        """item_id -> when the store took its first label (the writer's clock, Unix seconds): on one
        clock with the audits' labels, so a gate can keep what came after a drift alarm."""
        sql = "SELECT item_id, MIN(created_at) FROM labels GROUP BY item_id"
        return {item: float(at) for item, at in self._db.execute(sql)}

    def question_ids(self) -> list[str]:
        rows = self._db.execute("SELECT DISTINCT question_id FROM labels ORDER BY question_id")
        return [r[0] for r in rows]

    def __len__(self) -> int:
        return int(self._db.execute("SELECT COUNT(*) FROM labels").fetchone()[0])

    def close(self) -> None:
        """Close the connection, releasing the claims this writer still holds (where the
        connection is lost, closing it is what releases them: a gone writer's claim is free)."""
        try:
            if self._claims:
                with suppress(Exception):
                    self.release_all()
        finally:
            self._db.close()

    def release_all(self) -> None:
        with self._transaction(durable=False):
            self._db.execute("DELETE FROM claims WHERE owner = ?", (self._db.owner(),))

    def __enter__(self) -> LabelStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def has_labels(path: StoreLocation | str) -> bool:
    """Whether the store at ``path`` exists and holds a label."""
    location = store_location(path)
    if not exists(location):
        return False
    with LabelStore.open_existing(location) as store:
        return len(store) > 0


@contextmanager
def removed_on_failure(path: StoreLocation | str | Path, only_if_empty: bool = False) -> Iterator[None]:
    """Delete the store at ``path`` again if the block fails and the store did not exist before
    it: a first import that fails must not leave an empty store behind, which a later run would
    take for this teacher's (or refuse as another teacher's). ``only_if_empty``: only where it
    holds no label. Close the store inside the block."""
    location = store_location(path)
    created = not exists(location)
    try:
        yield
    except BaseException:
        if created:
            try:
                if exists(location) and not (only_if_empty and has_labels(location)):
                    drop(location)
            except StoreError:
                pass  # the store cannot be reached now: the block's own error says more
        raise
