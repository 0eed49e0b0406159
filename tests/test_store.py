"""Teacher label store: binding to one teacher, idempotent writes, import/export, kill safety, on
both backends (a SQLite file; a PostgreSQL database on a real server, ``pgfixtures``)."""

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from shlex import quote as shlex_quote
from urllib.parse import urlsplit

import pytest

from cascade.audit.record import AuditRecord, SystemAnswer
from cascade.collect.escalation import EscalationRecord
from cascade.errors import CascadeError
from cascade.questions import parse_request
from distill.labelling.transfer import export_labels, import_labels
from distill.loop.auditing import StoreSink
from distill.loop.escalations import StoreEscalations
from distill.store import InputPolicy, LabelStore, StoreError, StoreMismatchError, Teacher, is_url

GGUF = Teacher(kind="gguf", model="qwen-4b.gguf", model_sha256="a" * 64, prompt_version="v1")
QUESTIONS = parse_request({
    "state": "x",
    "questions": {
        "urgent": {"type": "noul", "instructions": "Urgent?"},
        "team": {"type": "choice", "instructions": "Which team?",
                 "criteria": {"billing": "money", "technical": "bugs", "sales": "deals"}},
        "severity": {"type": "score", "instructions": "How bad?",
                     "criteria": ["minor", "degraded", "blocking"]},
        "digit": {"type": "choice", "instructions": "Which digit?", "criteria": {"1": "", "0": ""}},
    },
}).questions
ROOT = Path(__file__).resolve().parents[1]
Place = Callable[[str], str]
pytest_plugins = ("pgfixtures",)  # place, postgres_url: each test on both backends


@pytest.fixture
def store(place: Place):
    with LabelStore(place("labels.db"), GGUF) as opened:
        yield opened


def sql(location: str, statement: str, params: tuple = ()) -> list[tuple]:
    """Run one statement on a store behind its back (as another program, or an older cascade)."""
    if location.startswith("postgresql://"):
        import psycopg

        with psycopg.connect(location, autocommit=True) as conn:
            cursor = conn.execute(statement.replace("?", "%s"), params)  # type: ignore[arg-type]
            return cursor.fetchall() if cursor.description else []
    conn = sqlite3.connect(location, isolation_level=None)
    try:
        return conn.execute(statement, params).fetchall()
    finally:
        conn.close()


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_create_then_reopen_keeps_labels_and_teacher(place: Place) -> None:
    path = place("labels.db")
    with LabelStore(path, GGUF) as store:
        store.put_item("e1", {"urgent": {"true": 0.8, "false": 0.2}}, {"urgent": "h1"})
    with LabelStore(path, GGUF) as store:
        assert store.labels("urgent") == {"e1": {"true": 0.8, "false": 0.2}}
        assert store.question_ids() == ["urgent"]
        assert [label.prompt_hash for label in store.iter_labels()] == ["h1"]
    with LabelStore.open_existing(path) as store:
        assert store.teacher == GGUF
        assert len(store) == 1
    if not is_url(store.path):
        assert sql(path, "PRAGMA journal_mode") == [("wal",)]


@pytest.mark.parametrize("field, value", [
    ("kind", "external"), ("model", "other.gguf"), ("model_sha256", "b" * 64),
    ("prompt_version", "v2"),
])
def test_store_of_another_teacher_is_refused(place: Place, field: str, value: str) -> None:
    LabelStore(place("labels.db"), GGUF).close()
    other = Teacher.model_validate({**GGUF.model_dump(), field: value})
    with pytest.raises(StoreMismatchError, match=f"{field}.*new --store path") as caught:
        LabelStore(place("labels.db"), other)
    assert isinstance(caught.value, CascadeError) and isinstance(caught.value, ValueError)


def test_gguf_teacher_needs_sha256_and_prompt_version() -> None:
    with pytest.raises(ValueError, match="model_sha256"):
        Teacher(kind="gguf", model="m.gguf", prompt_version="v1")
    assert Teacher(kind="external", model="gold labels").model_sha256 is None


def test_missing_and_foreign_files_are_refused(tmp_path: Path) -> None:
    with pytest.raises(StoreError, match="no label store"):
        LabelStore.open_existing(tmp_path / "absent.db")
    (tmp_path / "dir.sqlite").mkdir()  # said "no label store ... label a corpus first"
    for opening in (lambda: LabelStore.open_existing(tmp_path / "dir.sqlite"),
                    lambda: LabelStore(tmp_path / "dir.sqlite", GGUF)):
        with pytest.raises(StoreError, match="is a folder, not a label store file"):
            opening()
    (tmp_path / "text.db").write_text("not a database at all, just some text" * 100)
    sqlite3.connect(tmp_path / "other.db").execute("CREATE TABLE t (x)")
    for name in ("text.db", "other.db"):
        with pytest.raises(StoreError, match="not a label store"):
            LabelStore.open_existing(tmp_path / name)
        with pytest.raises(StoreError, match="not a label store"):
            LabelStore(tmp_path / name, GGUF)
    assert sqlite3.connect(tmp_path / "other.db").execute(
        "SELECT name FROM sqlite_master").fetchall() == [("t",)], "foreign file left untouched"


def test_read_only_store_refuses_writes(place: Place) -> None:
    LabelStore(place("labels.db"), GGUF).close()
    with LabelStore.open_existing(place("labels.db")) as store, \
            pytest.raises(StoreError, match="read-only"):
        store.put_item("e1", {"urgent": {"true": 1.0, "false": 0.0}})


def test_done_items_needs_every_question(store: LabelStore) -> None:
    store.put_item("e1", {"urgent": {"true": 1.0, "false": 0.0}, "team": {"billing": 1.0}})
    store.put_item("e2", {"urgent": {"true": 0.0, "false": 1.0}})
    assert store.done_items(["urgent"]) == {"e1", "e2"}
    assert store.done_items(["urgent", "team"]) == {"e1"}
    assert store.done_items(["severity"]) == set()
    assert store.labels("team") == {"e1": {"billing": 1.0}}


def test_identical_reput_is_idempotent_and_a_different_one_refused(store: LabelStore) -> None:
    labels = {"urgent": {"true": 0.3, "false": 0.7}}
    store.put_item("e1", labels)
    store.put_item("e1", labels)
    assert len(store) == 1
    with pytest.raises(StoreError, match="different labels"):
        store.put_item("e1", {"team": {"billing": 1.0}, "urgent": {"true": 0.4, "false": 0.6}})
    assert store.question_ids() == ["urgent"], "a refused item writes none of its labels"


def test_put_item_rejects_non_distributions(store: LabelStore) -> None:
    for bad in ({"true": 0.7, "false": 0.7}, {"true": float("nan"), "false": 1.0},
                {"true": -0.5, "false": 1.5}, {}):
        with pytest.raises(StoreError, match="labels\\['urgent'\\]"):
            store.put_item("e1", {"urgent": bad})
    assert len(store) == 0


@pytest.mark.parametrize("stored", ["[1, 2]", "null", "{not json", "{}", '{"true": NaN, "false": 1.0}'])
def test_a_label_changed_outside_cascade_is_named_as_damage(place: Place, stored: str) -> None:
    """Export, evaluate and training read it: a ValidationError, KeyError or JSONDecodeError
    traceback, an empty max(), or a NaN written into the export."""
    location = place("labels.db")
    with LabelStore(location, GGUF) as store:
        store.put_item("e1", {"urgent": {"true": 0.25, "false": 0.75}})
    sql(location, "UPDATE labels SET probabilities = ?", (stored,))
    with LabelStore.open_existing(location) as opened:
        with pytest.raises(StoreError, match=r"the label of 'e1' for 'urgent' in .* is damaged"):
            opened.labels("urgent")
        with pytest.raises(StoreError, match="changed outside cascade"):
            list(opened.iter_labels())


def test_a_collected_request_changed_outside_cascade_is_named_as_damage(place: Place) -> None:
    """One bad row made the whole store unreadable by ``cascade collected``: a traceback."""
    from cascade.collect.record import CollectedItem
    from cascade.teachers.identity import EndpointIdentity

    location = place("labels.db")
    with LabelStore(location, GGUF) as store:
        store.put_traffic(CollectedItem(request_id="r1", state="help", identity=EndpointIdentity(), at=1.0,
                                        questions={"u": {"type": "noul", "instructions": "Is it?"}},
                                        answers={"u": {"true": 1.0, "false": 0.0}}))
    for column, value in (("state", "{bad"), ("questions", "[1]"), ("inclusion", -5)):
        sql(location, f"UPDATE traffic SET {column} = ?", (value,))
        with LabelStore.open_existing(location) as opened, \
                pytest.raises(StoreError, match=r"the collected request 'r1' in .* is damaged"):
            opened.traffic_after(0)


def test_import_hard_and_soft_rows_of_each_type(store: LabelStore, tmp_path: Path) -> None:
    rows = [
        {"id": "e1", "question": "urgent", "answer": True},
        {"id": "e1", "question": "team", "answer": "technical"},
        {"id": "e1", "question": "severity", "answer": 2},
        {"id": "e2", "question": "urgent", "probabilities": {"true": 0.25, "false": 0.75}},
        {"id": "e2", "question": "team",
         "probabilities": {"billing": 0.2, "technical": 0.2, "sales": 0.6004}},
        {"id": "e2", "question": "severity", "probabilities": {"0": 0.5, "1": 0.3, "2": 0.2}},
    ]
    summary = import_labels(store, write_jsonl(tmp_path / "in.jsonl", rows), QUESTIONS)
    assert (summary.rows, summary.imported, summary.skipped) == (6, 6, 0)
    assert store.labels("urgent") == {"e1": {"true": 1.0, "false": 0.0},
                                      "e2": {"true": 0.25, "false": 0.75}}
    assert store.labels("severity")["e1"] == {"0": 0.0, "1": 0.0, "2": 1.0}
    team = store.labels("team")
    assert team["e1"] == {"billing": 0.0, "technical": 1.0, "sales": 0.0}
    assert sum(team["e2"].values()) == pytest.approx(1.0, abs=1e-12), "renormalised"
    assert store.done_items(["urgent", "team", "severity"]) == {"e1", "e2"}


@pytest.mark.parametrize("bad_row, message", [
    ("{not json", "not valid JSON"),
    ({"id": "e9", "question": "colour", "answer": True}, "unknown question 'colour'"),
    ({"id": "e9", "question": "urgent", "answer": "yes"}, "true or false"),
    ({"id": "e9", "question": "team", "answer": "legal"}, "one of \\['billing'"),
    ({"id": "e9", "question": "severity", "answer": 3}, "level 0..2"),
    ({"id": "e9", "question": "severity", "answer": True}, "level 0..2"),
    ({"id": "e9", "question": "urgent", "probabilities": {"yes": 1.0}}, "exactly \\['true'"),
    ({"id": "e9", "question": "urgent", "probabilities": {"true": 0.9, "false": 0.9}}, "sum"),
    ({"id": "e9", "question": "urgent", "probabilities": {"true": 2, "false": -1}}, "in \\[0, 1\\]"),
    ({"id": "e9", "question": "urgent", "answer": False,
      "probabilities": {"true": 0.9, "false": 0.1}}, "not a most probable"),
    ({"id": "e9", "question": "urgent"}, "needs 'answer' or 'probabilities'"),
    ({"id": "", "question": "urgent", "answer": True}, "'id'"),
    ({"id": "e1", "question": "urgent", "answer": False}, "contradicts line 1"),
])
def test_bad_row_names_file_and_line(
    store: LabelStore, tmp_path: Path, bad_row: object, message: str
) -> None:
    good = {"id": "e1", "question": "urgent", "answer": True}
    path = write_jsonl(tmp_path / "in.jsonl", [good, {**good, "id": "e2"}, bad_row])
    with pytest.raises(StoreError, match=f"in.jsonl:3: .*{message}"):
        import_labels(store, path, QUESTIONS)
    assert len(store) == 0, "a file with a bad row writes nothing in stop mode"


def test_skip_mode_counts_and_reports_bad_rows(store: LabelStore, tmp_path: Path) -> None:
    store.put_item("old", {"urgent": {"true": 1.0, "false": 0.0}})
    rows = [
        {"id": "e1", "question": "urgent", "answer": True},
        "[]",
        {"id": "e1", "question": "team", "answer": "nobody"},
        "",
        {"id": "old", "question": "urgent", "answer": False},
        {"id": "e2", "question": "severity", "answer": 0},
        {"id": "e2", "question": "severity", "answer": 0},
    ]
    summary = import_labels(store, write_jsonl(tmp_path / "in.jsonl", rows), QUESTIONS, "skip")
    assert (summary.rows, summary.imported, summary.skipped) == (6, 3, 3)
    assert [line for line, _ in summary.errors] == [2, 3, 5]
    assert "different labels" in summary.errors[2][1]
    assert store.labels("urgent")["old"] == {"true": 1.0, "false": 0.0}
    assert len(store) == 3


def test_export_then_import_round_trips(place: Place, tmp_path: Path) -> None:
    with LabelStore(place("a.db"), GGUF) as source:
        source.put_item("e1", {"urgent": {"true": 0.1, "false": 0.9},
                               "team": {"billing": 0.2, "technical": 0.5, "sales": 0.3},
                               "severity": {"0": 0.1, "1": 0.2, "2": 0.7}})
        source.put_item("e2", {"urgent": {"true": 2 / 3, "false": 1 / 3},
                               "severity": {"0": 0.4, "1": 0.4, "2": 0.2},
                               "digit": {"1": 0.3, "0": 0.7}})
        assert export_labels(source, tmp_path / "out.jsonl") == 6
        expected = {q: source.labels(q) for q in QUESTIONS}
    rows = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert {(r["question"], r["answer"]) for r in rows if r["id"] == "e1"} == {
        ("urgent", False), ("team", "technical"), ("severity", 2)}
    with LabelStore(place("b.db"), Teacher(kind="external", model="copy")) as copy:
        summary = import_labels(copy, tmp_path / "out.jsonl", QUESTIONS)
        assert summary.imported == 6
        for qid, items in expected.items():
            assert copy.labels(qid).keys() == items.keys()
            for item, probs in items.items():
                assert copy.labels(qid)[item] == pytest.approx(probs, rel=1e-12)


KILL_SCRIPT = """
import sys
from pathlib import Path
from distill.store import LabelStore, Teacher

path, items, gated = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "gated"
questions = [f"q{j}" for j in range(8)]
with LabelStore(path, Teacher(kind="external", model="kill test")) as store:
    done = store.done_items(questions)
    for i in range(items):
        if gated:
            sys.stdin.readline()
        item = f"item{i:04d}"
        if item not in done:
            store.put_item(item, {q: {"a": 0.25, "b": 0.75} for q in questions})
            print(item, flush=True)
print("finished", flush=True)
"""


def run_writer(path: str, items: int, gated: bool) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [sys.executable, "-c", KILL_SCRIPT, str(path), str(items), "gated" if gated else "free"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
    )


def per_item(path: str) -> dict[str, int]:
    """Labels stored per item."""
    return dict(sql(path, "SELECT item_id, COUNT(*) FROM labels GROUP BY item_id"))


def test_sigkill_mid_run_loses_nothing_committed_and_resumes(place: Place) -> None:
    """Only `released` items may start before the kill, so it lands before the run can end."""
    path, total, released = place("labels.db"), 200, 120
    sqlite = not path.startswith("postgresql://")
    writer = run_writer(path, total, gated=True)
    assert writer.stdin is not None and writer.stdout is not None
    writer.stdin.write("go\n" * released)
    writer.stdin.flush()
    reported = [writer.stdout.readline().strip() for _ in range(5)]
    writer.send_signal(signal.SIGKILL)
    assert writer.wait() == -signal.SIGKILL
    writer.stdin.close()
    writer.stdout.close()

    assert not sqlite or sql(path, "PRAGMA integrity_check") == [("ok",)]
    stored = per_item(path)
    assert set(stored.values()) == {8}, "every item is whole or absent"
    assert set(reported) <= set(stored), "every reported (committed) item survived"
    assert len(stored) <= released < total

    second = run_writer(path, total, gated=False)
    out, _ = second.communicate()
    assert second.returncode == 0 and out.splitlines()[-1] == "finished"
    assert len(out.splitlines()) - 1 == total - len(stored), "done items were skipped"
    with LabelStore.open_existing(path) as store:
        assert len(store) == total * 8
        assert store.done_items([f"q{j}" for j in range(8)]) == {
            f"item{i:04d}" for i in range(total)}
    assert not sqlite or sql(path, "PRAGMA integrity_check") == [("ok",)]
    distinct = "SELECT COUNT(*) FROM (SELECT DISTINCT item_id, question_id FROM labels) AS pairs"
    assert sql(path, distinct) == [(total * 8,)]


def test_the_input_policy_is_recorded_once_and_another_refused(place: Place) -> None:
    path = place("labels.db")
    policy = InputPolicy(n_ctx=512, excerpt="head_tail:256")
    with LabelStore(path, GGUF, policy=policy) as store:
        store.put_item("e1", {"urgent": {"true": 0.8, "false": 0.2}}, {}, {"urgent": 0.91})
    with LabelStore(path, GGUF, policy=policy) as store:  # the same policy resumes
        assert store.policy == policy and store.letter_masses("urgent") == {"e1": 0.91}
    for other in (InputPolicy(n_ctx=4096, excerpt="head_tail:256"), InputPolicy(n_ctx=512)):
        with pytest.raises(StoreMismatchError, match=r"read with n_ctx 512, excerpt head_tail:256; "
                           rf"this run reads with {other}"):
            LabelStore(path, GGUF, policy=other)
    with LabelStore(path, GGUF) as store:  # a reader that names no policy gets the store's
        assert store.policy == policy
    with LabelStore.open_existing(path) as store:
        assert store.policy == policy


def test_a_schema_1_store_is_read_as_it_is_and_upgraded_when_written(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    with sqlite3.connect(path) as db:  # the schema-1 layout, as an earlier cascade wrote it
        db.executescript("""
            CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT);
            CREATE TABLE labels (item_id TEXT NOT NULL, question_id TEXT NOT NULL,
                probabilities TEXT NOT NULL, prompt_hash TEXT, created_at REAL NOT NULL,
                PRIMARY KEY (item_id, question_id)) WITHOUT ROWID;""")
        db.executemany("INSERT INTO meta VALUES (?, ?)", [
            ("schema_version", "1"), ("teacher_kind", "gguf"), ("teacher_model", GGUF.model),
            ("teacher_model_sha256", GGUF.model_sha256), ("teacher_prompt_version", "v1")])
        db.execute("INSERT INTO labels VALUES ('e1', 'urgent', '{\"true\": 1.0, \"false\": 0.0}', NULL, 1.0)")
    db.close()
    with LabelStore.open_existing(path) as store:
        assert store.labels("urgent") == {"e1": {"true": 1.0, "false": 0.0}}
        assert store.letter_masses("urgent") == {} and store.policy is None
    with LabelStore(path, GGUF, policy=InputPolicy(n_ctx=4096)) as store:
        store.put_item("e2", {"urgent": {"true": 0.0, "false": 1.0}}, {}, {"urgent": 0.5})
        assert store.letter_masses("urgent") == {"e2": 0.5} and len(store) == 2
    assert sql(str(path), "SELECT value FROM meta WHERE key='schema_version'") == [("3",)]


def test_a_store_of_another_schema_version_is_refused_on_open(place: Place) -> None:
    path = place("labels.db")
    LabelStore(path, GGUF).close()
    sql(path, "UPDATE meta SET value='99' WHERE key='schema_version'")
    with pytest.raises(StoreError, match=r"schema version '99'.*made by a newer cascade, upgrade this one"):
        LabelStore.open_existing(path)
    with pytest.raises(StoreError, match="made by a newer cascade"):
        LabelStore(path, GGUF)
    sql(path, "UPDATE meta SET value='0' WHERE key='schema_version'")
    with pytest.raises(StoreError, match=r"schema version '0'.*Relabel into a new --store path"):
        LabelStore(path, GGUF)


def test_escalations_keep_labels_and_state_in_one_row_apart_from_the_audits(place: Place) -> None:
    path = place("labels.db")
    with LabelStore(path, GGUF) as store:  # a store made before the table reads as holding none
        assert store.escalation_count() == 0 and store.escalations_after(0) == []
        for n in range(3):
            store.put_escalation(EscalationRecord(
                item_id=f"escalation:r{n}.x", request_id=f"r{n}", state=f"state {n}", calibration_version="v",
                at=1.0 + n, teacher={"team": {"billing": 0.7, "technical": 0.2, "sales": 0.1}},
                prompt_hashes={"team": "h"}))
        with pytest.raises(StoreError, match="already has different labels"):  # never changed silently
            store.put_escalation(EscalationRecord(
                item_id="escalation:r0.x", request_id="r0", state="state 0", calibration_version="v", at=9.0,
                teacher={"team": {"billing": 0.1, "technical": 0.2, "sales": 0.7}}))
    with LabelStore.open_existing(path) as store:
        kept = store.escalations_after(0)
        assert [seq for seq, _ in kept] == [1, 2, 3] and store.escalation_count() == 3
        assert kept[2][1].state == "state 2" and kept[2][1].prompt_hashes == {"team": "h"}
        assert kept[0][1].teacher == {"team": {"billing": 0.7, "technical": 0.2, "sales": 0.1}}
        assert store.escalations_after(2, limit=5)[0][1].request_id == "r2"
        assert store.audits() == [] and set(store.labels("team")) == {f"escalation:r{n}.x" for n in range(3)}


def test_an_escalation_keeps_its_census_questions_and_an_older_table_gains_the_column(place: Place) -> None:
    """Which questions routing sent up whatever the item: kept with the row, read back; a table
    an older cascade made (without the column) reads its rows as no census, and takes the column
    on its next write."""
    def escalation(n: int, census: tuple[str, ...] = ()) -> EscalationRecord:
        return EscalationRecord(item_id=f"escalation:r{n}.x", request_id=f"r{n}", state=f"state {n}",
                                calibration_version="v", at=1.0 + n, census=census,
                                teacher={"team": {"billing": 0.7, "technical": 0.2, "sales": 0.1}})

    path = place("labels.db")
    with LabelStore(path, GGUF) as store:
        store.put_escalation(escalation(0))
    sql(path, "DROP TABLE escalations")  # as the older cascade made it: no census column
    sql(path, "CREATE TABLE escalations (seq BIGINT PRIMARY KEY, item_id TEXT NOT NULL UNIQUE, request_id "
              "TEXT NOT NULL, state TEXT NOT NULL, calibration_version TEXT NOT NULL, created_at DOUBLE "
              "PRECISION NOT NULL)")
    sql(path, "INSERT INTO escalations VALUES (1, 'escalation:r0.x', 'r0', '\"state 0\"', 'v', 1.0)")
    with LabelStore.open_existing(path) as store:  # read-only: the missing column reads as none
        assert [record.census for _, record in store.escalations_after(0)] == [()]
    with LabelStore(path, GGUF) as store:
        store.put_escalation(escalation(1, ("team",)))
        store.put_escalation(escalation(2, ("urgent",)))  # a question it does not hold: not a census
        kept = [record for _, record in store.escalations_after(0)]
    assert [record.census for record in kept] == [(), ("team",), ("urgent",)]
    assert [record.is_census for record in kept] == [False, True, False]


def end_sessions(server: str, database_url: str) -> int:
    """End every session on ``database_url``'s database from the server's side, as a restart or a
    failover does, and wait until they are gone; how many there were."""
    import psycopg

    name = urlsplit(database_url).path.lstrip("/")
    with psycopg.connect(server, autocommit=True) as conn:
        ended = conn.execute("SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                             "WHERE datname = %s AND pid <> pg_backend_pid()", (name,)).fetchone()
        for _ in range(500):
            if not conn.execute("SELECT 1 FROM pg_stat_activity WHERE datname = %s", (name,)).fetchall():
                break
            time.sleep(0.01)
    return int(ended[0]) if ended else 0


def test_a_server_s_store_writers_reconnect_after_postgresql_ends_their_sessions(
        postgres_url: str, postgres_server: str) -> None:
    """A real fault, not a mock: the database server ends the sessions of a running server's audit
    and escalation writers. Each writer's next call fails with one StoreError (that item is lost;
    the server counts it as failed) and the call after reconnects; nothing else is lost."""
    audits, kept = StoreSink(postgres_url, GGUF), StoreEscalations(postgres_url, GGUF)
    teacher = {"team": {"billing": 0.7, "technical": 0.2, "sales": 0.1}}

    def audit(n: int) -> AuditRecord:
        return AuditRecord(item_id=f"audit:{n}", state=f"state {n}", calibration_version="v", at=float(n),
                           teacher=teacher, system={"team": SystemAnswer(answer="billing", tier="encoder")})

    def escalation(n: int) -> EscalationRecord:
        return EscalationRecord(item_id=f"escalation:r{n}.x", request_id=f"r{n}", state=f"state {n}",
                                calibration_version="v", at=float(n), teacher=teacher)
    try:
        audits(audit(0))
        kept.append(escalation(0))
        assert end_sessions(postgres_server, postgres_url) >= 2  # one connection per writer
        for write in (lambda: audits(audit(1)), lambda: kept.append(escalation(1))):
            with pytest.raises(StoreError, match=r"the PostgreSQL store .* failed: .*run again"):
                write()
        audits(audit(2))
        kept.append(escalation(2))
        assert [record.item_id for _, record in audits.read_after(0)] == ["audit:0", "audit:2"]
        assert kept.count() == 2
    finally:
        audits.close()
        kept.close()
    with LabelStore.open_existing(postgres_url) as store:
        assert [record.request_id for _, record in store.escalations_after(0)] == ["r0", "r2"]


def test_a_store_on_a_read_only_mount_is_said_to_be_one(tmp_path: Path) -> None:
    """SQLite must make the -shm file beside a WAL store even to read it: on a read-only mount the
    store was called "not a label store". Run for real under a private read-only bind mount
    (``unshare -m``, root only), where the mount can be made."""
    (tmp_path / "src").mkdir()
    with LabelStore(tmp_path / "src" / "labels.sqlite", GGUF) as store:
        store.put_item("e1", {"q0": {"a": 1.0}})
    (tmp_path / "ro").mkdir()
    opened = ("from distill.store import LabelStore\n"
              f"LabelStore.open_existing({str(tmp_path / 'ro' / 'labels.sqlite')!r})")
    script = f"mount --bind -o ro {tmp_path / 'src'} {tmp_path / 'ro'} || exit 77\n" \
             f"exec {sys.executable} -c {shlex_quote(opened)}"
    try:
        done = subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True, text=True,
                              timeout=60)
    except FileNotFoundError:
        pytest.skip("no unshare here")
    if done.returncode == 77 or "unshare failed" in done.stderr or "Operation not permitted" in done.stderr:
        pytest.skip("a private read-only mount cannot be made here (not root)")
    assert "folder must be writable by this user" in done.stderr, done.stderr[-800:]
    assert "not a label store" not in done.stderr
