"""Labelling through a System One URL (``distill.labelling.endpoint``), against jevcompat 0.1.1's
mock on loopback: N calls at a time, said before the first; resumable (done items never called
for again); a store bound to the endpoint's identity, refusing another teacher's labels; calls
that waiting may cure tried again by the client alone (each item's sends counted), an item the
upstream still asks to wait for left for the next run and pausing the later calls, a refused item
skipped or stopping the run."""

from __future__ import annotations

import hashlib
import json
import math
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from jevcompat.mock import Handler, MockConfig, Running, respond
from servers import MOCK_MODEL, teacher_server, upstream
from tinymodels import tiny_llama_path

from cascade.answers import Usage
from cascade.corpus import CorpusItem
from cascade.errors import RouterError, TeacherChangedError, UpstreamRefused
from cascade.questions import Question, parse_request
from cascade.routing.router import Cascade
from cascade.teachers.identity import EndpointIdentity
from cascade.teachers.sendable import header_value
from cascade.teachers.settings import UpstreamSettings
from cascade.tiers.upstream import UpstreamAnswers
from distill.calibration.options import CalibrationOptions
from distill.calibration.run import calibrate_bundle
from distill.cli import main
from distill.labelling.endpoint import EndpointRun, _commit, _Progress, label_through_endpoint
from distill.options import CorpusInput
from distill.reports.calibration_report import write_report
from distill.store import LabelStore, StoreMismatchError, Teacher
from distill.store.texts import EditedItemsError
from distill.training.run import TrainError, train_bundle

QUESTIONS_JSON = {"questions": {
    "urgent": {"type": "noul", "instructions": "Does this convey urgency?"},
    "team": {"type": "choice", "instructions": "Which team should handle this?",
             "criteria": {"billing": "Payments, refunds", "technical": "Bugs"}},
    "severity": {"type": "score", "instructions": "How severe is it?", "criteria": ["Minor", "Blocking"]}}}
QUESTIONS: dict[str, Question] = dict(parse_request({"state": "-", **QUESTIONS_JSON}).questions)


def write_corpus(path: Path, n: int, extra: list[dict[str, Any]] | None = None) -> Path:
    rows = [{"id": f"e{i}", "text": f"Message {i}: my payout failed again."} for i in range(n)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows + (extra or [])))
    return path


def label(url: str, corpus: Path, store: Path, **run: Any) -> tuple[Any, list[str]]:
    said: list[str] = []
    summary = label_through_endpoint(UpstreamSettings(url, model=MOCK_MODEL), QUESTIONS, corpus, store,
                                     EndpointRun(**run), say=said.append)
    return summary, said


def test_a_corpus_is_labelled_through_the_endpoint_and_resumed_without_calls(tmp_path: Path) -> None:
    corpus, store = write_corpus(tmp_path / "c.jsonl", 20), tmp_path / "labels.sqlite"
    cfg = MockConfig()
    with Running(cfg) as server:
        url = f"{server.url}/v1/systemone"
        summary, said = label(url, corpus, store, concurrency=4, rate=200.0)
        calls = cfg.requests
        again, said_again = label(url, corpus, store, concurrency=4)
        calls_again = cfg.requests
    assert said[0].startswith(f"20 items to label: 20 calls to {url}")
    assert "4 at a time, at most 200 a second" in said[0]
    assert (summary.labelled, summary.left, calls) == (20, 0, 20)
    assert said_again[0].startswith("0 items to label") and (again.labelled, again.skipped_done) == (0, 20)
    assert calls_again == calls  # resumed: not one call
    with LabelStore.open_existing(store) as opened:
        assert opened.teacher == Teacher.of_endpoint(EndpointIdentity(model="jevcompat-mock-0.1"))
        assert len(opened) == 60
        team = opened.labels("team")["e3"]
    truth = respond(MockConfig(), {"state": "Message 3: my payout failed again.",
                                   "questions": QUESTIONS_JSON["questions"]})["answers"]["team"]
    assert team == pytest.approx(truth["probabilities"])


def test_a_renamed_id_is_one_call_to_make_and_any_id_goes_up(tmp_path: Path) -> None:
    """An id the store holds but the corpus no longer has was subtracted from the calls to make.
    And an item's id is its request's X-Request-Id: sent raw, a trailing space failed every try
    as "unreachable" and a non-ASCII letter raised UnicodeEncodeError."""
    corpus, store = write_corpus(tmp_path / "c.jsonl", 4), tmp_path / "labels.sqlite"
    with Running(MockConfig()) as server:
        label(f"{server.url}/v1/systemone", corpus, store)
        corpus.write_text(corpus.read_text().replace('"e1"', '"e1 "'))
        summary, said = label(f"{server.url}/v1/systemone", corpus, store)
        assert said[0].startswith("1 items to label: 1 calls")
        assert (summary.labelled, summary.left, summary.skipped_done) == (1, 0, 3)
        odd = ["caf\u00e9", "line\nbreak", "x" * 5000, "100%"]
        corpus = write_corpus(tmp_path / "odd.jsonl", 0, [{"id": i, "text": "Payout failed."} for i in odd])
        summary, _ = label(f"{server.url}/v1/systemone", corpus, tmp_path / "odd.sqlite")
    assert (summary.labelled, summary.left, summary.bad_lines) == (4, 0, [])


def test_a_header_value_is_what_http_allows() -> None:
    assert header_value("req-1/a:b") == "req-1/a:b"
    assert header_value(" caf\u00e9 100%") == "%20caf%C3%A9%20100%25"
    assert header_value("x" * 201) == "sha256-" + hashlib.sha256(b"x" * 201).hexdigest()

def test_a_new_question_is_labelled_alone_for_the_items_that_lack_it(tmp_path: Path) -> None:
    corpus, store = write_corpus(tmp_path / "c.jsonl", 5), tmp_path / "labels.sqlite"
    with Running(MockConfig()) as server:
        url = f"{server.url}/v1/systemone"
        label_through_endpoint(UpstreamSettings(url, model=MOCK_MODEL), {"urgent": QUESTIONS["urgent"]},
                               corpus, store)
        summary, said = label(url, corpus, store)
    assert said[0].startswith("5 items to label") and summary.labelled == 5
    with LabelStore.open_existing(store) as opened:
        assert set(opened.question_ids()) == set(QUESTIONS) and len(opened) == 15


def test_an_edited_item_is_refused_before_any_call_and_old_labels_record_their_text(tmp_path: Path) -> None:
    """The endpoint's labels record their texts too; a store made before that records them at
    its next run (through a writer of its own: the check reads the store read-only)."""
    corpus, store = write_corpus(tmp_path / "c.jsonl", 4), tmp_path / "labels.sqlite"
    cfg = MockConfig()
    with Running(cfg) as server:
        url = f"{server.url}/v1/systemone"
        label(url, corpus, store)
        with LabelStore.open_existing(store) as opened:
            assert len(set(opened.text_hashes())) == 4
        with sqlite3.connect(store) as db:
            db.execute("UPDATE labels SET text_sha256 = NULL WHERE item_id = 'e2'")
        label(url, corpus, store)
        with LabelStore.open_existing(store) as opened:
            assert "e2" in opened.text_hashes()
        calls = cfg.requests
        rows = [json.loads(line) for line in write_corpus(corpus, 5).read_text().splitlines()]
        rows[2]["text"] = "an edited message"
        corpus.write_text("".join(json.dumps(row) + "\n" for row in rows))
        with pytest.raises(EditedItemsError, match=r"'e2' \(line 3\)"):
            label(url, corpus, store)
        assert cfg.requests == calls  # refused before the new item e4 was called for


def test_a_run_its_store_refuses_commits_none_of_its_answers_and_another_runs_label_stays(
        tmp_path: Path) -> None:
    """Two runs starting on an empty store with two wordings of a question: the second's first
    answer found the store bound to the other one, and the answers it still had in flight were
    committed anyway (a rerun then counted them done). And an item another run labelled since
    this one began, with an answer of its own, stopped the run on a "new --store" advice."""
    identity = EndpointIdentity(model="m")
    urgent = {"urgent": QUESTIONS["urgent"]}
    edited = {"urgent": QUESTIONS["urgent"].model_copy(update={"instructions": "Is it URGENT?"})}
    keys = QUESTIONS["urgent"].option_keys()
    answers = UpstreamAnswers({"urgent": np.array([0.3, 0.7])}, Usage(questions=1), identity)
    store = tmp_path / "s.sqlite"
    with LabelStore(store, Teacher.of_endpoint(identity)) as other:
        other.bind_questions(urgent)
    progress = _Progress(tmp_path / "c.jsonl")
    for _ in range(2):  # the first answer, then one drained after the refusal
        with pytest.raises(StoreMismatchError, match="another wording"):
            _commit(answers, CorpusItem("e0", "a state", 1), edited, store, progress)
    with LabelStore.open_existing(store) as opened:
        assert len(opened) == 0
    with LabelStore(store, Teacher.of_endpoint(identity)) as other:
        other.put_item("e0", {"urgent": dict(zip(keys, [0.9, 0.1], strict=True))})
    _commit(answers, CorpusItem("e0", "a state", 1), urgent, store, progress)
    assert (progress.summary.labelled, progress.summary.skipped_done) == (0, 1)
    assert progress.store is not None
    progress.store.close()
    with LabelStore.open_existing(store) as opened:
        assert opened.labels("urgent")["e0"] == dict(zip(keys, [0.9, 0.1], strict=True))


def test_calls_that_waiting_may_cure_are_made_again(tmp_path: Path) -> None:
    corpus, store = write_corpus(tmp_path / "c.jsonl", 12), tmp_path / "labels.sqlite"
    cfg = MockConfig(busy_every=3)  # every 3rd request: 429 Retry-After: 0
    with Running(cfg) as server:
        summary, _ = label(f"{server.url}/v1/systemone", corpus, store, concurrency=1)
    assert (summary.labelled, summary.left, summary.turned_away) == (12, 0, 0)
    assert cfg.requests == 17  # one at a time: each 429 (requests 3, 6, ..., 15) sent again once


@contextmanager
def asking_to_wait(always: dict[str, tuple[int, int]], window: bool = False
                   ) -> Iterator[tuple[str, Counter[str]]]:
    """jevcompat's mock on loopback that asks to wait: always, for the item ids in ``always`` (the
    status, 429 or 503, and its Retry-After), and with ``window``, for any request that comes
    before that Retry-After has passed (503, the seconds left). Yields its URL and the sends it
    saw per item (by X-Request-Id, which the client sets to the item's id)."""
    sends: Counter[str] = Counter()
    lock = threading.Lock()
    until = [0.0]

    class Waiting(Handler):
        cfg = MockConfig()

        def do_POST(self) -> None:
            item = self.headers.get("X-Request-Id", "")
            with lock:
                sends[item] += 1
                now = time.monotonic()
                asked = always.get(item) or ((503, math.ceil(until[0] - now)) if now < until[0] else None)
                if asked is not None and window:
                    until[0] = max(until[0], now + asked[1])
            if asked is None:
                super().do_POST()
                return
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self.send_response(asked[0])
            self.send_header("Retry-After", str(asked[1]))
            self.send_header("Content-Length", "0")
            self.end_headers()

    server = ThreadingHTTPServer(("127.0.0.1", 0), Waiting)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1/systemone", sends
    finally:
        server.shutdown()
        server.server_close()


def test_an_item_is_sent_at_most_as_often_as_the_clients_retries_allow(tmp_path: Path) -> None:
    """One retry policy, the client's: an item the upstream keeps asking to wait for (429, 503)
    is sent retries + 1 times, then left for the next run; the others are labelled meanwhile."""
    corpus, store = write_corpus(tmp_path / "c.jsonl", 8), tmp_path / "labels.sqlite"
    with asking_to_wait({"e1": (429, 1), "e3": (503, 1)}) as (url, sends):
        settings = UpstreamSettings(url, model=MOCK_MODEL)
        summary = label_through_endpoint(settings, QUESTIONS, corpus, store, EndpointRun(concurrency=4))
    tries = settings.retries + 1
    assert dict(sends) == {f"e{i}": tries if i in (1, 3) else 1 for i in range(8)}
    assert (summary.labelled, summary.turned_away, summary.left) == (6, 2, 2)
    with LabelStore.open_existing(store) as opened:
        assert opened.done_items(list(QUESTIONS)) == {f"e{i}" for i in (0, 2, 4, 5, 6, 7)}


def test_a_wait_past_the_calls_deadline_pauses_the_runs_later_calls(tmp_path: Path) -> None:
    """A Retry-After longer than the call's deadline: the client gives up at once (one send), and
    the run sends nothing more until it has passed, so the next items are answered, not turned
    away (this upstream refuses whatever comes before its Retry-After)."""
    corpus, store = write_corpus(tmp_path / "c.jsonl", 4), tmp_path / "labels.sqlite"
    with asking_to_wait({"e0": (503, 2)}, window=True) as (url, sends):
        settings = UpstreamSettings(url, model=MOCK_MODEL, read_timeout=1.0, deadline=1.0)
        summary = label_through_endpoint(settings, QUESTIONS, corpus, store, EndpointRun(concurrency=1))
    assert dict(sends) == {"e0": 1, "e1": 1, "e2": 1, "e3": 1}
    assert (summary.labelled, summary.turned_away, summary.left) == (3, 1, 1)


def test_the_command_says_which_items_the_upstream_turned_away_and_exits_1(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    corpus, store = write_corpus(tmp_path / "c.jsonl", 3), tmp_path / "labels.sqlite"
    questions = tmp_path / "q.json"
    questions.write_text(json.dumps(QUESTIONS_JSON))
    with asking_to_wait({"e0": (503, 2)}, window=True) as (url, sends):
        code = main(["label", "--teacher", url, "--upstream-model", MOCK_MODEL, "--upstream-timeout", "0.5",
                     "--questions", str(questions), "--corpus", str(corpus), "--store", str(store),
                     "--concurrency", "1"])
    err = capsys.readouterr().err
    assert code == 1 and dict(sends) == {"e0": 1, "e1": 1, "e2": 1}
    assert "asked to wait (429 or 503) past the client's retries for 1 items" in err
    assert "run the same command again later" in err
    with LabelStore.open_existing(store) as opened:
        assert opened.done_items(list(QUESTIONS)) == {"e1", "e2"}


def test_a_refused_item_is_skipped_or_stops_the_run(tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "c.jsonl", 6, [{"id": "arr", "text": ["an", "array", "state"]}])
    with Running(MockConfig(faults=frozenset({"reject-array-state"}))) as server:
        url = f"{server.url}/v1/systemone"
        summary, _ = label(url, corpus, tmp_path / "skip.sqlite", on_error="skip")
        with pytest.raises(UpstreamRefused, match="422"):
            label(url, corpus, tmp_path / "stop.sqlite", concurrency=1)
    assert (summary.labelled, [b.item_id for b in summary.bad_lines], summary.left) == (6, ["arr"], 0)
    with LabelStore.open_existing(tmp_path / "stop.sqlite") as stopped:
        assert len(stopped.done_items(list(QUESTIONS))) == 6  # the items before it are committed


def test_a_store_of_another_teacher_is_refused(tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "c.jsonl", 3)
    gguf = tmp_path / "gguf.sqlite"
    LabelStore(gguf, Teacher(kind="gguf", model="m.gguf", model_sha256="ab" * 32, prompt_version="v")).close()
    other = tmp_path / "other.sqlite"
    LabelStore(other, Teacher.of_endpoint(EndpointIdentity(model="another-model"))).close()
    with Running(MockConfig()) as server:
        url = f"{server.url}/v1/systemone"
        with pytest.raises(StoreMismatchError, match=r"holds labels of the gguf teacher 'm\.gguf'"):
            label(url, corpus, gguf)
        with pytest.raises(TeacherChangedError, match=r"model 'another-model' is now 'jevcompat-mock-0\.1'"):
            label(url, corpus, other)


def test_a_store_labelled_through_a_url_trains_a_bundle_that_escalates_to_it_certified(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    topics = ["payout failed", "invoice is wrong", "the app crashes", "login is broken", "refund please",
              "server down", "charged twice", "export has a bug"]
    rows = [{"id": f"e{i}", "text": f"Message {i}: {topics[i % 8]} and {topics[(i * 3) % 8]}."}
            for i in range(120)]
    corpus, store_path = tmp_path / "c.jsonl", tmp_path / "labels.sqlite"
    corpus.write_text("".join(json.dumps(row) + "\n" for row in rows))
    with Running(MockConfig()) as server:
        url = f"{server.url}/v1/systemone"
        label(url, corpus, store_path, concurrency=4)
        with LabelStore.open_existing(store_path) as store:
            with pytest.raises(TrainError, match=r"not a GGUF: leave out --teacher-model"):
                train_bundle(QUESTIONS, CorpusInput(corpus), store, tmp_path / "gguf", teacher_model=corpus)
            bundle = train_bundle(QUESTIONS, CorpusInput(corpus), store, tmp_path / "bundle")
            result = calibrate_bundle(bundle, CorpusInput(corpus), store,
                                      CalibrationOptions(target=0.6, delta=0.2))
        assert bundle.manifest.teacher.kind == "endpoint"  # the store's identity, checked at every answer
        # the report names the endpoint it cannot time, not "labels only" nor "external"
        assert result.teacher_cost is None and "the System One endpoint" in result.teacher_cost_note
        assert "jevcompat-mock-0.1" in result.teacher_cost_note
        report = write_report(result, bundle, tmp_path / "report").with_name("report.json")
        assert json.loads(report.read_text())["cost_assumption"].startswith(
            "Teacher tier 'teacher' (the System One endpoint of model 'jevcompat-mock-0.1', taken as a 4B "
            "model) estimated")
        with LabelStore.open_existing(store_path) as store:  # given its URL, the endpoint is timed
            timed = calibrate_bundle(bundle, CorpusInput(corpus), store,
                                     CalibrationOptions(target=0.6, delta=0.2, teacher_items=4, save=False),
                                     teacher=UpstreamSettings(url, model=MOCK_MODEL))
        assert timed.teacher_cost is not None and timed.teacher_cost.states == 4
        assert timed.teacher_cost_note == (f"measured on 4 calibration states through {url} (the network "
                                           "and the upstream's queue included)")
        assert timed.calibrations == result.calibrations, "timing the teacher moves no threshold"
        report = write_report(timed, bundle, tmp_path / "timed").with_name("report.json")
        assert json.loads(report.read_text())["cost_assumption"].startswith(
            f"Teacher tier 'teacher' measured on 4 calibration states through {url}")
        with pytest.raises(RouterError, match=r"give --teacher PATH\.gguf or a System One URL"):
            Cascade.load(tmp_path / "bundle")
        with Cascade.load(tmp_path / "bundle", teacher=UpstreamSettings(url, model=MOCK_MODEL),
                          threads=1) as cascade:
            answers = [a for row in rows[:20] for a in cascade.decide(row["text"]).answers.values()]
        out = tmp_path / "decided.jsonl"  # the command too, with the model name the mock requires
        assert main(["decide", "--bundle", str(tmp_path / "bundle"), "--corpus", str(corpus), "--out",
                     str(out), "--teacher", url, "--upstream-model", MOCK_MODEL, "--threads", "1"]) == 0
    decided = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(decided) == len(rows) and any(
        answer["x_routing"]["upstream"] for row in decided for answer in row["answers"].values())
    routings = [a.routing for a in answers if a.routing is not None]
    assert len(routings) == len(answers) and all(r.certified for r in routings)
    assert {r.tier for r in routings} == {"encoder", "teacher"}
    assert all(r.upstream == (r.tier == "teacher") for r in routings)
    with upstream(teacher_server(tiny_llama_path(tmp_path))) as other:  # another teacher: refused
        argv = ["calibrate", "--bundle", str(tmp_path / "bundle"), "--corpus", str(corpus), "--store",
                str(store_path), "--report", str(tmp_path / "refused"), "--target-agreement", "0.6",
                "--delta", "0.2", "--teacher", other.url, "--teacher-items", "2"]
        capsys.readouterr()
        assert main(argv) == 2
    err = capsys.readouterr().err
    assert "tier encoder" not in err, "refused before the cheap tiers are scored"
    assert err.count("\n") == 1 and "the teacher behind the URL is not the one the bundle's labels" in err


def test_the_command_labels_through_a_url_and_a_killed_run_resumes(tmp_path: Path) -> None:
    """``cascade label --teacher URL``: SIGTERM ends the run after the calls in flight (exit 143),
    SIGKILL leaves no half item; the same command again finishes the corpus."""
    corpus, store = write_corpus(tmp_path / "c.jsonl", 40), tmp_path / "labels.sqlite"
    questions = tmp_path / "q.json"
    questions.write_text(json.dumps(QUESTIONS_JSON))
    with Running(MockConfig()) as server:
        argv = [sys.executable, "-m", "distill.cli", "label", "--teacher", f"{server.url}/v1/systemone",
                "--upstream-model", MOCK_MODEL, "--questions", str(questions), "--corpus", str(corpus),
                "--store", str(store), "--concurrency", "2", "--rate", "20"]
        for how in (signal.SIGTERM, signal.SIGKILL):
            run = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            _wait_for_labels(store, run)
            run.send_signal(how)
            _, err = run.communicate(timeout=120)
            assert run.returncode == (143 if how == signal.SIGTERM else -signal.SIGKILL), err
        with LabelStore.open_existing(store) as opened:
            partial = opened.done_items(list(QUESTIONS))
            assert 0 < len(partial) < 40 and len(opened) == 3 * len(partial)  # whole items only
        done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert f"{40 - len(partial)} items to label: {40 - len(partial)} calls" in done.stderr
    with LabelStore.open_existing(store) as opened:
        assert len(opened.done_items(list(QUESTIONS))) == 40


def _wait_for_labels(store: Path, run: subprocess.Popen[str], seconds: float = 120.0) -> None:
    """Until the store holds a label (the run is under way), bounded."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and run.poll() is None:
        if store.exists():
            try:
                with LabelStore.open_existing(store) as opened:
                    if len(opened):
                        return
            except Exception:  # created, not yet a store
                pass
        time.sleep(0.05)
    raise AssertionError(f"no label appeared: {run.poll()}")


@pytest.mark.parametrize(("flags", "teacher"), [
    (["--teacher-name", "m.gguf", "--teacher-sha256", "ab" * 32, "--teacher-prompt-version", "v3"],
     Teacher(kind="gguf", model="m.gguf", model_sha256="ab" * 32, prompt_version="v3")),
    (["--teacher-identity", '{"model": "jev-1.13.0", "model_hash": "h1"}'],
     Teacher.of_endpoint(EndpointIdentity(model="jev-1.13.0", model_hash="h1"))),
    ([], Teacher(kind="external", model="external labels")),
])
def test_imported_labels_can_name_their_teacher(tmp_path: Path, flags: list[str], teacher: Teacher) -> None:
    questions, rows, store = tmp_path / "q.json", tmp_path / "rows.jsonl", tmp_path / "s.sqlite"
    questions.write_text(json.dumps(QUESTIONS_JSON))
    rows.write_text(json.dumps({"id": "e1", "question": "urgent", "answer": True}) + "\n")
    argv = ["label", "--import", str(rows), "--questions", str(questions), "--store", str(store), *flags]
    done = subprocess.run([sys.executable, "-m", "distill.cli", *argv], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    with LabelStore.open_existing(store) as opened:
        assert opened.teacher == teacher
