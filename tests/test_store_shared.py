"""Many writers on one store, on both backends: claims keep two labelling runs off one item (and a
killed writer's claim is taken over at once), audits take one order that readers never see out of
sequence; and PostgreSQL's own errors (a server that does not answer, refused credentials, no
such database, tables of another program), each one line without the password."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from test_audit import record
from test_store import GGUF, ROOT

from distill.cli import main
from distill.store import (
    LabelStore,
    StoreError,
    StoreUnavailableError,
    StoreURL,
    Teacher,
    removed_on_failure,
    store_location,
)

pytest_plugins = ("pgfixtures",)
Place = Callable[[str], str]
QUESTIONS = {f"q{j}": None for j in range(4)}
TEACHER = Teacher(kind="external", model="writers")

WRITER = """
import sys, time
from distill.store import LabelStore, Teacher
location, items = sys.argv[1], int(sys.argv[2])
questions = {f"q{j}": None for j in range(4)}
with LabelStore(location, Teacher(kind="external", model="writers")) as store:
    print("ready", flush=True)
    sys.stdin.readline()  # every writer starts at once
    for i in range(items):
        item = f"item{i:04d}"
        todo = store.claim(item, questions)
        if todo is None or sys.argv[3] == "hold":
            print("held" if todo is None else f"claimed {item}", flush=True)
            if sys.argv[3] == "hold":
                time.sleep(600)
            continue
        if todo:
            time.sleep(0.002)  # the teacher reads it
            store.put_item(item, {q: {"a": 0.5, "b": 0.5} for q in todo})
            print(item, flush=True)
print("finished", flush=True)
"""


def writer(location: str, items: int, mode: str = "label") -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    process = subprocess.Popen([sys.executable, "-c", WRITER, location, str(items), mode],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    assert process.stdout is not None and process.stdout.readline() == "ready\n"
    return process


def test_two_labelling_runs_on_one_store_never_label_an_item_twice(place: Place) -> None:
    location, items = place("labels.db"), 150
    LabelStore(location, TEACHER).close()
    runs = [writer(location, items) for _ in range(3)]
    for run in runs:
        assert run.stdin is not None
        run.stdin.write("go\n")
        run.stdin.flush()
    outputs = [run.communicate(timeout=300)[0].splitlines() for run in runs]
    assert all(run.returncode == 0 and out[-1] == "finished" for run, out in zip(runs, outputs, strict=True))
    labelled = [set(line for line in out if line.startswith("item")) for out in outputs]
    assert sum(map(len, labelled)) == items, "no item was labelled by two runs"
    assert set().union(*labelled) == {f"item{i:04d}" for i in range(items)}
    with LabelStore.open_existing(location) as store:
        assert len(store) == items * len(QUESTIONS)
        first = store.labelled_at()  # one time per item, on one clock: what a gate cuts at after an alarm
    assert set(first) == set().union(*labelled) and all(isinstance(at, float) for at in first.values())


def test_a_claim_keeps_other_writers_off_until_labelled_released_or_closed(place: Place) -> None:
    location = place("labels.db")
    with LabelStore(location, TEACHER) as first, LabelStore(location, TEACHER) as second:
        assert first.claim("e1", QUESTIONS) == QUESTIONS
        assert second.claim("e1", QUESTIONS) is None, "held by a live writer"
        first.put_item("e1", {"q0": {"a": 1.0}, "q1": {"a": 1.0}})
        assert second.claim("e1", QUESTIONS) == {"q2": None, "q3": None}, "only what is still missing"
        second.put_item("e1", {"q2": {"a": 1.0}, "q3": {"a": 1.0}})
        assert first.claim("e1", QUESTIONS) == {}, "labelled: nothing to claim"
        assert first.claim("e2", QUESTIONS) == QUESTIONS
        first.release("e2")
        assert second.claim("e2", QUESTIONS) == QUESTIONS
        assert first.claim("e3", QUESTIONS) == QUESTIONS
    with LabelStore(location, TEACHER) as third:
        assert third.claim("e3", QUESTIONS) == QUESTIONS, "closing released the claims"


def test_a_killed_writers_claim_is_taken_over_at_once(place: Place) -> None:
    location = place("labels.db")
    LabelStore(location, TEACHER).close()
    holder = writer(location, 1, "hold")
    assert holder.stdin is not None and holder.stdout is not None
    holder.stdin.write("go\n")
    holder.stdin.flush()
    assert holder.stdout.readline() == "claimed item0000\n"
    with LabelStore(location, TEACHER) as store:
        assert store.claim("item0000", QUESTIONS) is None, "its writer is alive"
        holder.send_signal(signal.SIGKILL)
        holder.wait()
        deadline = time.monotonic() + 60  # until the server has seen the connection close
        while (taken := store.claim("item0000", QUESTIONS)) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert taken == QUESTIONS, "not left until the lease (an hour) runs out"


def test_readers_of_the_audit_stream_never_see_it_out_of_order(place: Place) -> None:
    """Three writers append at once; a reader polling meanwhile sees positions 1, 2, 3, ... with
    no gap (a later audit is never visible before an earlier one), and each record once."""
    location, per_writer = place("labels.db"), 40
    LabelStore(location, GGUF).close()
    seen: list[int] = []
    done = threading.Event()

    def write(w: int) -> None:
        with LabelStore(location, GGUF, any_thread=True) as store:
            for n in range(per_writer):
                store.put_audit(record(1000 * w + n).model_copy(update={"item_id": f"audit:{w}:{n}"}))

    def read() -> None:
        with LabelStore(location, GGUF, any_thread=True) as store:
            while True:
                finished = done.is_set()
                for position, _ in store.audits_after(seen[-1] if seen else 0, limit=7):
                    seen.append(position)
                if finished and (not seen or seen[-1] == 3 * per_writer):
                    return

    reader = threading.Thread(target=read)
    reader.start()
    writers = [threading.Thread(target=write, args=(w,)) for w in range(3)]
    for thread in writers:
        thread.start()
    for thread in writers:
        thread.join()
    done.set()
    reader.join(timeout=120)
    assert seen == list(range(1, 3 * per_writer + 1))
    with LabelStore.open_existing(location) as store:
        audits = store.audits()
    assert len({a.item_id for a in audits}) == 3 * per_writer
    for w in range(3):  # each writer's audits in the order it wrote them
        mine = [a.item_id for a in audits if a.item_id.startswith(f"audit:{w}:")]
        assert mine == [f"audit:{w}:{n}" for n in range(per_writer)]


AUDIT_WRITER = """\
import sys
sys.path.insert(0, "tests")
from test_audit import record
from distill.loop.auditing import StoreSink
from distill.store import Teacher
sink = StoreSink(sys.argv[1], Teacher(kind="external", model="tests"))
for n in range(100000):
    sink(record(n))
    if n == 20:
        print("writing", flush=True)
"""


def test_audits_survive_a_sigkill_whole_and_in_one_gapless_order(place: Place) -> None:
    location = place("labels.db")
    writer = subprocess.Popen([sys.executable, "-c", AUDIT_WRITER, location], stdout=subprocess.PIPE,
                              text=True, cwd=ROOT)
    assert writer.stdout is not None and writer.stdout.readline() == "writing\n"
    time.sleep(0.2)
    writer.send_signal(signal.SIGKILL)
    writer.wait()
    with LabelStore.open_existing(location) as store:
        stream = [position for position, _ in store.audits_after(0, limit=100000)]
        audits, labelled = store.audits(), set(store.labels("urgent"))
        counted = store.audit_count()
    assert len(audits) > 20 and {a.item_id for a in audits} == labelled, "no audit without its labels"
    assert counted == len(audits), "the loop's cheap count (cascade loop) is the audits' number"
    assert stream == list(range(1, len(audits) + 1))
    assert [a.item_id for a in audits] == [f"audit:{n}" for n in range(len(audits))], "in the order written"


def test_a_failed_first_import_leaves_no_store(place: Place) -> None:
    location = place("labels.db")
    with pytest.raises(RuntimeError, match="boom"), removed_on_failure(location):
        LabelStore(location, TEACHER).close()
        raise RuntimeError("boom")
    with pytest.raises(StoreError, match="no label store"):
        LabelStore.open_existing(location)


# --- PostgreSQL's own failures: one line each, never the password ---


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def with_password(url: str, password: str) -> str:
    user, rest = url.removeprefix("postgresql://").split("@", 1)
    return f"postgresql://{user.split(':')[0]}:{password}@{rest}"


def test_unreachable_refused_and_missing_are_one_line_without_the_password(postgres_url: str) -> None:
    secret = "s3cret-Pa55"
    cases = {
        f"postgresql://cascade:{secret}@127.0.0.1:{free_port()}/labels":
            r"^cannot reach the PostgreSQL store postgresql://cascade:\*\*\*@127\.0\.0\.1:\d+/labels: .*"
            r"Connection refused.*; check the host and port",
        with_password(postgres_url, secret):
            r"^PostgreSQL refused the credentials for postgresql://cascade:\*\*\*@.*: password "
            r"authentication failed for user \"cascade\"; check the user and password",
        postgres_url.rsplit("/", 1)[0] + "/no_such_db":
            r"^the PostgreSQL server has no database 'no_such_db' for postgresql://cascade:\*\*\*@.*: "
            r"create it",
    }
    for url, message in cases.items():
        for opening in (LabelStore.open_existing, lambda at: LabelStore(at, TEACHER)):
            with pytest.raises(StoreError, match=message) as caught:
                opening(url)
            text = str(caught.value)
            assert "\n" not in text and secret not in text and url not in text
    assert postgres_url.split(":")[2].split("@")[0] not in str(StoreURL(postgres_url)) + repr(
        StoreURL(postgres_url)), "the URL prints without its password"


def test_the_cli_says_it_in_one_line_and_never_prints_the_password(
    postgres_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    secret = "s3cret-Pa55"
    bad = with_password(postgres_url, secret)
    assert main(["label", "--export", str(tmp_path / "out.jsonl"), "--store", bad]) == 2
    out, err = capsys.readouterr()
    assert err.count("\n") == 1 and "StoreError: PostgreSQL refused the credentials" in err
    assert secret not in out + err
    assert main(["label", "--export", str(tmp_path / "out.jsonl"), "--store", postgres_url]) == 2
    assert "no label store at postgresql://cascade:***@" in capsys.readouterr().err


def test_a_database_holding_other_tables_is_not_taken(postgres_url: str) -> None:
    import psycopg

    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute("CREATE TABLE orders (id int)")
    for opening in (LabelStore.open_existing, lambda at: LabelStore(at, TEACHER)):
        with pytest.raises(StoreError, match=r"is not a label store: .* holds other tables \['orders'\]; "
                           "give --store an empty database, or a schema of its own"):
            opening(postgres_url)
    schema = f"{postgres_url}?options=-csearch_path%3Dlabels"
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute("CREATE SCHEMA labels")
    with LabelStore(schema, TEACHER) as store:
        store.put_item("e1", {"q0": {"a": 1.0}})
    with LabelStore.open_existing(schema) as store:
        assert len(store) == 1


def test_a_url_given_as_a_path_is_refused_with_how_to_give_it() -> None:
    with pytest.raises(StoreError, match="was given as a Path, which drops the // of a URL"):
        store_location(Path("postgresql://cascade@127.0.0.1/labels"))
    assert isinstance(store_location("postgres://h/db"), StoreURL)
    assert store_location("labels.sqlite") == Path("labels.sqlite")


def test_a_store_in_another_form_is_refused_without_its_password() -> None:
    """A conninfo or a URL of another scheme was taken as a SQLite file's name and echoed whole,
    password included, in "no label store at ..."; an upper-case scheme is libpq's URL."""
    assert str(store_location(" POSTGRESQL://u:s3cret-pw@h/db")) == "postgresql://u:***@h/db"
    for given, why in (("host=127.0.0.1 port=5432 user=u password=s3cret-pw dbname=labels", "conninfo"),
                       ("postgresql+psycopg://u:s3cret-pw@h/db", "no \\+driver")):
        with pytest.raises(StoreError, match=why) as refused:
            store_location(given)
        assert "s3cret-pw" not in str(refused.value)
    assert store_location("runs/a=b.sqlite") == Path("runs/a=b.sqlite")
    # a URL cut short was a SQLite file named after it, password and all, and echoed whole
    for given in ("postgresql:cascade:s3cret-pw@127.0.0.1:5432", "postgresql//cascade:s3cret-pw@h:5432/s1",
                  "cascade:s3cret-pw@127.0.0.1:5432/s1", "postgresql:/u:s3cret-pw@h/db",
                  "bob:s3cret/pw@127.0.0.1/db", "postgresql//bob:s3cret/pw@h/db",  # a / in the password
                  "bob@127.0.0.1:5432", "bob@dbhost", "127.0.0.1:5432/labels"):  # no password: a file still
        with pytest.raises(StoreError, match="looks like a PostgreSQL URL cut short") as refused:
            store_location(given)
        assert "s3cret" not in str(refused.value)
    with pytest.raises(StoreError, match="has an @ in its user or password: percent-encode it") as refused:
        store_location("postgresql://bob:s3c@ret@127.0.0.1:1/db")  # libpq quoted "ret@127.0.0.1"
    assert "ret" not in str(refused.value).replace("percent", "")
    for path in ("runs/x@y/labels.sqlite", "a@b.sqlite", "runs/v1:2.sqlite", "postgresql-labels.db"):
        assert store_location(path) == Path(path)


def test_a_url_no_retry_can_cure_is_invalid_not_unreachable() -> None:
    """An unencoded space in the password read as "cannot reach ... check the host and port", and
    cascade loop looked again every poll, forever."""
    with pytest.raises(StoreError, match=r"invalid store URL .*unexpected spaces") as refused:
        LabelStore("postgresql://cascade:my secret@127.0.0.1:1/labels", Teacher(kind="external", model="x"))
    assert not isinstance(refused.value, StoreUnavailableError) and "secret" not in str(refused.value)
