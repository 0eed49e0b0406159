"""Resumable teacher labelling on the real llama.cpp with gemma-3-270m, and ``cascade label``."""

from __future__ import annotations

import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from tinymodels import tiny_llama_path

from cascade.errors import CorpusError, InputTooLongError
from cascade.questions import parse_request
from cascade.readout.excerpt import HeadTailExcerpt
from cascade.readout.prompts import PROMPT_VERSION
from cascade.readout.scorer import Scorer
from distill.cli import main
from distill.labelling.gguf import label_corpus, open_teacher, teacher_of
from distill.store import LabelStore, StoreMismatchError, Teacher

ROOT = Path(__file__).resolve().parents[1]
PATH_TOLERANCE = 0.15  # BENCHMARKS.md, "Decode paths: measured tolerance" (gemma's quantized kernels)
QUESTIONS_JSON = {
    "urgent": {"type": "noul", "instructions": "Does this message convey urgency?"},
    "team": {"type": "choice", "instructions": "Which team should handle this?",
             "criteria": {"billing": "Payments and refunds", "technical": "Bugs and outages"}},
}
QUESTIONS = parse_request({"state": "x", "questions": QUESTIONS_JSON}).questions
TEXTS = [
    "Help! My payouts have been failing for three days.",
    "Thanks, the new invoice looks right.",
    "The app crashes when I open settings.",
    "Please refund the duplicate charge.",
    "Can you reset my password?",
    "Our dashboard is down for everyone.",
]


def write_corpus(path: Path, n: int = len(TEXTS), extra: tuple[str, ...] = ()) -> Path:
    rows = [json.dumps({"id": f"e{i:02d}", "text": TEXTS[i % len(TEXTS)]}) for i in range(n)]
    path.write_text("\n".join([*rows, *extra]) + "\n")
    return path


def write_questions(path: Path, questions: dict = QUESTIONS_JSON) -> Path:
    path.write_text(json.dumps({"questions": questions}, indent=2))
    return path


@pytest.fixture(scope="module")
def teacher(gemma_path: Path) -> Iterator[Scorer]:
    scorer = open_teacher(gemma_path, QUESTIONS, n_ctx=1024, n_threads=1)
    yield scorer
    scorer.close()


def label(teacher: Scorer, corpus: Path, store_path: Path, questions=QUESTIONS, **kwargs):
    with LabelStore(store_path, teacher_of(teacher)) as store:
        return label_corpus(teacher, questions, corpus, store, progress=False, **kwargs)


def test_labels_every_question_of_every_item_then_resume_skips_them(
    teacher: Scorer, tmp_path: Path
) -> None:
    corpus, path = write_corpus(tmp_path / "c.jsonl"), tmp_path / "s.sqlite"
    summary = label(teacher, corpus, path)
    assert (summary.items, summary.labelled, summary.skipped_done) == (6, 6, 0)
    assert summary.bad_lines == [] and not summary.interrupted
    with LabelStore.open_existing(path) as store:
        assert store.teacher.model_sha256 == teacher.model_sha256
        assert store.teacher.prompt_version == PROMPT_VERSION
        assert store.teacher.model == "gemma-3-270m-q4_k_m.gguf"
        rows = list(store.iter_labels())
    assert sorted((r.item_id, r.question_id) for r in rows) == sorted(
        (f"e{i:02d}", q) for i in range(6) for q in QUESTIONS)
    for row in rows:
        assert list(row.probabilities) == QUESTIONS[row.question_id].option_keys()
        assert sum(row.probabilities.values()) == pytest.approx(1.0, abs=1e-9)
        assert row.prompt_hash is not None and len(row.prompt_hash) == 64

    again = label(teacher, corpus, path)
    assert (again.items, again.labelled, again.skipped_done) == (6, 0, 6)


def test_labels_read_with_the_prompt_head_agree_with_each_prompt_read_fresh(
    teacher: Scorer, tmp_path: Path
) -> None:
    """The run learns the prompt head from its first two items and copies it into the others;
    every label stays within the decode paths' tolerance of its prompts read from scratch."""
    teacher.forget_head()
    corpus, path = write_corpus(tmp_path / "c.jsonl"), tmp_path / "s.sqlite"
    label(teacher, corpus, path)
    assert teacher.prompt_head >= 8
    with LabelStore.open_existing(path) as store:
        stored = {qid: store.labels(qid) for qid in QUESTIONS}
    for i, text in enumerate(TEXTS):
        fresh = teacher.score(parse_request({"state": text, "questions": QUESTIONS_JSON}), path="fresh")
        for qid, answer in fresh.answers.items():
            label_probs = stored[qid][f"e{i:02d}"]
            assert max(abs(label_probs[k] - p) for k, p in answer.probabilities.items()) <= PATH_TOLERANCE


def test_a_new_question_labels_only_that_question(teacher: Scorer, tmp_path: Path) -> None:
    corpus, path = write_corpus(tmp_path / "c.jsonl"), tmp_path / "s.sqlite"
    label(teacher, corpus, path, questions={"urgent": QUESTIONS["urgent"]})
    with LabelStore.open_existing(path) as store:
        urgent = store.labels("urgent")
    assert label(teacher, corpus, path).labelled == 6
    with LabelStore.open_existing(path) as store:
        assert store.labels("urgent") == urgent
        assert len(store.labels("team")) == 6


def test_bad_lines_stop_with_their_line_number_or_are_skipped(teacher: Scorer, tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "c.jsonl", n=3, extra=('{"id": "e00", "text": "dup"}', "{oops"))
    with pytest.raises(CorpusError, match=r"c.jsonl:4: duplicate id 'e00' \(first on line 1\)"):
        label(teacher, corpus, tmp_path / "stop.sqlite")
    with LabelStore.open_existing(tmp_path / "stop.sqlite") as store:
        assert store.done_items(QUESTIONS) == {"e00", "e01", "e02"}, "items before it are kept"

    summary = label(teacher, corpus, tmp_path / "skip.sqlite", on_error="skip")
    assert (summary.items, summary.labelled) == (3, 3)
    assert [(b.line, b.message.split(" (")[0]) for b in summary.bad_lines] == [
        (4, "duplicate id 'e00'"), (5, "not valid JSON")]


@pytest.mark.parametrize(("text", "message"), [
    ("\n", "is empty: no items to label"),
    ("id\ttext\ne1\thello\n", r"c.tsv is not a JSONL corpus: line 1 is not JSON"),
])
def test_an_empty_or_not_jsonl_corpus_is_refused(teacher: Scorer, tmp_path: Path, text, message) -> None:
    corpus = tmp_path / "c.tsv"
    corpus.write_text(text)
    with pytest.raises(CorpusError, match=message):
        label(teacher, corpus, tmp_path / "s.sqlite", on_error="skip")


def test_over_long_items_need_an_excerpt_policy(teacher: Scorer, tmp_path: Path) -> None:
    long_item = json.dumps({"id": "long", "text": "The refund is late again. " * 300})
    corpus = write_corpus(tmp_path / "c.jsonl", n=2, extra=(long_item,))
    with pytest.raises(InputTooLongError, match=r"c.jsonl:3: item 'long' is too long: .*head_tail"):
        label(teacher, corpus, tmp_path / "stop.sqlite")

    summary = label(teacher, corpus, tmp_path / "skip.sqlite", on_error="skip")
    assert summary.labelled == 2
    assert [(b.line, b.item_id) for b in summary.bad_lines] == [(3, "long")]

    summary = label(teacher, corpus, tmp_path / "cut.sqlite", excerpt=HeadTailExcerpt(256))
    assert (summary.labelled, summary.bad_lines) == (3, [])


def test_an_item_another_live_run_is_labelling_is_left_to_it(teacher: Scorer, tmp_path: Path) -> None:
    """Two runs sharing a store each said "20 left" of a store complete between them: an item
    another run holds is that run's, and said so."""
    corpus, path = write_corpus(tmp_path / "c.jsonl", n=3), tmp_path / "s.sqlite"
    with LabelStore(path, teacher_of(teacher)) as other:
        assert other.claim("e01", QUESTIONS) == QUESTIONS  # another writer, alive, labelling e01
        summary = label(teacher, corpus, path)
    assert (summary.labelled, summary.held, summary.left, summary.skipped_done) == (2, 1, 0, 0)


def test_a_renamed_id_leaves_one_item_not_minus_one(teacher: Scorer, tmp_path: Path) -> None:
    """The items left were the corpus's lines less every id the store held: an id the corpus no
    longer has (here one that gained a trailing space) made a resumed run end "-1 left"."""
    corpus, path = write_corpus(tmp_path / "c.jsonl", n=3), tmp_path / "s.sqlite"
    label(teacher, corpus, path)
    corpus.write_text(corpus.read_text().replace('"e01"', '"e01 "'))
    summary = label(teacher, corpus, path)
    assert (summary.labelled, summary.left, summary.skipped_done) == (1, 0, 2)


def test_a_store_made_with_another_model_is_refused(teacher: Scorer, tmp_path: Path) -> None:
    corpus, path = write_corpus(tmp_path / "c.jsonl", n=2), tmp_path / "s.sqlite"
    label(teacher, corpus, path)
    other = open_teacher(tiny_llama_path(tmp_path), QUESTIONS, n_ctx=1024, n_threads=1)
    try:
        with pytest.raises(StoreMismatchError, match="model_sha256"):
            LabelStore(path, teacher_of(other))
        with LabelStore(path, teacher_of(teacher)) as store, \
                pytest.raises(StoreMismatchError, match="not to this scorer's"):
            label_corpus(other, QUESTIONS, corpus, store, progress=False)
    finally:
        other.close()


def test_cli_labels_then_resumes(gemma_path: Path, tmp_path: Path, capsys) -> None:
    corpus, questions = write_corpus(tmp_path / "c.jsonl", n=3), write_questions(tmp_path / "q.json")
    argv = ["label", "--questions", str(questions), "--corpus", str(corpus), "--store",
            str(tmp_path / "s.sqlite"), "--teacher", str(gemma_path), "--n-ctx", "1024",
            "--threads", "1"]
    assert main(argv) == 0
    first = capsys.readouterr()
    assert first.out.startswith("labelled 3 items, 0 already done, 0 bad, 0 left, in ")
    assert "2 items left, 2 teacher calls (4 readouts); the first took" in first.err
    assert "teacher check urgent: 3 items" in first.err  # too few to judge: reported, not flagged
    assert main(argv) == 0
    assert capsys.readouterr().out.startswith("labelled 0 items, 3 already done, 0 bad, 0 left, in ")
    # the store recorded the input policy: a resume under another one is refused
    assert main([*argv[:-4], "--n-ctx", "512", "--threads", "1"]) == 2
    assert "read with n_ctx 1024, no excerpt; this run reads with n_ctx 512" in capsys.readouterr().err
    # and each question's wording: an edited one was "3 already done" on the old labels, and trained on
    edited = {**QUESTIONS_JSON, "urgent": {**QUESTIONS_JSON["urgent"], "instructions": "Is it URGENT?"}}
    argv[2] = str(write_questions(tmp_path / "edited.json", edited))
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds labels of urgent read with another wording" in err[0]
    assert main(["train", "--questions", argv[2], "--corpus", str(corpus), "--store",
                 str(tmp_path / "s.sqlite"), "--bundle", str(tmp_path / "b")]) == 2
    assert "holds labels of urgent read with another wording" in capsys.readouterr().err
    assert not (tmp_path / "b").exists()


def test_an_item_edited_under_its_id_is_refused_by_labelling_and_training(
        gemma_path: Path, tmp_path: Path, capsys) -> None:
    """Labels are keyed by item id: an edited item was "already done" on its old text's labels,
    and training paired the new text with them. Each label records its text's hash, and a store
    made before that records it at its next labelling (trust on first read)."""
    corpus, questions = write_corpus(tmp_path / "c.jsonl", n=3), write_questions(tmp_path / "q.json")
    store = tmp_path / "s.sqlite"
    argv = ["label", "--questions", str(questions), "--corpus", str(corpus), "--store", str(store),
            "--teacher", str(gemma_path), "--n-ctx", "1024", "--threads", "1"]
    assert main(argv) == 0
    capsys.readouterr()
    with sqlite3.connect(store) as db:  # as a store made before texts were recorded
        db.execute("UPDATE labels SET text_sha256 = NULL")
    assert main(argv) == 0  # unchanged: resumed as before, and the texts recorded now
    assert capsys.readouterr().out.startswith("labelled 0 items, 3 already done, 0 bad, 0 left, in ")
    with sqlite3.connect(store) as db:
        assert db.execute("SELECT COUNT(*) FROM labels WHERE text_sha256 IS NULL").fetchone() == (0,)
    rows = corpus.read_text().splitlines()
    rows[1] = json.dumps({"id": "e01", "text": "An edited message: the old label answers another text."})
    corpus.write_text("\n".join([*rows, json.dumps({"id": "e09", "text": "new"})]) + "\n")
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "1 item(s) of" in err[0] and "'e01' (line 2)" in err[0], err
    assert "changed since the teacher labelled them" in err[0]
    with LabelStore.open_existing(store) as opened:  # refused before any work: e09 not labelled
        assert "e09" not in opened.done_items(())
    assert main(["train", "--questions", str(questions), "--corpus", str(corpus), "--store", str(store),
                 "--teacher-model", str(gemma_path), "--bundle", str(tmp_path / "b")]) == 2
    assert "'e01' (line 2)" in capsys.readouterr().err
    assert not (tmp_path / "b").exists()
    corpus.write_text("\n".join(rows[:1] + rows[2:]) + "\n")  # the edited item gone: labelled as before
    assert main(argv) == 0


def test_cli_layout_auto_puts_one_question_options_first_and_the_store_keeps_that_teacher(
    gemma_path: Path, tmp_path: Path, capsys
) -> None:
    corpus = write_corpus(tmp_path / "c.jsonl", n=3)
    one = write_questions(tmp_path / "one.json", {"team": QUESTIONS_JSON["team"]})
    argv = ["label", "--questions", str(one), "--corpus", str(corpus), "--store", str(tmp_path / "s.sqlite"),
            "--teacher", str(gemma_path), "--n-ctx", "1024", "--threads", "1", "--layout", "auto"]
    assert main(argv) == 0
    assert "layout options-first: one question in one option order" in capsys.readouterr().err
    with LabelStore.open_existing(tmp_path / "s.sqlite") as store:
        assert store.teacher.prompt_version == "readout-v1-options-first"
    # the layout is part of the teacher: resuming the store in the other one is refused
    assert main([*argv[:-1], "state-first"]) == 2
    assert "prompt_version" in capsys.readouterr().err
    both = write_questions(tmp_path / "both.json")
    assert main([*argv[:2], str(both), *argv[3:6], str(tmp_path / "t.sqlite"), *argv[7:]]) == 0
    assert "layout state-first: 2 prompts per item share the state" in capsys.readouterr().err


def test_a_failed_first_import_keeps_the_labels_another_writer_put_meanwhile(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """The import dropped the store it had created whatever it held by then: a second import's
    labels, written while the first checked its 600,000 rows, went with it when the first was
    stopped. (The interleaving is made here by the import itself: a real one is a race.)"""
    from distill.labelling import transfer

    questions, store = write_questions(tmp_path / "q.json"), tmp_path / "shared.sqlite"
    labels = tmp_path / "gold.jsonl"
    labels.write_text(json.dumps({"id": "e1", "question": "urgent", "answer": True}) + "\n")

    def stopped_after_another_writer(opened: LabelStore, *args: object) -> object:
        with LabelStore(store, opened.teacher) as other:
            other.put_item("theirs", {"urgent": {"true": 1.0, "false": 0.0}})
        raise KeyboardInterrupt

    monkeypatch.setattr(transfer, "import_labels", stopped_after_another_writer)
    argv = ["label", "--questions", str(questions), "--store", str(store), "--import", str(labels)]
    assert main([*argv, "--teacher-name", "gold"]) == 130
    with LabelStore.open_existing(store) as kept:
        assert set(kept.labels("urgent")) == {"theirs"}


def test_cli_import_then_export_round_trip(tmp_path: Path, capsys) -> None:
    questions, store = write_questions(tmp_path / "q.json"), str(tmp_path / "gold.sqlite")
    rows = [{"id": "e1", "question": "urgent", "answer": True},
            {"id": "e1", "question": "team", "probabilities": {"billing": 0.25, "technical": 0.75}},
            {"id": "e2", "question": "team", "answer": "billing"},
            {"id": "e3", "question": "nope", "answer": True},
            {"id": "e\ud800", "question": "urgent", "answer": True}]  # a traceback in SQLite before
    labels = tmp_path / "gold.jsonl"
    deep = '{"id": "e4", "question": "urgent", "answer": ' + "[" * 100_000 + "]" * 100_000 + "}\n"
    labels.write_text("".join(json.dumps(r) + "\n" for r in rows) + deep)  # a RecursionError before
    argv = ["label", "--questions", str(questions), "--store", store, "--import", str(labels)]
    assert main([*argv, "--on-error", "skip", "--teacher-name", "gold"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("imported 3 of 6 rows, 3 skipped")
    assert f"skipped {labels}:6: JSON nested too deeply to read" in err
    assert f"skipped {labels}:4: unknown question 'nope'" in err
    assert f"skipped {labels}:5: id: a key or text holds a lone surrogate" in err

    exported = tmp_path / "out.jsonl"
    assert main(["label", "--store", store, "--export", str(exported)]) == 0
    assert capsys.readouterr().out.startswith(f"exported 3 labels of teacher 'gold' from {store}")
    back = {(r["id"], r["question"]): r for r in map(json.loads, exported.read_text().splitlines())}
    assert back[("e1", "urgent")]["probabilities"] == {"true": 1.0, "false": 0.0}
    assert back[("e1", "team")]["answer"] == "technical"
    assert back[("e2", "team")]["probabilities"] == {"billing": 1.0, "technical": 0.0}

    assert main([*argv[:-2], "--import", str(exported)]) == 2, "another teacher's store"
    assert "StoreMismatchError" in capsys.readouterr().err

    LabelStore(tmp_path / "empty.sqlite", Teacher(kind="external", model="none yet")).close()
    assert main(["label", "--store", str(tmp_path / "empty.sqlite"), "--export", str(exported)]) == 0
    out, err = capsys.readouterr()  # the teacher check of no label said "questions: is empty", exit 2
    assert out.startswith("exported 0 labels of teacher 'none yet'") and err == ""
    assert exported.read_text() == ""


@pytest.mark.parametrize(("args", "message"), [
    ([], "one of the arguments --teacher --import --export is required"),
    (["--teacher", "m.gguf", "--export", "o.jsonl"], "not allowed with argument"),
    (["--teacher", "m.gguf", "--questions", "q.json"], "--teacher needs --corpus"),
    (["--export", "o.jsonl", "--corpus", "c.jsonl"], "--corpus cannot be used with --export"),
    (["--import", "l.jsonl", "--questions", "q.json", "--corpus", "c.jsonl"],
     "--corpus cannot be used with --import"),
    (["--teacher", "m.gguf", "--questions", "q.json", "--corpus", "c.jsonl", "--limit", "2", "--sample", "3"],
     "argument --sample: not allowed with argument --limit"),  # a pydantic traceback before
    (["--teacher", "m.gguf", "--questions", "q.json", "--corpus", "c.jsonl", "--concurrency", "8"],
     "--concurrency applies to a URL teacher only"),  # accepted and ignored before
    (["--import", "l.jsonl", "--questions", "q.json", "--teacher-sha256", "zz"],
     "must be a sha256 of 64 hex digits"),  # bound the store to it, refused only at train time
])
def test_cli_wants_exactly_one_mode_with_its_inputs(args: list, message: str, capsys) -> None:
    with pytest.raises(SystemExit) as caught:
        main(["label", "--store", "s.sqlite", *args])
    assert caught.value.code == 2
    assert message in capsys.readouterr().err


def test_cli_reports_a_bad_questions_file_in_one_line(gemma_path: Path, tmp_path: Path, capsys) -> None:
    questions = write_questions(tmp_path / "q.json", {"urgent": {"type": "noul"}})
    argv = ["label", "--questions", str(questions), "--corpus", str(tmp_path / "c.jsonl"),
            "--store", str(tmp_path / "s.sqlite"), "--teacher", str(gemma_path)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"RequestError: {questions}:3: questions.urgent.instructions: missing")
    assert not (tmp_path / "s.sqlite").exists(), "nothing is created before the inputs are valid"


def test_cli_help_teaches_by_example(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["label", "--help"])
    out = capsys.readouterr().out
    assert "run the same command again" in out and "cascade label --store labels.sqlite --export" in out


def start_cli(argv: list[str]) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-m", "distill.cli", *argv], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def stored_rows(path: Path) -> int:
    """Rows committed so far, read through a connection of our own (the writer's is busy)."""
    try:
        conn = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
        try:
            return int(conn.execute("SELECT COUNT(*) FROM labels").fetchone()[0])
        finally:
            conn.close()
    except sqlite3.Error:
        return 0


def wait_for_rows(process: subprocess.Popen, path: Path, rows: int) -> None:
    while stored_rows(path) < rows:
        assert process.poll() is None, f"the run ended before {rows} rows: {process.communicate()}"
        time.sleep(0.05)


def test_killed_and_interrupted_runs_resume_without_loss_or_duplicates(
    gemma_path: Path, tmp_path: Path
) -> None:
    n, store = 30, tmp_path / "s.sqlite"
    argv = ["label", "--questions", str(write_questions(tmp_path / "q.json")),
            "--corpus", str(write_corpus(tmp_path / "c.jsonl", n=n)), "--store", str(store),
            "--teacher", str(gemma_path), "--n-ctx", "1024", "--threads", "1"]

    killed = start_cli(argv)
    wait_for_rows(killed, store, 3 * len(QUESTIONS))
    killed.send_signal(signal.SIGKILL)
    assert killed.wait() == -signal.SIGKILL
    killed.communicate()
    with LabelStore.open_existing(store) as opened:
        before = {(r.item_id, r.question_id): r.probabilities for r in opened.iter_labels()}
    items = {item for item, _ in before}
    assert len(before) == len(items) * len(QUESTIONS), "every item is whole or absent"

    interrupted = start_cli(argv)
    wait_for_rows(interrupted, store, len(before) + 2 * len(QUESTIONS))
    interrupted.send_signal(signal.SIGINT)
    out, err = interrupted.communicate()
    assert interrupted.returncode == 130
    assert "SIGINT: stopping after this item" in err
    assert re.search(r"interrupted: \d+ items labelled by this run are committed, \d+ left; run the "
                     "same command again to resume", err)

    terminated = start_cli(argv)  # a job scheduler's SIGTERM: the same clean stop and summary
    wait_for_rows(terminated, store, len(before) + 4 * len(QUESTIONS))
    terminated.send_signal(signal.SIGTERM)
    out, err = terminated.communicate()
    assert terminated.returncode == 143 and "SIGTERM: stopping after this item" in err
    assert "left; run the same command again to resume" in err

    finished = start_cli(argv)
    out, err = finished.communicate()
    assert finished.returncode == 0, err
    assert "already done, 0 bad" in out
    conn = sqlite3.connect(store)
    per_item = dict(conn.execute("SELECT item_id, COUNT(*) FROM labels GROUP BY item_id"))
    conn.close()
    assert per_item == {f"e{i:02d}": len(QUESTIONS) for i in range(n)}
    with LabelStore.open_existing(store) as opened:
        after = {(r.item_id, r.question_id): r.probabilities for r in opened.iter_labels()}
    assert {key: after[key] for key in before} == before


def test_a_run_takes_only_the_selected_items_says_its_estimate_and_stops_when_asked(
    teacher: Scorer, tmp_path: Path
) -> None:
    from distill.stopping import StopRequest

    corpus = write_corpus(tmp_path / "corpus.jsonl")
    said: list[str] = []
    stop = StopRequest()
    stop.requested = "SIGTERM"  # as the handler sets it: the run ends after the item in hand
    with LabelStore(tmp_path / "labels.sqlite", teacher_of(teacher)) as store:
        summary = label_corpus(teacher, QUESTIONS, corpus, store, progress=False,
                               only={"e01", "e03", "e05"}, stop=stop, say=said.append)
        assert (summary.labelled, summary.left, summary.interrupted) == (1, 2, True)
        assert store.done_items(list(QUESTIONS)) == {"e01"}
        again = label_corpus(teacher, QUESTIONS, corpus, store, progress=False, only={"e01", "e03", "e05"})
        assert (again.labelled, again.skipped_done, again.left, again.interrupted) == (2, 1, 0, False)
        assert store.done_items(list(QUESTIONS)) == {"e01", "e03", "e05"}
    assert len(said) == 1 and said[0].startswith("2 items left, 2 teacher calls (4 readouts); the first took")


def test_a_second_sigterm_stops_at_once_as_a_second_ctrl_c_does() -> None:
    """A run held by a store that stopped answering ends no item, so the first signal's clean stop
    never comes; a job scheduler's second SIGTERM now ends it, as a second Ctrl-C did."""
    from distill.stopping import StopRequest

    with StopRequest() as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.01)  # the handler runs at the next bytecode boundary
        assert (stop.requested, stop.exit_status) == ("SIGTERM", 143)
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1)
