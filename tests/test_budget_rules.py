"""Budgets on a real bundle (generated support messages, an encoder tier, the recorded labels as
its teacher): what escalates first, what a budget that cannot pay does, which tiers are asked,
and predicted against spent cost. Costs are written into the manifest as measured figures (1 ms
per state for the encoder, 10 ms for a GGUF middle tier, 100 ms for the teacher, nothing per
token), so a budget buys a countable number of escalations whatever this machine's speed."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from corpora import copy_with_middle
from synthbundle import copy_bundle, train, write_inputs
from tinymodels import silence_llama_logs, tiny_llama_path

from cascade.answers import DecisionResponse
from cascade.bundle.manifest import Bundle, Manifest
from cascade.encoder.familiar import FamiliarityGate
from cascade.encoder.onnx_encoder import Encoder
from cascade.questions import DecisionRequest
from cascade.readout.scorer import Scorer
from cascade.routing.budget import Budget
from cascade.routing.router import Cascade
from cascade.tiers.base import Item
from distill.calibration.evaluate import evaluate_bundle, format_evaluation
from distill.calibration.maths import CalibrationError
from distill.calibration.options import CalibrationOptions
from distill.calibration.run import calibrate_bundle
from distill.options import CorpusInput, RunOptions
from distill.store import LabelStore

ENCODER_MS, MIDDLE_MS, TEACHER_MS = 1.0, 10.0, 100.0
COSTS = {name: {"seconds_per_state": ms / 1e3, "seconds_per_token": 0.0}
         for name, ms in (("encoder", ENCODER_MS), ("small", MIDDLE_MS), ("teacher", TEACHER_MS))}
HEADED = ("urgent", "department", "severity")
Labels = dict[str, dict[str, dict[str, float]]]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    return write_inputs(tmp_path_factory.mktemp("inputs"), 400, rare=True)


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, inputs: tuple[Path, Path, Path], encoder: Encoder,
            cache: Path) -> Bundle:
    bundle = train(*inputs, tmp_path_factory.mktemp("trained"), encoder, cache)
    assert set(bundle.heads) == set(HEADED)  # "rare" has one answer only: no head
    return bundle


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    silence_llama_logs()
    return tiny_llama_path(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def with_middle(tmp_path_factory: pytest.TempPathFactory, trained: Bundle, tiny: Path) -> Bundle:
    """encoder -> small (the tiny random GGUF) -> teacher."""
    return copy_with_middle(trained, tmp_path_factory.mktemp("middle") / "b", tiny, "small", 1024)


@pytest.fixture(scope="module")
def labels(inputs: tuple[Path, Path, Path], trained: Bundle) -> Labels:
    with LabelStore.open_existing(inputs[2]) as store:
        return {qid: store.labels(qid) for qid in trained.manifest.questions}


@pytest.fixture(scope="module")
def items(trained: Bundle, inputs: tuple[Path, Path, Path]) -> list[Item]:
    import json

    texts = {row["id"]: row["text"] for row in map(json.loads, inputs[0].open(encoding="utf-8"))}
    return [Item(i, texts[i]) for i in trained.split_ids()["evaluation"][:40]]


def variant(bundle: Bundle, directory: Path, thresholds: Mapping[str, Mapping[str, float | None]]) -> Path:
    """A copy of ``bundle`` with these thresholds (the others None) and the measured COSTS."""
    data = bundle.manifest.model_dump(mode="json")
    for qid, row in data["thresholds"].items():
        for tier in row:
            row[tier] = thresholds.get(qid, {}).get(tier)
    names = [tier["name"] for tier in data["tiers"]]
    data["calibration"] = {"costs": {name: COSTS[name] for name in names}}
    Bundle(Manifest.model_validate(data), bundle.directory).save(directory)
    return directory


@pytest.fixture
def load(labels: Labels, cache: Path, tmp_path: Path) -> Iterator[Any]:
    opened: list[Cascade] = []

    def open_variant(bundle: Bundle, thresholds: Mapping[str, Mapping[str, float | None]]) -> Cascade:
        directory = variant(bundle, tmp_path / f"v{len(opened)}", thresholds)
        opened.append(Cascade.load(directory, labels=labels, cache_dir=cache))
        return opened[-1]

    yield open_variant
    for cascade in opened:
        cascade.close()


def routed(responses: list[DecisionResponse]) -> dict[tuple[int, str], Any]:
    return {(i, qid): answer.routing for i, r in enumerate(responses) for qid, answer in r.answers.items()}


def doubt_order(unsure: Mapping[tuple[int, str], Any]) -> list[tuple[int, str]]:
    """Most doubtful first: the largest shortfall of raw score below the threshold; ties by
    item and question position."""
    def key(k: tuple[int, str]) -> tuple[float, int, int]:
        r = unsure[k]
        return (-(r.threshold - r.raw_score), k[0], HEADED.index(k[1]))
    return sorted(unsure, key=key)


THRESHOLDS = {"urgent": {"encoder": 0.97}, "department": {"encoder": 0.6}, "severity": {"encoder": 0.7}}
"""Different per question, so that distance below the threshold and confidence rank differently."""


def test_escalations_go_by_shortfall_below_the_threshold_not_by_confidence(
    load: Any, trained: Bundle, items: list[Item]
) -> None:
    cascade = load(trained, THRESHOLDS)
    held = routed(cascade.decide_batch(items, Budget(max_escalation_fraction=0.0), list(HEADED)))
    unsure = {k: r for k, r in held.items() if r.budget_limited}
    k = len(unsure) // 3
    expected = set(doubt_order(unsure)[:k])
    by_confidence = set(sorted(unsure, key=lambda key: (unsure[key].raw_confidence, key[0]))[:k])
    assert expected != by_confidence  # the two orders differ here, so the test can tell them apart
    share = k / (len(items) * len(HEADED))
    spent = routed(cascade.decide_batch(items, Budget(max_escalation_fraction=share), list(HEADED)))
    assert {key for key, r in spent.items() if r.tier == "teacher"} == expected
    assert {key for key, r in spent.items() if r.budget_limited} == set(unsure) - expected


def test_a_question_that_does_not_fit_is_skipped_and_cheaper_ones_still_go(
    load: Any, trained: Bundle, items: list[Item]
) -> None:
    """The teacher charges 100 ms for a state's first question and nothing for the others: a
    budget for one state escalates every unsure question of the most doubtful one's state, even
    those behind questions of other states that no longer fit."""
    cascade = load(trained, THRESHOLDS)
    held = routed(cascade.decide_batch(items, Budget(max_escalation_fraction=0.0), list(HEADED)))
    unsure = {k: r for k, r in held.items() if r.budget_limited}
    order = doubt_order(unsure)
    first = order[0][0]
    same = [key for key in order if key[0] == first]
    assert order[:len(same)] != same  # another state's question comes between two of its own
    budget = Budget(ms_per_call=ENCODER_MS + (TEACHER_MS + TEACHER_MS / 2) / len(items))
    spent = routed(cascade.decide_batch(items, budget, list(HEADED)))
    assert {key for key, r in spent.items() if r.tier == "teacher"} == set(same)
    assert sum(r.cost_ms for r in spent.values()) <= budget.ms_per_call * len(items)  # type: ignore[operator]


def test_a_question_with_no_lower_tier_goes_up_marked_over_budget(
    load: Any, trained: Bundle, items: list[Item]
) -> None:
    cascade = load(trained, {})
    fraction = 0.25
    spent = routed(cascade.decide_batch(items, Budget(max_escalation_fraction=fraction), ["rare", "urgent"]))
    share = math.floor(fraction * 2 * len(items))
    rare = [spent[i, "rare"] for i in range(len(items))]
    assert all(r.tier == "teacher" for r in rare)  # no head: nothing below to keep
    assert [r.over_budget for r in rare] == [i >= share for i in range(len(items))]
    assert not any(spent[i, "urgent"].over_budget for i in range(len(items)))
    assert all(spent[i, "urgent"].budget_limited for i in range(len(items)))


def test_no_budget_means_nothing_over_budget(load: Any, trained: Bundle, items: list[Item]) -> None:
    spent = routed(load(trained, {}).decide_batch(items, None, ["rare", "urgent"]))
    assert not any(r.over_budget or r.budget_limited for r in spent.values())


def test_a_tier_without_a_threshold_is_not_asked_when_a_lower_answer_can_be_kept(
    load: Any, with_middle: Bundle, items: list[Item]
) -> None:
    """Under the top-tier share alone, the middle tier's uncertified answer would only replace
    the encoder's uncertified one: it is not asked; unsure encoder answers wait for the teacher."""
    cascade = load(with_middle, THRESHOLDS)
    responses = cascade.decide_batch(items, Budget(max_escalation_fraction=0.1), list(HEADED))
    assert not any("small" in r.usage.tiers for r in responses)
    spent = routed(responses)
    assert {r.tier for r in spent.values()} == {"encoder", "teacher"}
    assert any(r.budget_limited for r in spent.values())


def test_a_tier_without_a_threshold_is_asked_when_nothing_below_answered(
    load: Any, with_middle: Bundle, items: list[Item]
) -> None:
    """"rare" has no head: under a budget the middle tier's answer is the only one that can be
    kept in place of the teacher's, so it is asked, and kept where the share runs out."""
    cascade = load(with_middle, {})
    spent = routed(cascade.decide_batch(items, Budget(max_escalation_fraction=0.0), ["rare"]))
    assert all(r.tier == "small" and r.budget_limited and not r.over_budget for r in spent.values())
    free = routed(cascade.decide_batch(items, None, ["rare"]))  # no budget: no reason to ask it
    assert all(r.tier == "teacher" for r in free.values())


def test_a_gguf_middle_tier_reads_the_batch_calibration_certified(
    load: Any, trained: Bundle, items: list[Item], gemma_path: Path, tmp_path: Path
) -> None:
    """Asked one question, gemma still decodes every question of the bundle in one fan-out, as
    calibration scores it: its answer is the one a full request gives, to the last bit."""
    bundle = copy_with_middle(trained, tmp_path / "g", gemma_path, "small", 1024)
    cascade = load(bundle, {"urgent": {"small": 0.0}})
    scorer: Scorer = cascade.tiers[1].scorer
    questions = cascade.questions
    for item, response in zip(items[:3], cascade.decide_batch(items[:3], None, ["urgent"]), strict=True):
        answer = response.answers["urgent"]
        assert answer.routing.tier == "small"
        full = scorer.score(DecisionRequest(state=item.state, questions=questions)).answers["urgent"]
        assert answer.probabilities == pytest.approx(full.probabilities, abs=1e-9)
        tiers = response.usage.tiers
        assert set(tiers) == {"small"}
        assert tiers["small"].predicted_seconds == pytest.approx(MIDDLE_MS / 1e3)


def test_calibration_refuses_a_scorer_that_decodes_other_batches_than_the_router(
    with_middle: Bundle, inputs: tuple[Path, Path, Path], encoder: Encoder, tiny: Path, tmp_path: Path
) -> None:
    bundle = copy_bundle(with_middle, tmp_path / "b")
    before = (bundle.directory / "manifest.json").read_bytes()
    scorer = Scorer(tiny, n_ctx=1024, max_branches=2, n_threads=1)
    try:
        with LabelStore.open_existing(inputs[2]) as store, pytest.raises(
                CalibrationError, match=r"decodes at most 2 branches at once, and the router 4 of the 4"):
            calibrate_bundle(bundle, CorpusInput(inputs[0]), store, CalibrationOptions(target=0.8),
                             encoder=encoder, scorers={"small": scorer},
                             run=RunOptions(progress=False, flops_per_second=1e11))
    finally:
        scorer.close()
    assert (bundle.directory / "manifest.json").read_bytes() == before


def test_calibration_refuses_a_scorer_that_reads_another_prompt_layout_than_the_tier(
    with_middle: Bundle, inputs: tuple[Path, Path, Path], encoder: Encoder, tiny: Path, tmp_path: Path
) -> None:
    bundle = copy_bundle(with_middle, tmp_path / "b")
    scorer = Scorer(tiny, n_ctx=1024, max_branches=4, n_threads=1, layout="options-first")
    try:
        with LabelStore.open_existing(inputs[2]) as store, pytest.raises(
                CalibrationError, match=r"reads its prompts options-first, and tier 'small' was certified "
                                        r"on prompts read state-first"):
            calibrate_bundle(bundle, CorpusInput(inputs[0]), store, CalibrationOptions(target=0.8),
                             encoder=encoder, scorers={"small": scorer},
                             run=RunOptions(progress=False, flops_per_second=1e11))
    finally:
        scorer.close()


def test_budget_mode_sets_each_tier_on_what_reaches_it(
    with_middle: Bundle, inputs: tuple[Path, Path, Path], encoder: Encoder, tmp_path: Path
) -> None:
    """With two cheap tiers each escalates the share F of the items that reach it, so the
    teacher answers floor(F x reached) of the items the encoder escalates: about F squared."""
    fraction = 0.5
    bundle = copy_bundle(with_middle, tmp_path / "b")
    with LabelStore.open_existing(inputs[2]) as store:
        result = calibrate_bundle(bundle, CorpusInput(inputs[0]), store,
                                  CalibrationOptions(escalation_fraction=fraction), encoder=encoder,
                                  run=RunOptions(progress=False, flops_per_second=1e11))
        store_labels = {qid: store.labels(qid) for qid in HEADED}
    fits = {(fit.question, fit.tier): fit for fit in result.calibrations}
    texts = {row["id"]: row["text"] for row in map(json.loads, inputs[0].open(encoding="utf-8"))}
    calibration = bundle.split_ids()["calibration"]
    spec = bundle.manifest.encoder_tier
    assert spec is not None and spec.gate is not None
    gate = FamiliarityGate.load(bundle.directory / spec.gate.file.name)
    familiar = dict(zip(calibration, gate.familiar(encoder.encode([texts[i] for i in calibration])),
                        strict=True))
    for qid in HEADED:
        shares = result.cascades[qid]
        n = shares.n
        reached = n - round(shares.answered_by["encoder"] * n)
        # the encoder is fitted on the states its gate lets through; the others go up unanswered
        assert fits[qid, "encoder"].n_threshold == sum(familiar[i] for i in calibration
                                                       if i in store_labels[qid]) <= n
        assert fits[qid, "small"].n_threshold == reached
        assert round(shares.answered_by["teacher"] * n) == math.floor(fraction * reached + 1e-9)
    # the target it was given is recorded, not certified: what evaluate, audits and serve read
    calibrated = Bundle.load(bundle.directory).manifest.calibration
    assert (calibrated.mode, calibrated.certified_target) == ("budget", None) and calibrated.target


def test_evaluate_puts_predicted_and_spent_cost_side_by_side(
    trained: Bundle, inputs: tuple[Path, Path, Path], cache: Path, tmp_path: Path
) -> None:
    directory = variant(trained, tmp_path / "b", THRESHOLDS)
    with LabelStore.open_existing(inputs[2]) as store:
        evaluation = evaluate_bundle(directory, CorpusInput(inputs[0]), store,
                                     run=RunOptions(progress=False, cache_dir=cache))
    spend = {t.name: t for t in evaluation.spend}
    assert set(spend) == {"encoder", "teacher"}
    assert spend["encoder"].predicted_seconds == pytest.approx(evaluation.items * ENCODER_MS / 1e3)
    assert spend["encoder"].spent_seconds > 0
    # every item asks "rare", which has no head: the teacher reads each state once
    assert spend["teacher"].predicted_seconds == pytest.approx(evaluation.items * TEACHER_MS / 1e3)
    total = sum(t.predicted_seconds for t in evaluation.spend)
    assert total == pytest.approx(evaluation.cascade_seconds)
    table = format_evaluation(evaluation)
    assert "predicted s" in table and "spent s" in table
    for t in evaluation.spend:
        assert any(line.split()[:3] == [t.name, f"{t.predicted_seconds:.3g}", f"{t.spent_seconds:.3g}"]
                   for line in table.splitlines())
