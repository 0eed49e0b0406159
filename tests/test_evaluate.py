"""Replaying a bundle on its evaluation items, against hand counts from the split and the labels."""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pytest
from corpora import TEACHER
from test_router import COSTS, ENCODER_MS, HEADED, TEACHER_MS, labels, texts, thresholds, trained, variant

from cascade.bundle.manifest import Bundle
from cascade.encoder.ngrams import beside
from cascade.encoder.onnx_encoder import Encoder
from cascade.routing.budget import Budget
from distill.calibration.evaluate import Evaluation, EvaluationError, evaluate_bundle
from distill.calibration.run import calibrate_bundle
from distill.cli import main
from distill.loop.evidence import gather
from distill.options import CorpusInput, RunOptions
from distill.store import LabelStore, Teacher
from distill.store.texts import EditedItemsError, state_sha256

__all__ = ["labels", "texts", "trained"]  # module fixtures shared with test_router


@pytest.fixture
def cache(embedding_cache: Path) -> Path:
    """The embedding cache training filled: the replays embed nothing again."""
    return embedding_cache


def evaluate(directory: Path, trained: tuple, cache: Path, budget: Budget | None = None) -> Evaluation:
    with LabelStore.open_existing(trained[1]) as store:
        return evaluate_bundle(directory, CorpusInput(trained[0]), store, budget,
                               run=RunOptions(progress=False, cache_dir=cache))


def labelled_evaluation_ids(bundle: Bundle, labels: Mapping, qid: str) -> list[str]:
    return [i for i in bundle.split_ids()["evaluation"] if i in labels[qid]]


def test_a_report_counts_evaluation_items_only_and_agrees_with_the_heads(
    trained: tuple, labels: Mapping, texts: Mapping, tmp_path: Path, cache: Path
) -> None:
    bundle = trained[2]
    directory = variant(bundle, tmp_path / "b", thresholds=thresholds(0.0),
                        calibration={"costs": COSTS, "target": 0.95})
    report = evaluate(directory, trained, cache)
    by_question = {qid: labelled_evaluation_ids(bundle, labels, qid) for qid in labels}
    evaluated = set().union(*map(set, by_question.values()))
    assert report.items == len(evaluated) and report.answers == sum(map(len, by_question.values()))
    assert {qid: q.items for qid, q in report.questions.items()} == {
        qid: len(ids) for qid, ids in by_question.items() if ids}
    keys = bundle.manifest.parsed_questions()["urgent"].option_keys()
    ids = by_question["urgent"]
    states = [texts[i] for i in ids]
    vectors = Encoder(threads=1).encode(states)  # not the cache the replay read
    heads = bundle.heads["urgent"].predict(beside(vectors, bundle.ngrams, states))
    teacher = [int(np.argmax([labels["urgent"][i][k] for k in keys])) for i in ids]
    assert report.questions["urgent"].agreement == pytest.approx(np.mean(heads == np.asarray(teacher)))
    for qid, question in report.questions.items():
        shares = {t.name: t.share for t in question.tiers}
        assert shares == ({"encoder": 1.0, "teacher": 0.0} if qid in HEADED
                          else {"encoder": 0.0, "teacher": 1.0})
        assert question.target == 0.95 and question.budget_limited == 0.0
        assert question.threshold == {"encoder": 0.0 if qid in HEADED else None}
    assert 0.0 <= report.agreement <= 1.0
    # predicted cost: the encoder once per item, the teacher once per item with a headless question
    headless = evaluated & (set(by_question["rare"]) | set(by_question["spam"]))
    expected = (len(evaluated) * ENCODER_MS + len(headless) * TEACHER_MS) / (len(evaluated) * TEACHER_MS)
    assert report.cost_ratio == pytest.approx(expected)


def test_escalating_everything_agrees_fully_and_costs_more_than_the_teacher(
    trained: tuple, tmp_path: Path, cache: Path
) -> None:
    report = evaluate(variant(trained[2], tmp_path / "b"), trained, cache)
    assert report.agreement == 1.0
    assert {t.name: t.share for t in report.tiers} == {"encoder": 0.0, "teacher": 1.0}
    assert report.cost_ratio > 1.0
    assert report.questions["urgent"].target is None


def test_a_budget_keeps_answers_below_their_threshold(trained: tuple, tmp_path: Path, cache: Path) -> None:
    budget = Budget(max_escalation_fraction=0.0)
    report = evaluate(variant(trained[2], tmp_path / "b"), trained, cache, budget)
    for qid in HEADED:
        assert report.questions[qid].budget_limited == 1.0
        assert {t.name: t.share for t in report.questions[qid].tiers}["encoder"] == 1.0
        assert 0.5 < report.questions[qid].agreement < 1.0
    assert report.budget.max_escalation_fraction == 0.0
    assert report.cost_ratio < 1.0


def test_a_corpus_without_evaluation_items_is_refused(trained: tuple, tmp_path: Path) -> None:
    train_ids = set(trained[2].split_ids()["train"])
    corpus = tmp_path / "train-only.jsonl"
    corpus.write_text("".join(line for line in trained[0].open(encoding="utf-8")
                              if json.loads(line)["id"] in train_ids), encoding="utf-8")
    with LabelStore.open_existing(trained[1]) as store, \
            pytest.raises(EvaluationError, match=r"no item of .*train-only.jsonl is both in the evaluation"):
        evaluate_bundle(trained[2].directory, CorpusInput(corpus), store, run=RunOptions(progress=False))


def test_every_reader_of_the_corpus_refuses_an_item_edited_since_its_labels(
    trained: tuple, tmp_path: Path
) -> None:
    """Evaluation, calibration and a retrain's evidence read the corpus against the store's
    labels: an item whose text changed under its id would be scored against the old text's answer."""
    store_path, corpus = tmp_path / "s.sqlite", tmp_path / "edited.jsonl"
    shutil.copy(trained[1], store_path)
    rows = [json.loads(line) for line in trained[0].read_text(encoding="utf-8").splitlines()]
    with LabelStore.open_existing(store_path) as store:  # imported labels record no text, until the
        assert store.text_hashes() == {}  # first reading of the corpus (a retrain's, or training's)
        gather(store, trained[2].manifest.parsed_questions(), CorpusInput(trained[0]))
        assert store.text_hashes()[rows[4]["id"]] == state_sha256(rows[4]["text"])
    rows[4]["text"] += " (edited)"
    corpus.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    bundle = Bundle.load(variant(trained[2], tmp_path / "b"))
    edited = rf"'{rows[4]['id']}' \(line 5\)"
    with LabelStore.open_existing(store_path) as store:
        with pytest.raises(EditedItemsError, match=edited):
            evaluate_bundle(bundle.directory, CorpusInput(corpus), store, run=RunOptions(progress=False))
        with pytest.raises(EditedItemsError, match=edited):
            calibrate_bundle(bundle, CorpusInput(corpus), store, run=RunOptions(progress=False))
        with pytest.raises(EditedItemsError, match=edited):
            gather(store, bundle.manifest.parsed_questions(), CorpusInput(corpus))
        assert gather(store, bundle.manifest.parsed_questions(), CorpusInput(trained[0])).items


def test_labels_of_another_teacher_are_refused(trained: tuple, tmp_path: Path) -> None:
    other = Teacher(kind="external", model="someone else")
    assert other != TEACHER
    with LabelStore(tmp_path / "other.sqlite", other) as store, \
            pytest.raises(EvaluationError, match=r"teacher 'someone else'.*'generator labels'"):
        evaluate_bundle(trained[2].directory, CorpusInput(trained[0]), store, run=RunOptions(progress=False))


def test_cli_writes_the_report_and_prints_a_table(
    trained: tuple, tmp_path: Path, cache: Path, capsys: pytest.CaptureFixture
) -> None:
    directory = variant(trained[2], tmp_path / "b", thresholds=thresholds(0.0))
    out = tmp_path / "evaluation.json"
    code = main(["evaluate", "--bundle", str(directory), "--corpus", str(trained[0]), "--store",
                 str(trained[1]), "--max-escalation", "0.2", "--json", str(out),
                 "--cache-dir", str(cache)])
    lines = capsys.readouterr().out.splitlines()
    assert code == 0
    report = json.loads(out.read_text(encoding="utf-8"))
    assert {"items", "agreement", "cost_ratio", "tiers", "questions"} <= set(report)
    assert [tier["name"] for tier in report["tiers"]] == ["encoder", "teacher"]
    assert sum(tier["share"] for tier in report["tiers"]) == pytest.approx(1.0)
    for question in report["questions"].values():
        assert {"agreement", "tiers", "target", "threshold"} <= set(question)
        assert 0.0 <= question["agreement"] <= 1.0
    assert report["budget"] == {"ms_per_call": None, "max_escalation_fraction": 0.2}
    assert lines[0].split() == ["question", "n", "agreement", "target", "encoder", "teacher",
                                "budget-limited"]
    assert lines[-1] == f"report: {out}"


def test_cli_refuses_a_bad_budget(trained: tuple, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exited:  # refused by the parser, before the bundle loads
        main(["evaluate", "--bundle", str(trained[2].directory), "--corpus", str(trained[0]),
              "--store", str(trained[1]), "--budget-ms", "-3", "--json", str(tmp_path / "e.json")])
    assert exited.value.code == 2
    assert "argument --budget-ms: must be a finite number > 0; got '-3'" in capsys.readouterr().err
