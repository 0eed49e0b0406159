"""Labelling on a local Ray cluster (2 CPUs, started here): the labels of single-process labelling,
resumable, and exact when the driver or an actor is killed mid-run."""

from __future__ import annotations

import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_label import QUESTIONS, ROOT, stored_rows, write_corpus, write_questions

from cascade.errors import InputTooLongError
from cascade.readout.scorer import Scorer
from distill.cli import main
from distill.labelling.gguf import label_corpus, open_teacher, teacher_of, teacher_of_file
from distill.labelling.on_ray import (
    RayOptions,
    TeacherActor,
    TeacherSpec,
    label_on_ray,
)
from distill.store import LabelStore, StoreMismatchError

pytest.importorskip(  # Ray Data, not Ray alone: the ray-serve extra brings Ray without it
    "ray.data", reason="labelling on Ray is an optional extra: pip install -e '.[ray]' (.ci/run "
    "installs it and runs this file)")
import ray

PATH_TOLERANCE = 0.15  # BENCHMARKS.md, "Decode paths: measured tolerance": max |dp| 0.09 on gemma
CLEAR_MARGIN = 0.3  # the argmax must agree wherever the top two are further apart than this
LONG_ITEM = json.dumps({"id": "long", "text": "The refund is late again. " * 300})
ACTOR_TITLE = "MapBatches(TeacherActor)"
pytest_plugins = ("pgfixtures",)  # postgres_url: a fresh database on a real server


@pytest.fixture(scope="module")
def cluster() -> Iterator[str]:
    """A local Ray cluster of 2 CPUs owned by this process; its address lets other drivers in."""
    ray.init(num_cpus=2, include_dashboard=False)
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def teacher(gemma_path: Path) -> Iterator[Scorer]:
    scorer = open_teacher(gemma_path, QUESTIONS, n_ctx=1024, n_threads=1)
    yield scorer
    scorer.close()


def spec_of(model: Path) -> TeacherSpec:
    return TeacherSpec(model_path=model, questions=dict(QUESTIONS), n_ctx=1024)


def label_ray(model: Path, corpus: Path, store_path: Path, actors: int = 2, **kwargs):
    with LabelStore(store_path, teacher_of_file(model)) as store:
        return label_on_ray(spec_of(model), corpus, store, RayOptions(actors=actors, batch_size=2),
                            progress=False, **kwargs)


def stored(path: Path) -> dict[tuple[str, str], tuple[dict[str, float], str | None]]:
    with LabelStore.open_existing(path) as store:
        return {(r.item_id, r.question_id): (r.probabilities, r.prompt_hash) for r in store.iter_labels()}


def assert_same_labels(got: dict[str, float], want: dict[str, float]) -> None:
    assert list(got) == list(want)
    for key in want:
        assert got[key] == pytest.approx(want[key], abs=PATH_TOLERANCE)
    top, second = sorted(want.values(), reverse=True)[:2]
    if top - second > CLEAR_MARGIN:
        assert max(got, key=got.__getitem__) == max(want, key=want.__getitem__)


def test_ray_labels_are_single_process_labels_and_a_rerun_labels_nothing(
    cluster: str, gemma_path: Path, teacher: Scorer, tmp_path: Path
) -> None:
    corpus = write_corpus(tmp_path / "c.jsonl", extra=("{oops", LONG_ITEM))
    on_ray = label_ray(gemma_path, corpus, tmp_path / "ray.sqlite", on_error="skip")
    with LabelStore(tmp_path / "one.sqlite", teacher_of(teacher)) as store:
        here = label_corpus(teacher, QUESTIONS, corpus, store, on_error="skip", progress=False)
    assert (on_ray.items, on_ray.labelled, on_ray.skipped_done) == (here.items, here.labelled, 0) == (7, 6, 0)
    assert sorted((b.line, b.item_id) for b in on_ray.bad_lines) == [(7, None), (8, "long")]
    assert sorted(map(str, on_ray.bad_lines)) == sorted(map(str, here.bad_lines))

    got, want = stored(tmp_path / "ray.sqlite"), stored(tmp_path / "one.sqlite")
    assert sorted(got) == sorted(want) == sorted((f"e{i:02d}", q) for i in range(6) for q in QUESTIONS)
    for key, (probabilities, prompt_hash) in want.items():
        assert_same_labels(got[key][0], probabilities)
        assert got[key][1] == prompt_hash
    with LabelStore.open_existing(tmp_path / "ray.sqlite") as ray_store, \
            LabelStore.open_existing(tmp_path / "one.sqlite") as one_store:  # texts: the driver's commit
        assert ray_store.text_hashes() == one_store.text_hashes() and len(one_store.text_hashes()) == 6

    again = label_ray(gemma_path, corpus, tmp_path / "ray.sqlite", on_error="skip")
    assert (again.items, again.labelled, again.skipped_done, len(again.bad_lines)) == (7, 0, 6, 2)
    assert stored(tmp_path / "ray.sqlite") == got


def test_an_over_long_item_stops_the_run_in_stop_mode(cluster: str, gemma_path: Path, tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "c.jsonl", n=2, extra=(LONG_ITEM,))
    with pytest.raises(InputTooLongError, match=r"c.jsonl:3: item 'long' is too long: .*head_tail"):
        label_ray(gemma_path, corpus, tmp_path / "s.sqlite", actors=1)
    with LabelStore.open_existing(tmp_path / "s.sqlite") as store:
        assert len(store) == len(store.done_items(QUESTIONS)) * len(QUESTIONS), "items are whole"


def test_another_teachers_store_is_refused_on_the_driver_and_on_every_actor(
    gemma_path: Path, tmp_path: Path
) -> None:
    other_model = tmp_path / "other.gguf"
    other_model.write_bytes(b"another teacher")
    corpus = write_corpus(tmp_path / "c.jsonl", n=2)
    with LabelStore(tmp_path / "s.sqlite", teacher_of_file(other_model)) as store, \
            pytest.raises(StoreMismatchError, match=r"belongs to teacher .*, not to .*gemma"):
        label_on_ray(spec_of(gemma_path), corpus, store, RayOptions(), progress=False)
    with pytest.raises(StoreMismatchError, match=r"on this Ray node is teacher .* every node"):
        TeacherActor(spec_of(gemma_path), teacher_of_file(other_model), str(corpus))


def test_an_actor_failure_is_one_line_and_leaves_no_empty_store(
    cluster: str, tmp_path: Path, capsys
) -> None:
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF, then nothing a model holds")
    assert main([*cli_argv(tmp_path, broken, cluster, 2), "--actors", "1"]) == 2
    err = capsys.readouterr().err
    assert ("RayLabelError: a Ray actor failed: cascade.errors.ModelError: llama.cpp could not load "
            f"{broken}") in err
    assert "run the same command again" in err
    assert not (tmp_path / "s.sqlite").exists(), "a rerun with a repaired file is not refused"


def test_cli_names_an_address_nothing_answers_on(gemma_path: Path, tmp_path: Path) -> None:
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{free.getsockname()[1]}"
    done = subprocess.run([sys.executable, "-m", "distill.cli", *cli_argv(tmp_path, gemma_path, address, 2)],
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True)
    assert done.returncode == 2
    assert f"RayLabelError: cannot connect to a Ray cluster at '{address}': nothing answers" in done.stderr
    assert "ray start --head" in done.stderr


def cli_argv(tmp_path: Path, model: Path, address: str, n: int) -> list[str]:
    return ["label", "--questions", str(write_questions(tmp_path / "q.json")),
            "--corpus", str(write_corpus(tmp_path / "c.jsonl", n=n)), "--store",
            str(tmp_path / "s.sqlite"), "--teacher", str(model), "--n-ctx", "1024", "--threads", "1",
            "--ray", address, "--batch-size", "2"]


def start_cli(argv: list[str], logs: Path) -> subprocess.Popen:
    """The CLI in its own process, its output in files (Ray's logs could fill a pipe and block)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with open(logs / "out.txt", "w") as out, open(logs / "err.txt", "w") as err:
        return subprocess.Popen([sys.executable, "-m", "distill.cli", *argv], env=env, text=True,
                                stdout=out, stderr=err, stdin=subprocess.DEVNULL)


def wait_for_rows(process: subprocess.Popen, path: Path, rows: int, logs: Path) -> None:
    while stored_rows(path) < rows:
        assert process.poll() is None, f"the run ended before {rows} rows: {(logs / 'err.txt').read_text()}"
        time.sleep(0.05)


def rows_per_item(path: Path) -> dict[str, int]:
    conn = sqlite3.connect(path)
    try:
        return dict(conn.execute("SELECT item_id, COUNT(*) FROM labels GROUP BY item_id"))
    finally:
        conn.close()


def test_a_killed_driver_resumes_with_every_item_once(
    cluster: str, gemma_path: Path, tmp_path: Path, capsys
) -> None:
    n, store = 16, tmp_path / "s.sqlite"
    argv = cli_argv(tmp_path, gemma_path, cluster, n)
    killed = start_cli([*argv, "--actors", "2"], tmp_path)
    wait_for_rows(killed, store, 3 * len(QUESTIONS), tmp_path)
    killed.send_signal(signal.SIGKILL)
    assert killed.wait(timeout=60) == -signal.SIGKILL
    before = stored(store)
    assert len(before) == len({item for item, _ in before}) * len(QUESTIONS), "items are whole"

    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"labelled {n - len(before) // len(QUESTIONS)} items, "
                          f"{len(before) // len(QUESTIONS)} already done, 0 bad")
    assert rows_per_item(store) == {f"e{i:02d}": len(QUESTIONS) for i in range(n)}
    after = stored(store)
    assert {key: after[key] for key in before} == before


def actor_processes() -> list[int]:
    """Pids of the teacher actors of this process's cluster: its descendants titled by Ray."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], list(children.get(os.getpid(), []))
    while todo:
        pid = todo.pop()
        todo.extend(children.get(pid, []))
        try:
            title = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if title.startswith("ray::") and ACTOR_TITLE in title:
            found.append(pid)
    return found


def test_a_killed_actor_loses_and_duplicates_nothing(
    cluster: str, gemma_path: Path, tmp_path: Path
) -> None:
    n, store = 16, tmp_path / "s.sqlite"
    run = start_cli([*cli_argv(tmp_path, gemma_path, cluster, n), "--actors", "2"], tmp_path)
    wait_for_rows(run, store, 2 * len(QUESTIONS), tmp_path)
    actors = actor_processes()
    assert actors, "the run's teacher actors are this cluster's processes"
    os.kill(actors[0], signal.SIGKILL)
    assert run.wait(timeout=600) == 0, (tmp_path / "err.txt").read_text()
    assert f"labelled {n} items, 0 already done, 0 bad" in (tmp_path / "out.txt").read_text()
    assert rows_per_item(store) == {f"e{i:02d}": len(QUESTIONS) for i in range(n)}


def test_into_postgresql_actors_write_straight_and_a_killed_one_loses_and_duplicates_nothing(
    cluster: str, gemma_path: Path, tmp_path: Path, postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The driver's own writes are refused here (its actors are other processes, not patched): the
    labels can only have come from the actors. An actor killed mid-run leaves its item to the
    retry (its claim dies with its connection), and a second run labels nothing."""
    import psycopg

    def rows() -> int:
        with psycopg.connect(postgres_url) as conn:
            return int(conn.execute("SELECT COUNT(*) FROM labels").fetchone()[0])

    killed: list[int] = []

    def kill_an_actor() -> None:
        while rows() < 2 * len(QUESTIONS):
            time.sleep(0.05)
        killed.append(actor_processes()[0])
        os.kill(killed[0], signal.SIGKILL)

    n = 12
    corpus = write_corpus(tmp_path / "c.jsonl", n=n)
    LabelStore(postgres_url, teacher_of_file(gemma_path)).close()
    monkeypatch.setattr(LabelStore, "put_item", lambda *_: pytest.fail("the driver wrote a label"))
    killer = threading.Thread(target=kill_an_actor, daemon=True)
    killer.start()
    first = label_ray(gemma_path, corpus, postgres_url)
    killer.join(timeout=1)
    assert killed, "an actor was killed while the run went on"
    assert (first.items, first.labelled + first.skipped_done, first.left) == (n, n, 0)
    with LabelStore.open_existing(postgres_url) as store:
        labels = {qid: store.labels(qid) for qid in QUESTIONS}
        assert len(store) == n * len(QUESTIONS), "no label twice"
        assert len(store.text_hashes()) == n  # each actor's commit records its item's text
    per_item = {item: sum(item in labels[q] for q in QUESTIONS) for item in set().union(*labels.values())}
    assert per_item == {f"e{i:02d}": len(QUESTIONS) for i in range(n)}
    again = label_ray(gemma_path, corpus, postgres_url)
    assert (again.labelled, again.skipped_done) == (0, n)
