"""What a calibration certifies, and for what: per question or all questions at once, and not
for items the teacher skipped. On a bundle trained on generated support messages (3 questions)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from synthbundle import copy_bundle, corpus_ids, train, write_inputs

from cascade.bundle.manifest import Bundle
from cascade.encoder.onnx_encoder import Encoder
from distill.calibration.maths import CalibrationError
from distill.calibration.options import CalibrationOptions
from distill.calibration.results import CalibrationResult
from distill.calibration.run import calibrate_bundle
from distill.cli import main
from distill.options import CorpusInput, RunOptions
from distill.reports.calibration_report import write_report
from distill.store import LabelStore
from distill.training.split import part_of

ITEMS = 400
UNLABELLED = range(0, ITEMS, 10)
TARGET, DELTA = 0.85, 0.05
FLOPS = 1e11


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    return write_inputs(tmp_path_factory.mktemp("inputs"), ITEMS, UNLABELLED)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, inputs: tuple[Path, Path, Path],
            encoder: Encoder) -> Bundle:
    return train(*inputs, tmp_path_factory.mktemp("trained"), encoder, tmp_path_factory.mktemp("cache"))


def calibrate(trained: Bundle, inputs: tuple[Path, Path, Path], encoder: Encoder, directory: Path,
              **options: Any) -> tuple[Bundle, CalibrationResult]:
    bundle = copy_bundle(trained, directory)
    with LabelStore.open_existing(inputs[2]) as store:
        result = calibrate_bundle(bundle, CorpusInput(inputs[0]), store,
                                  CalibrationOptions(target=TARGET, delta=DELTA, **options),
                                  run=RunOptions(progress=False, flops_per_second=FLOPS), encoder=encoder)
    return Bundle.load(directory), result


@pytest.fixture(scope="module")
def per_question(tmp_path_factory: pytest.TempPathFactory, trained: Bundle, inputs: tuple[Path, Path, Path],
                 encoder: Encoder) -> tuple[Bundle, CalibrationResult]:
    return calibrate(trained, inputs, encoder, tmp_path_factory.mktemp("per-question"))


@pytest.fixture(scope="module")
def family(tmp_path_factory: pytest.TempPathFactory, trained: Bundle, inputs: tuple[Path, Path, Path],
           encoder: Encoder) -> tuple[Bundle, CalibrationResult]:
    return calibrate(trained, inputs, encoder, tmp_path_factory.mktemp("family"), family_wise=True)


def guarantee(result: CalibrationResult, bundle: Bundle, directory: Path) -> str:
    write_report(result, bundle, directory)
    return str(json.loads((directory / "report.json").read_text())["guarantee"])


def test_family_wise_spends_delta_over_the_questions(family: tuple[Bundle, CalibrationResult]) -> None:
    bundle, result = family
    questions = len(bundle.manifest.questions)
    assert (result.family_wise, result.family_size) == (True, questions)
    assert result.tier_delta == pytest.approx(DELTA / questions)
    assert {fit.delta for fit in result.calibrations} == {result.tier_delta}
    facts = bundle.manifest.calibration
    assert (facts.family_wise, facts.family_size, facts.tier_delta) == (True, questions,
                                                                         result.tier_delta)


def test_per_question_is_the_default_and_spends_delta_on_each(
    per_question: tuple[Bundle, CalibrationResult]
) -> None:
    bundle, result = per_question
    assert (result.family_wise, result.tier_delta) == (False, DELTA)
    assert bundle.manifest.calibration.family_wise is False


def test_family_wise_keeps_no_more_than_per_question(
    per_question: tuple[Bundle, CalibrationResult], family: tuple[Bundle, CalibrationResult]
) -> None:
    """A smaller level certifies a threshold no lower: the statement costs coverage, never buys it."""
    loose = {fit.question: fit for fit in per_question[1].calibrations}
    assert any(fit.threshold is not None for fit in loose.values())
    for fit in family[1].calibrations:
        other = loose[fit.question]
        assert fit.kept_share <= other.kept_share
        if fit.threshold is not None:
            assert other.threshold is not None and fit.threshold >= other.threshold


def test_the_report_says_what_holds_per_question(
    per_question: tuple[Bundle, CalibrationResult], tmp_path: Path
) -> None:
    text = guarantee(per_question[1], per_question[0], tmp_path)
    assert text.startswith("For each question on its own: with probability at least 95.0% (1 - delta)")
    assert "all 3 hold together only with probability at least 85% (1 - 3 x delta" in text
    assert "--family-wise" in text and "for every question" not in text


def test_the_report_says_what_holds_family_wise(
    family: tuple[Bundle, CalibrationResult], tmp_path: Path
) -> None:
    text = guarantee(family[1], family[0], tmp_path)
    assert text.startswith("For all 3 calibrated questions at once: with probability at least 95.0%")
    assert "delta is split evenly over the 3 questions" in text


def test_family_wise_with_a_budget_is_refused(
    trained: Bundle, inputs: tuple[Path, Path, Path], encoder: Encoder, tmp_path: Path
) -> None:
    with pytest.raises(CalibrationError, match=r"budget mode .* certifies nothing; give one or the other"):
        calibrate(trained, inputs, encoder, tmp_path, family_wise=True, escalation_fraction=0.2)


def test_cli_family_wise_flag(trained: Bundle, inputs: tuple[Path, Path, Path], tmp_path: Path,
                              capsys: pytest.CaptureFixture[str]) -> None:
    bundle = copy_bundle(trained, tmp_path / "b")
    assert main(["calibrate", "--bundle", str(bundle.directory), "--corpus", str(inputs[0]),
                 "--store", str(inputs[2]), "--target-agreement", str(TARGET), "--family-wise",
                 "--report", str(tmp_path / "report")]) == 0
    assert Bundle.load(bundle.directory).manifest.calibration.family_wise is True
    out = capsys.readouterr().out
    assert "guarantee family-wise: all 3 questions meet the target at once" in out
    assert ("corpus items of the calibration part have no teacher label (never labelled, or skipped "
            "by the labelling run") in out


def test_items_the_teacher_skipped_are_counted_and_reported(
    per_question: tuple[Bundle, CalibrationResult], inputs: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    bundle, result = per_question
    split = bundle.manifest.split
    ids = corpus_ids(inputs[0])
    skipped = [ids[i] for i in UNLABELLED if part_of(ids[i], split.fractions, split.salt) == "calibration"]
    assert skipped and result.unlabelled_items == len(skipped)
    assert bundle.manifest.calibration.unlabelled_items == len(skipped)
    assert not set(skipped) & set(bundle.split_ids()["calibration"])
    text = guarantee(result, bundle, tmp_path)
    assert f"{len(skipped)} corpus items of the calibration part had no teacher label" in text
    assert "the router still answers such items with its cheap tiers" in text
    promised = json.loads((tmp_path / "report.json").read_text())["not_promised"]
    assert any(line.startswith("Not about items the teacher could not label") for line in promised)
