"""Calibrating a real bundle: the session's, trained on the generated corpus of ``corpora``,
whose labels stand in for the teacher.

A calibration rewrites its bundle, so every test calibrates a ``copy_bundle`` of the trained one.
"""

from __future__ import annotations

import html
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from corpora import (
    HEADED,
    QUESTIONS,
    copy_bundle,
    copy_with_middle,
    read_jsonl,
    write_jsonl,
    write_training_inputs,
)
from tinymodels import silence_llama_logs, tiny_llama_path

from cascade.bundle.manifest import SCHEMA_VERSION, Bundle, Manifest, ModelFile
from cascade.encoder.onnx_encoder import Encoder
from cascade.readout.scorer import Scorer
from cascade.routing.router import Cascade
from cascade.teachers.settings import UpstreamSettings
from cascade.tiers.base import Item
from cascade.tiers.gguf import GgufSpec, GgufTier
from distill.calibration import early_payoff
from distill.calibration import run as calibration_run
from distill.calibration.fits import in_temperature_part
from distill.calibration.maths import CalibrationError
from distill.calibration.options import CalibrationOptions
from distill.calibration.results import FACTS, CalibrationResult, QuestionTier
from distill.calibration.run import calibrate_bundle
from distill.calibration.scoring import score_tier
from distill.cli import main
from distill.options import CorpusInput, RunOptions
from distill.reports.calibration_report import write_report
from distill.store import LabelStore, Teacher

TARGET = 0.85
FLOPS = 1e11
"""A fixed CPU throughput, so that no test spends a second measuring one."""


def calibrate(bundle: Bundle, corpus: Path, store_path: Path, encoder: Encoder,
              scorers: dict[str, Scorer] | None = None, teacher: UpstreamSettings | None = None,
              **options: Any) -> CalibrationResult:
    with LabelStore.open_existing(store_path) as store:
        return calibrate_bundle(bundle, CorpusInput(corpus), store, CalibrationOptions(**options),
                                encoder=encoder, scorers=scorers, teacher=teacher,
                                run=RunOptions(progress=False, flops_per_second=FLOPS))


@pytest.fixture(scope="module")
def inputs(labelled: tuple[Path, Path]) -> tuple[Path, Path]:
    return labelled


@pytest.fixture(scope="module")
def trained(trained_bundle: Bundle) -> Bundle:
    """The session's trained bundle: calibrated only as a copy, or refused before any change."""
    return trained_bundle


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory: pytest.TempPathFactory, trained: Bundle, inputs: tuple[Path, Path],
               encoder: Encoder) -> tuple[Bundle, CalibrationResult]:
    bundle = copy_bundle(trained, tmp_path_factory.mktemp("calibrated"))
    return bundle, calibrate(bundle, *inputs, encoder, target=TARGET)


def fit_of(result: CalibrationResult, question: str, tier: str = "encoder") -> QuestionTier:
    return next(f for f in result.calibrations if (f.question, f.tier) == (question, tier))


def test_thresholds_are_written_and_the_bundle_reloads(calibrated: tuple[Bundle, CalibrationResult]
                                                       ) -> None:
    bundle, result = calibrated
    manifest = Bundle.load(bundle.directory).manifest
    written = json.loads((bundle.directory / "manifest.json").read_text(encoding="utf-8"))["calibration"]
    for qid in HEADED:
        fit = fit_of(result, qid)
        assert fit.reachable and fit.threshold is not None
        assert manifest.threshold(qid, "encoder") == fit.threshold
        assert manifest.temperature(qid, "encoder") == fit.temperature
        # a fit stopped at a search bound (every temperature-part answer agrees) keeps T = 1
        assert (fit.temperature_note is None) == (fit.temperature != 1.0)
        if fit.temperature_note:
            assert re.fullmatch(r"the fit on \d+ items stopped at the bound T=0.05 \(every answer "
                                r"agrees with the teacher.*\); T left at 1.0", fit.temperature_note)
        assert fit.lower_bound >= TARGET and fit.agreement >= fit.lower_bound
        assert 0 < fit.kept_share <= 1
        facts = manifest.calibration.questions[qid]["encoder"]
        assert set(written["questions"][qid]["encoder"]) == set(FACTS)
        assert facts.threshold == fit.threshold and facts.target == TARGET
        assert result.cascades[qid].answered_by == pytest.approx(
            {"encoder": fit.kept_share, "teacher": 1 - fit.kept_share})
        assert result.cascades[qid].agreement == pytest.approx(fit.agreement)
    assert any(f.temperature != 1.0 for f in result.calibrations)
    assert (manifest.calibration.target, manifest.calibration.mode) == (TARGET, "agreement")
    cost = written["costs"]["encoder"]
    assert set(cost) == {"seconds_per_state", "seconds_per_token"}
    assert min(cost.values()) >= 0 and max(cost.values()) > 0
    assert manifest.calibration.costs["encoder"].model_dump() == cost
    assert manifest.calibration.flops_per_second == FLOPS


def test_the_router_keeps_exactly_what_calibration_certified(
    calibrated: tuple[Bundle, CalibrationResult], inputs: tuple[Path, Path]
) -> None:
    """Calibration and routing reduce a tier's raw probabilities to the same score (the margin,
    which on the multi-option questions keeps other items than the top probability would)."""
    bundle, result = calibrated
    manifest = Bundle.load(bundle.directory).manifest
    assert (manifest.schema_version, manifest.threshold_on) == (SCHEMA_VERSION, "margin")
    texts = {row["id"]: row["text"] for row in read_jsonl(inputs[0])}
    with LabelStore.open_existing(inputs[1]) as store:
        labels = {qid: store.labels(qid) for qid in manifest.questions}
    with Cascade.load(bundle.directory, labels=labels) as cascade:
        for qid in HEADED:
            ids = [i for i in bundle.split_ids()["calibration"] if i in labels[qid]]
            responses = cascade.decide_batch([Item(i, texts[i]) for i in ids], questions=[qid])
            kept = [r.answers[qid].routing.tier == "encoder" for r in responses]
            assert sum(kept) / len(ids) == pytest.approx(fit_of(result, qid).kept_share)


def test_calibrating_a_schema_one_bundle_moves_its_thresholds_to_the_margin(
    trained: Bundle, inputs: tuple[Path, Path], encoder: Encoder, tmp_path: Path
) -> None:
    data = trained.manifest.model_dump(mode="json") | {"schema_version": 1, "threshold_on": "top"}
    data["thresholds"] = {qid: {"encoder": 0.5} for qid in data["thresholds"]}
    old = Bundle(Manifest.model_validate(data), trained.directory).save(tmp_path / "b")
    assert Bundle.load(old.directory).manifest.threshold("rare", "encoder") == 0.5
    result = calibrate(old, *inputs, encoder, target=TARGET)
    manifest = Bundle.load(old.directory).manifest
    assert (manifest.schema_version, manifest.threshold_on) == (SCHEMA_VERSION, "margin")
    rewritten = {f.question: f.threshold for f in result.calibrations}
    rewritten |= {skip.question: None for skip in result.skipped}
    assert {qid: manifest.threshold(qid, "encoder") for qid in manifest.questions} == rewritten


def test_questions_without_a_head_or_labels_stay_uncalibrated(
    calibrated: tuple[Bundle, CalibrationResult]
) -> None:
    bundle, result = calibrated
    manifest = Bundle.load(bundle.directory).manifest
    reasons = {s.question: s.reason for s in result.skipped}
    assert reasons["rare"].startswith("the tier does not answer this question (no head)")
    assert reasons["spam"].startswith("no calibration item has a teacher label")
    assert manifest.threshold("rare", "encoder") is None and manifest.threshold("spam", "encoder") is None
    assert manifest.calibration.skipped["rare"]["encoder"] == reasons["rare"]


def test_only_calibration_items_are_used(
    calibrated: tuple[Bundle, CalibrationResult], trained: Bundle, inputs: tuple[Path, Path],
    encoder: Encoder, tmp_path: Path
) -> None:
    _, result = calibrated
    parts = trained.split_ids()
    with LabelStore.open_existing(inputs[1]) as store:
        labelled = {qid: store.labels(qid) for qid in HEADED}
    for qid in HEADED:
        ids = [i for i in parts["calibration"] if i in labelled[qid]]
        fit = fit_of(result, qid)
        assert fit.n == len(ids) and sum(map(sum, fit.confusion)) == len(ids)
        assert fit.n_temperature == sum(map(in_temperature_part, ids))
        assert fit.n_threshold == fit.n  # raw-score thresholds: every item certifies
        assert sum(fit.reliability_after["count"]) == fit.n - fit.n_temperature
    # wrong labels for every other item, and a corpus of calibration items only: same outcome
    others = set(parts["train"]) | set(parts["evaluation"])
    corpus, store = write_training_inputs(tmp_path, flip=others)
    write_jsonl(corpus, [row for row in read_jsonl(corpus) if row["id"] not in others])
    again = calibrate(copy_bundle(trained, tmp_path / "b"), corpus, store, encoder, target=TARGET)
    facts = [f.model_dump(exclude={"message"}) for f in again.calibrations]
    assert facts == [f.model_dump(exclude={"message"}) for f in result.calibrations]


def test_an_unreachable_target_says_what_is_reachable(
    trained: Bundle, inputs: tuple[Path, Path], encoder: Encoder, tmp_path: Path
) -> None:
    bundle = copy_bundle(trained, tmp_path / "b")
    result = calibrate(bundle, *inputs, encoder, target=0.9999)
    manifest = Bundle.load(bundle.directory).manifest
    for qid in HEADED:
        fit = fit_of(result, qid)
        assert (fit.threshold, fit.reachable, fit.kept_share) == (None, False, 0.0)
        match = re.match(r"target 0.9999 not reachable with (\d+) items: the best certifiable is "
                         r"(0\.\d+) \(at 95% confidence\); label at least (\d+) items", fit.message)
        assert match and int(match[1]) == fit.n_threshold and int(match[3]) > fit.n_threshold
        assert 0.9 < float(match[2]) < 0.9999
        assert manifest.threshold(qid, "encoder") is None
        assert manifest.calibration.questions[qid]["encoder"].reachable is False
        assert result.cascades[qid].answered_by["teacher"] == 1.0


def test_a_bundle_trained_again_while_it_is_calibrated_is_not_overwritten(
    trained: Bundle, inputs: tuple[Path, Path], encoder: Encoder, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A `cascade train` landing during a calibration (here, as the scores are fitted) got the
    calibration's old manifest written over its new heads, and the bundle no longer loaded; a
    report path that was a file failed after the bundle was saved."""
    bundle = copy_bundle(trained, tmp_path / "b")
    retrained = trained.manifest.model_copy(update={"name": "trained again"})
    fit_all = calibration_run.fit_all

    def train_lands(*args: Any, **kwargs: Any) -> Any:
        Bundle(retrained, trained.directory).save(bundle.directory)
        return fit_all(*args, **kwargs)

    monkeypatch.setattr(calibration_run, "fit_all", train_lands)
    with pytest.raises(CalibrationError, match="changed while it was calibrated"):
        calibrate(bundle, *inputs, encoder, target=TARGET)
    assert Bundle.load(bundle.directory).manifest == retrained
    monkeypatch.undo()
    (tmp_path / "report").write_text("a file", encoding="utf-8")
    before = (bundle.directory / "manifest.json").read_bytes()
    assert main(["calibrate", "--bundle", str(bundle.directory), "--corpus", str(inputs[0]), "--store",
                 str(inputs[1]), "--report", str(tmp_path / "report")]) == 2
    assert "--report" in capsys.readouterr().err
    assert (bundle.directory / "manifest.json").read_bytes() == before


def test_budget_mode_keeps_about_the_requested_share(
    trained: Bundle, inputs: tuple[Path, Path], encoder: Encoder, tmp_path: Path
) -> None:
    bundle = copy_bundle(trained, tmp_path / "b")
    result = calibrate(bundle, *inputs, encoder, escalation_fraction=0.3)
    manifest = Bundle.load(bundle.directory).manifest
    for qid in HEADED:
        fit = fit_of(result, qid)
        assert (fit.method, fit.target) == ("budget", None)
        assert abs(fit.kept_share - 0.7) <= 1 / fit.n_threshold
        assert fit.message.startswith(f"keeps {fit.kept_share:.1%} of {fit.n_threshold} items")
        assert manifest.threshold(qid, "encoder") == fit.threshold
    assert (manifest.calibration.mode, manifest.calibration.escalation_fraction) == ("budget", 0.3)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    silence_llama_logs()
    yield tiny_llama_path(tmp_path_factory.mktemp("tiny"))


def test_a_middle_tier_leaves_states_longer_than_its_context_out_and_says_so(
    tiny_llama: Path, caplog: pytest.LogCaptureFixture
) -> None:
    items = [Item("a", "The server is down."), Item("long", "word " * 600), Item("c", "Lunch at noon?")]
    questions = {"urgent": QUESTIONS["urgent"]}
    labels = {"urgent": {item.id: 0 for item in items}}
    scorer = Scorer(tiny_llama, n_ctx=256, n_threads=1)
    try:
        with caplog.at_level("WARNING", logger="cascade"):
            probs, cost = score_tier(GgufTier("small", scorer, owned=False), "gguf",
                                     items, labels, questions, progress=False)
        # any GGUF tier, the top too, leaves the long state out of its reply and reads the others
        reply = GgufTier("teacher", scorer, owned=False).reply(items, [["urgent"]] * 3, questions)
    finally:
        scorer.close()
    assert set(probs["urgent"]) == {"a", "c"} and cost.states == 3
    assert [bool(answers) for answers in reply.answers] == [True, False, True]
    assert reply.too_long[0] is None and "holds 256" in (reply.too_long[1] or "")
    assert "tier small: 1 of 3 calibration states do not fit its context" in caplog.text
    assert "(first: item 'long': small: the prompt needs" in caplog.text


def test_a_gguf_middle_tier_shares_the_error_budget_under_the_split_certificate(
    trained: Bundle, inputs: tuple[Path, Path], encoder: Encoder, tiny_llama: Path, tmp_path: Path
) -> None:
    data = trained.manifest.model_dump()
    small = GgufSpec(name="small", model=ModelFile.of(tiny_llama), n_ctx=1024)
    data["tiers"] = [data["tiers"][0], small.model_dump(), data["tiers"][1]]
    bundle = Bundle(Manifest.model_validate(data), trained.directory).save(tmp_path / "b")
    scorer = Scorer(tiny_llama, n_ctx=1024, n_threads=1)
    try:
        result = calibrate(bundle, *inputs, encoder, target=TARGET, scorers={"small": scorer},
                           keep_costly_tiers=True, certificate="split")
    finally:
        scorer.close()
    assert result.cheap_tiers == ["encoder", "small"]
    assert result.tier_target == pytest.approx(1 - (1 - TARGET) / 2)
    assert result.tier_delta == pytest.approx(0.025)
    manifest = Bundle.load(bundle.directory).manifest
    for qid in (*HEADED, "rare"):
        fit = fit_of(result, qid, "small")
        assert (fit.target, fit.delta) == (result.tier_target, result.tier_delta)
        assert manifest.threshold(qid, "small") == fit.threshold
        shares = result.cascades[qid].answered_by
        assert set(shares) == {"encoder", "small", "teacher"}
        assert sum(shares.values()) == pytest.approx(1.0)
    assert fit_of(result, "urgent").target == result.tier_target
    rare = fit_of(result, "rare", "small")
    assert rare.temperature == 1.0 and rare.temperature_note is not None
    assert rare.temperature_note.startswith(f"only {rare.n_temperature} items in the temperature part")
    cost = result.costs["small"]
    # one state per calibration item, whatever the number of its questions (the fan-out)
    assert cost.kind == "gguf" and cost.states == result.items < sum(fit_of(result, q, "small").n
                                                                     for q in HEADED)
    assert cost.tokens > cost.states
    # the fit may charge a tiny model's time to the state or to the token, never to neither
    assert min(cost.seconds_per_state, cost.seconds_per_token) >= 0
    assert cost.seconds_per_state * cost.states + cost.seconds_per_token * cost.tokens > 0
    assert set(manifest.calibration.costs) == {"encoder", "small"}


def test_a_gguf_middle_tier_is_certified_with_the_encoder_in_one_certificate_by_default(
    trained: Bundle, inputs: tuple[Path, Path], encoder: Encoder, tiny_llama: Path, tmp_path: Path
) -> None:
    bundle = copy_with_middle(trained, tmp_path / "b", tiny_llama, "small", 1024)
    scorer = Scorer(tiny_llama, n_ctx=1024, n_threads=1, max_branches=len(bundle.manifest.questions))
    try:
        result = calibrate(bundle, *inputs, encoder, target=TARGET, scorers={"small": scorer},
                           keep_costly_tiers=True)
    finally:
        scorer.close()
    assert result.certificate == "joint" and (result.tier_target, result.tier_delta) == (TARGET, 0.05)
    for qid in HEADED:
        pair = [fit_of(result, qid, tier) for tier in ("encoder", "small")]
        assert {fit.method for fit in pair} == {"ltt-chain"} and pair[0].lower_bound == pair[1].lower_bound
        assert pair[0].target == TARGET and pair[0].delta == 0.05
    manifest = Bundle.load(bundle.directory).manifest
    assert manifest.calibration.certificate == "joint"
    page = write_report(result, Bundle.load(bundle.directory), tmp_path / "report").read_text()
    assert "certified together" in page


@pytest.mark.parametrize(("keep", "kept"), [(False, False), (True, True)])
def test_a_middle_tier_that_costs_more_than_it_saves_is_taken_out(
    keep: bool, kept: bool, trained: Bundle, inputs: tuple[Path, Path], encoder: Encoder,
    tiny_llama: Path, tmp_path: Path,
) -> None:
    """At 1e18 FLOP/s the roofline teacher costs next to nothing, so nothing the tiny GGUF keeps
    can pay for the states it reads; unless kept, it leaves the cascade."""
    bundle = copy_with_middle(trained, tmp_path / "b", tiny_llama, "small", 1024)
    scorer = Scorer(tiny_llama, n_ctx=1024, n_threads=1, max_branches=len(bundle.manifest.questions))
    try:
        with LabelStore.open_existing(inputs[1]) as store:
            result = calibrate_bundle(bundle, CorpusInput(inputs[0]), store,
                                      CalibrationOptions(target=TARGET, keep_costly_tiers=keep),
                                      encoder=encoder,
                                      run=RunOptions(progress=False, flops_per_second=1e18),
                                      scorers={"small": scorer})
            labels = {qid: store.labels(qid) for qid in bundle.manifest.questions}
    finally:
        scorer.close()
    payoff = result.payoffs["small"]
    assert set(result.payoffs) == {"small"} and payoff.kept is kept
    assert payoff.states_reached > 0 and payoff.seconds_cost > payoff.seconds_saved
    assert payoff.reason.startswith("kept as asked" if keep else "taken out of the cascade")
    manifest = Bundle.load(bundle.directory).manifest
    assert manifest.calibration.payoffs["small"] == payoff
    assert manifest.calibration.dropped() == ({"small"} - ({"small"} if keep else set()))
    for qid in HEADED:
        certified = fit_of(result, qid, "small").threshold
        assert manifest.threshold(qid, "small") == (certified if keep else None)
        assert ("small" in result.cascades[qid].answered_by) is keep  # the replay routes without it
    with Cascade.load(bundle.directory, labels=labels) as cascade:
        assert [tier.name for tier in cascade.tiers] == ["encoder", *(["small"] if keep else []), "teacher"]
    page = write_report(result, Bundle.load(bundle.directory), tmp_path / "report").read_text()
    assert payoff.reason in html.unescape(page)
    assert ("small (taken out)" in page) is not keep


@pytest.fixture(scope="module")
def gguf_topped(tmp_path_factory: pytest.TempPathFactory, trained: Bundle, tiny_llama: Path) -> Bundle:
    """The trained bundle with a runnable teacher: a pinned GGUF as its top tier."""
    data = trained.manifest.model_dump()
    top = GgufSpec(name="teacher", model=ModelFile.of(tiny_llama), n_ctx=1024)
    data["tiers"] = [data["tiers"][0], top.model_dump()]
    folder = tmp_path_factory.mktemp("gguf") / "b"
    return Bundle(Manifest.model_validate(data), trained.directory).save(folder)


def test_a_gguf_teacher_is_timed_and_the_router_prices_it_as_measured(
    gguf_topped: Bundle, inputs: tuple[Path, Path], encoder: Encoder, tmp_path: Path
) -> None:
    bundle = copy_bundle(gguf_topped, tmp_path / "b")
    result = calibrate(bundle, *inputs, encoder, target=TARGET, teacher_items=5)
    cost = result.teacher_cost
    assert cost is not None and (cost.tier, cost.kind, cost.states) == ("teacher", "gguf", 5)
    # every question of a state in one prefill: the template and question blocks are counted
    assert cost.tokens > 5 * len(HEADED) and cost.seconds > 0
    assert cost.seconds_per_state + cost.seconds_per_token > 0  # the fit may put all of it on one
    assert result.teacher_cost_note == "measured on 5 calibration states on this machine"
    assert set(result.costs) == {"encoder"}  # the cheap tiers' costs, as before
    manifest = Bundle.load(bundle.directory).manifest
    stored = manifest.calibration.costs["teacher"]
    assert (stored.seconds_per_state, stored.seconds_per_token) == (cost.seconds_per_state,
                                                                    cost.seconds_per_token)
    with Cascade.load(bundle.directory, flops_per_second=FLOPS, threads=1) as cascade:
        priced = cascade.costs.cost("teacher")
    assert (priced.source, priced.seconds_per_token) == ("measured", cost.seconds_per_token)
    data = json.loads(write_report(result, bundle, tmp_path / "report").with_name("report.json").read_text())
    row = next(row for row in data["costs"] if row["kind"] == "teacher")
    assert (row["source"], row["states"]) == ("measured", 5)
    assert data["cost_assumption"].startswith("Teacher tier 'teacher' measured on 5 calibration states")


def test_a_teacher_is_priced_on_the_roofline_where_it_is_not_timed(
    gguf_topped: Bundle, calibrated: tuple[Bundle, CalibrationResult], inputs: tuple[Path, Path],
    encoder: Encoder, tmp_path: Path
) -> None:
    _, external = calibrated
    assert external.teacher_cost is None
    assert external.teacher_cost_note == ("the top tier 'teacher' is known by its labels only (kind "
                                          "'external'), so there is no model to time here: priced on "
                                          "the roofline")
    bundle = copy_bundle(gguf_topped, tmp_path / "b")
    result = calibrate(bundle, *inputs, encoder, target=TARGET, teacher_items=0)
    assert result.teacher_cost is None and result.teacher_cost_note.startswith("not timed (teacher_items=0)")
    assert "teacher" not in Bundle.load(bundle.directory).manifest.calibration.costs


def test_cli_times_the_teacher_on_the_items_asked(gguf_topped: Bundle, inputs: tuple[Path, Path],
                                                  tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    bundle = copy_bundle(gguf_topped, tmp_path / "b")
    args = ["calibrate", "--bundle", str(bundle.directory), "--corpus", str(inputs[0]), "--store",
            str(inputs[1]), "--target-agreement", str(TARGET), "--report", str(tmp_path / "r"),
            "--threads", "1"]
    assert main([*args, "--teacher-items", "2"]) == 0
    assert "teacher cost: measured on 2 calibration states on this machine" in capsys.readouterr().out
    assert main([*args, "--teacher-items", "0"]) == 0
    assert "teacher cost: not timed (teacher_items=0): priced on the roofline" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main([*args, "--teacher-items", "-1"])
    assert "--teacher-items: must be 0 or more; got -1" in capsys.readouterr().err


@pytest.mark.parametrize("bad", [-1, True, 2.5])
def test_a_bad_teacher_items_is_refused(trained: Bundle, inputs: tuple[Path, Path], encoder: Encoder,
                                        bad: object) -> None:
    with pytest.raises(CalibrationError, match=rf"teacher_items must be a whole number >= 0; got {bad!r}"):
        calibrate(trained, *inputs, encoder, teacher_items=bad)


def test_a_url_teacher_is_refused_for_labels_that_state_no_identity(
        trained: Bundle, inputs: tuple[Path, Path], encoder: Encoder) -> None:
    """External labels give a URL's answers nothing to be checked against: refused before a call."""
    assert trained.manifest.teacher.kind == "external"
    with pytest.raises(CalibrationError, match=r"labelled by external labels \('generator labels'\), which "
                       r"state no identity the answers of http://127\.0\.0\.1:9/v1/systemone could be "
                       r"checked against.*leave out --teacher"):
        calibrate(trained, *inputs, encoder, teacher=UpstreamSettings("http://127.0.0.1:9/v1/systemone"))


def test_a_store_of_another_teacher_is_refused(trained: Bundle, inputs: tuple[Path, Path],
                                               encoder: Encoder, tmp_path: Path) -> None:
    other = Teacher(kind="external", model="someone else's labels")
    with LabelStore(tmp_path / "other.sqlite", other):
        pass
    with pytest.raises(CalibrationError, match=r"holds labels of the teacher .*someone else's.*give "
                       r"the store the bundle was trained from"):
        calibrate(trained, inputs[0], tmp_path / "other.sqlite", encoder)


def test_a_corpus_without_the_calibration_items_is_refused(
    trained: Bundle, inputs: tuple[Path, Path], encoder: Encoder, tmp_path: Path
) -> None:
    train_ids = set(trained.split_ids()["train"])
    rows = [row for row in read_jsonl(inputs[0]) if row["id"] in train_ids]
    corpus = write_jsonl(tmp_path / "train-only.jsonl", rows)
    with pytest.raises(CalibrationError, match=r"\d+ of the \d+ calibration items are not in corpus "
                       r".*train-only.jsonl \(for example '.*'\); give the corpus"):
        calibrate(trained, corpus, inputs[1], encoder)


@pytest.mark.parametrize("kwargs, message", [
    ({"target": 1.0}, r"target must be a number in \(0, 1\); got 1.0"),
    ({"delta": 0}, r"delta must be a number in \(0, 1\); got 0"),
    ({"escalation_fraction": 1.5}, r"escalation_fraction must be None or a number in \[0, 1\]; got 1.5"),
])
def test_bad_arguments_are_refused_before_any_work(
    kwargs: dict, message: str, trained: Bundle, inputs: tuple[Path, Path], encoder: Encoder
) -> None:
    before = (trained.directory / "manifest.json").read_bytes()
    with pytest.raises(CalibrationError, match=message):
        calibrate(trained, *inputs, encoder, **kwargs)
    assert (trained.directory / "manifest.json").read_bytes() == before


def test_calibrates_help_states_the_libraries_default_teacher_items() -> None:
    from distill.calibration import options
    from distill.cli import calibrate as calibrate_command

    assert calibrate_command.TEACHER_ITEMS == options.TEACHER_ITEMS == CalibrationOptions().teacher_items


def test_a_middle_tier_that_cannot_pay_is_taken_out_on_a_sample_and_certified_without(
    trained: Bundle, inputs: tuple[Path, Path], encoder: Encoder, tiny_llama: Path, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """At 1e18 FLOP/s nothing the tiny GGUF keeps can pay; judged on a sample of 8 states (the
    test corpus's calibration part is smaller than two default samples), it is taken out before
    reading the rest, and the thresholds are certified on the encoder alone."""
    monkeypatch.setattr(early_payoff, "SAMPLE_STATES", 8)
    bundle = copy_with_middle(trained, tmp_path / "b", tiny_llama, "small", 1024)
    scorer = Scorer(tiny_llama, n_ctx=1024, n_threads=1, max_branches=len(bundle.manifest.questions))
    try:
        with LabelStore.open_existing(inputs[1]) as store:
            result = calibrate_bundle(bundle, CorpusInput(inputs[0]), store,
                                      CalibrationOptions(target=TARGET), encoder=encoder,
                                      run=RunOptions(progress=False, flops_per_second=1e18),
                                      scorers={"small": scorer})
    finally:
        scorer.close()
    payoff = result.payoffs["small"]
    assert not payoff.kept and payoff.scored_states == result.costs["small"].states == 8
    assert payoff.states_reached > 16 and payoff.seconds_cost > 2 * payoff.seconds_saved
    assert payoff.reason.startswith("taken out of the cascade before scoring every state")
    assert {fit.tier for fit in result.calibrations} == {"encoder"}  # certified without it
    assert result.cheap_tiers == ["encoder", "small"]
    manifest = Bundle.load(bundle.directory).manifest
    assert manifest.calibration.dropped() == {"small"}
    for qid in HEADED:
        assert manifest.threshold(qid, "small") is None
        assert "small" not in result.cascades[qid].answered_by
    page = write_report(result, Bundle.load(bundle.directory), tmp_path / "report").read_text()
    assert "small (taken out)" in page
