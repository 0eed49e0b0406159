"""Calibration maths on synthetic scores whose true agreement is known in closed form.

Confidence c ~ Beta(A, B) and the tier agrees with the teacher with probability c (a calibrated
tier). Then the population risk of keeping c >= t, P(c >= t and wrong), is
sf_{A,B}(t) - A / (A + B) * sf_{A+1,B}(t): the agreement on an infinite test set, so the
guarantee tests measure calibration error alone, without test-set noise.
"""

import math
from dataclasses import dataclass

import numpy as np
import pytest
from scipy.optimize import brentq
from scipy.special import softmax
from scipy.stats import beta, binom, binomtest

from cascade.errors import CascadeError
from cascade.thresholds import threshold_score
from distill.calibration.maths import (
    CalibrationError,
    apply_temperature,
    budget_keep_mask,
    clopper_pearson_lower,
    confidence_and_agreement,
    expected_calibration_error,
    fit_temperature,
    reliability_curve,
    threshold_for_agreement,
    threshold_for_budget,
)

A, B = 12.0, 1.0
TARGET, DELTA = 0.98, 0.05
SEEDS, N_CALIBRATION = 200, 1000
ALLOWED_FAILURES = DELTA * SEEDS + 3 * math.sqrt(SEEDS * DELTA * (1 - DELTA))


def population_agreement(threshold: float | None) -> float:
    """Cascade agreement on the whole distribution when the tier keeps confidence >= threshold."""
    if threshold is None:
        return 1.0
    risk = beta.sf(threshold, A, B) - A / (A + B) * beta.sf(threshold, A + 1, B)
    return float(1.0 - risk)


def draw(seed: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    confidence = rng.beta(A, B, n)
    return confidence, rng.random(n) < confidence


def empirical_threshold(confidence: np.ndarray, correct: np.ndarray, target: float) -> float:
    """The plain rule the guarantee replaces: lowest threshold whose calibration agreement meets target."""
    order = np.argsort(-confidence)
    wrong_share = np.cumsum(~correct[order]) / len(confidence)
    return float(confidence[order][np.flatnonzero(wrong_share <= 1 - target)[-1]])


@dataclass
class Trials:
    failures: dict[str, int]
    mean_kept: dict[str, float]
    ltt_never_keeps_less: bool


@pytest.fixture(scope="module")
def trials() -> Trials:
    """Each method on SEEDS calibration sets; a failure is a population agreement below TARGET."""
    failures = {"ltt": 0, "clopper_pearson": 0, "empirical": 0}
    kept: dict[str, list[float]] = {"ltt": [], "clopper_pearson": []}
    never_less = True
    for seed in range(SEEDS):
        confidence, correct = draw(seed, N_CALIBRATION)
        results = {m: threshold_for_agreement(confidence, correct, TARGET, DELTA, m) for m in kept}
        for method, result in results.items():
            failures[method] += population_agreement(result.threshold) < TARGET
            kept[method].append(result.kept_share)
        never_less &= results["ltt"].kept_share >= results["clopper_pearson"].kept_share
        plain = empirical_threshold(confidence, correct, TARGET)
        failures["empirical"] += population_agreement(plain) < TARGET
    return Trials(failures, {m: float(np.mean(v)) for m, v in kept.items()}, never_less)


def oracle_kept_share() -> float:
    """The share kept by the threshold whose population agreement is exactly TARGET."""
    threshold = brentq(lambda t: population_agreement(t) - TARGET, 0.5, 1.0 - 1e-9)
    return float(beta.sf(threshold, A, B))


def test_ltt_meets_the_target_in_all_but_about_delta_of_calibration_sets(trials: Trials) -> None:
    assert trials.failures["ltt"] <= ALLOWED_FAILURES


def test_bonferroni_method_also_holds_but_keeps_less(trials: Trials) -> None:
    assert trials.failures["clopper_pearson"] <= ALLOWED_FAILURES
    assert trials.ltt_never_keeps_less
    assert trials.mean_kept["clopper_pearson"] < trials.mean_kept["ltt"]


def test_plain_empirical_threshold_fails_far_more_often(trials: Trials) -> None:
    assert trials.failures["empirical"] > 2 * ALLOWED_FAILURES
    assert trials.failures["empirical"] > 5 * max(trials.failures["ltt"], 1)


def test_ltt_keeps_most_of_what_an_oracle_would(trials: Trials) -> None:
    oracle = oracle_kept_share()
    assert 0.75 * oracle <= trials.mean_kept["ltt"] < oracle


def test_closed_form_agreement_matches_a_large_test_set() -> None:
    confidence, correct = draw(10_000, 1_000_000)
    for threshold in (0.85, 0.92, 0.97):
        realised = 1.0 - np.mean((confidence >= threshold) & ~correct)
        expected = population_agreement(threshold)
        assert abs(realised - expected) < 5 * math.sqrt(expected * (1 - expected) / len(confidence))


def test_result_fields_describe_the_threshold_on_the_calibration_data() -> None:
    confidence, correct = draw(7, N_CALIBRATION)
    result = threshold_for_agreement(confidence, correct, TARGET, DELTA)
    assert result.threshold is not None and result.reachable
    kept = confidence >= result.threshold
    assert result.kept_share == kept.mean()
    assert result.agreement_kept == correct[kept].mean()
    assert result.agreement_cascade == 1 - (kept & ~correct).mean()
    n_agree = N_CALIBRATION - int((kept & ~correct).sum())
    assert result.lower_bound == pytest.approx(clopper_pearson_lower(n_agree, N_CALIBRATION, DELTA))
    assert TARGET <= result.lower_bound <= result.agreement_cascade
    lower = confidence[confidence < result.threshold].max()
    one_more = (confidence >= lower) & ~correct
    assert clopper_pearson_lower(N_CALIBRATION - int(one_more.sum()), N_CALIBRATION, DELTA) < TARGET
    assert (result.n, result.method, result.target, result.delta) == (N_CALIBRATION, "ltt", TARGET, DELTA)
    assert f"{result.kept_share:.1%}" in result.message


def test_an_unreachable_target_says_what_is_reachable_and_how_many_items_would_do() -> None:
    def perfect(n: int) -> tuple[np.ndarray, np.ndarray]:
        return np.linspace(0.5, 1.0, n), np.ones(n, dtype=bool)

    result = threshold_for_agreement(*perfect(120), target=0.98, delta=0.05)
    assert (result.threshold, result.kept_share, result.reachable) == (None, 0.0, False)
    assert math.isnan(result.agreement_kept)
    assert (result.agreement_cascade, result.lower_bound) == (1.0, 1.0)
    assert "target 0.98 not reachable with 120 items" in result.message
    assert f"best certifiable is {0.05 ** (1 / 120):.4f}" in result.message
    assert "label at least 149 items" in result.message
    assert not threshold_for_agreement(*perfect(148), target=0.98).reachable
    assert threshold_for_agreement(*perfect(149), target=0.98).reachable


def test_enough_items_but_wrong_top_answers_point_at_the_tier() -> None:
    confidence = np.linspace(0.5, 1.0, 1000)
    correct = np.ones(1000, dtype=bool)
    correct[-1] = False
    assert threshold_for_agreement(confidence, np.ones(1000, dtype=bool), target=0.997).reachable
    result = threshold_for_agreement(confidence, correct, target=0.997)
    assert not result.reachable
    assert "most confident answers disagree" in result.message


def test_all_correct_keeps_everything() -> None:
    confidence = np.random.default_rng(3).uniform(0.3, 1.0, 500)
    result = threshold_for_agreement(confidence, np.ones(500, dtype=bool))
    assert result.threshold == confidence.min()
    assert (result.kept_share, result.agreement_kept, result.agreement_cascade) == (1.0, 1.0, 1.0)


def test_all_wrong_keeps_nothing() -> None:
    confidence = np.random.default_rng(4).uniform(0.3, 1.0, 100)
    result = threshold_for_agreement(confidence, np.zeros(100, dtype=bool))
    assert result.threshold is None and result.kept_share == 0.0


def test_all_wrong_with_many_items_spends_only_the_error_budget() -> None:
    """Keeping wrong answers is allowed while the cascade still certifies the target."""
    confidence = np.random.default_rng(5).uniform(0.3, 1.0, 1000)
    result = threshold_for_agreement(confidence, np.zeros(1000, dtype=bool))
    assert 0 < result.kept_share <= 1 - TARGET
    assert result.agreement_kept == 0.0
    assert result.lower_bound >= TARGET


def test_tied_confidences_are_kept_or_escalated_together() -> None:
    confidence = np.repeat([0.99, 0.9, 0.8], [400, 400, 200])
    correct = np.ones(1000, dtype=bool)
    correct[800:] = False
    result = threshold_for_agreement(confidence, correct)
    assert (result.threshold, result.kept_share) == (0.9, 0.8)


def test_clopper_pearson_lower_matches_known_values() -> None:
    assert clopper_pearson_lower(0, 50, 0.05) == 0.0
    assert clopper_pearson_lower(0, 0, 0.05) == 0.0
    assert clopper_pearson_lower(50, 50, 0.05) == pytest.approx(0.05 ** (1 / 50))
    for successes, n, delta in [(1, 10, 0.05), (37, 40, 0.1), (980, 1000, 0.05), (5, 7, 0.01)]:
        lower = clopper_pearson_lower(successes, n, delta)
        reference = binomtest(successes, n).proportion_ci(1 - 2 * delta, method="exact").low
        assert lower == pytest.approx(reference, rel=1e-9)
        assert binom.sf(successes - 1, n, lower) == pytest.approx(delta)


@pytest.mark.parametrize(
    ("successes", "n", "delta", "name"),
    [(3, 2, 0.05, "successes"), (-1, 5, 0.05, "successes"), (1, -1, 0.05, "n"), (1, 5, 1.0, "delta")],
)
def test_clopper_pearson_lower_rejects_bad_arguments(successes: int, n: int, delta: float, name: str) -> None:
    with pytest.raises(CalibrationError, match=name):
        clopper_pearson_lower(successes, n, delta)


def logits_and_labels(seed: int, n: int = 4000, k: int = 4) -> tuple[np.ndarray, np.ndarray]:
    """Logits z, and labels drawn from softmax(z): softmax(z) is calibrated for them."""
    rng = np.random.default_rng(seed)
    logits = 2.0 * rng.normal(size=(n, k))
    cumulative = softmax(logits, axis=1).cumsum(axis=1)
    labels = np.minimum((cumulative < rng.random((n, 1))).sum(axis=1), k - 1)
    return logits, labels


def test_temperature_above_one_fixes_over_confidence() -> None:
    logits, labels = logits_and_labels(0)
    over_confident = softmax(3.0 * logits, axis=1)
    temperature = fit_temperature(over_confident, labels)
    assert temperature == pytest.approx(3.0, rel=0.1)
    before = expected_calibration_error(over_confident, labels)
    after = expected_calibration_error(apply_temperature(over_confident, temperature), labels)
    assert after < 0.3 * before


def test_calibrated_probabilities_keep_a_temperature_near_one() -> None:
    logits, labels = logits_and_labels(1)
    assert fit_temperature(softmax(logits, axis=1), labels) == pytest.approx(1.0, abs=0.06)


def test_soft_teacher_rows_recover_the_exact_temperature_from_probs_or_logits() -> None:
    logits, _ = logits_and_labels(2, n=300)
    teacher = softmax(logits, axis=1)
    assert fit_temperature(softmax(2.0 * logits, axis=1), teacher) == pytest.approx(2.0, rel=1e-5)
    assert fit_temperature(2.0 * logits, teacher, kind="logits") == pytest.approx(2.0, rel=1e-5)


def test_apply_temperature_keeps_the_answer_and_gives_distributions() -> None:
    logits, _ = logits_and_labels(3, n=50)
    probs = softmax(logits, axis=1)
    for temperature in (0.5, 1.0, 4.0):
        scaled = apply_temperature(probs, temperature)
        np.testing.assert_allclose(scaled.sum(axis=1), 1.0)
        np.testing.assert_array_equal(scaled.argmax(axis=1), probs.argmax(axis=1))
    np.testing.assert_allclose(apply_temperature(probs, 1.0), probs, atol=1e-12)
    np.testing.assert_allclose(apply_temperature(logits, 2.0, kind="logits"), softmax(logits / 2, axis=1))


def test_the_margin_is_the_lead_over_the_runner_up_and_ranks_two_options_as_the_top_does() -> None:
    rows = np.array([[0.6, 0.35, 0.05, 0.0], [0.6, 0.13, 0.14, 0.13], [0.25, 0.25, 0.25, 0.25]])
    np.testing.assert_allclose(threshold_score(rows, "margin"), [0.25, 0.46, 0.0])
    np.testing.assert_allclose(threshold_score(rows, "top"), [0.6, 0.6, 0.25])
    assert float(threshold_score(rows[1], "margin")) == pytest.approx(0.46)  # one row
    p = np.random.default_rng(0).uniform(size=200)
    binary = np.stack([p, 1 - p], axis=1)
    np.testing.assert_allclose(threshold_score(binary, "margin"), 2 * threshold_score(binary, "top") - 1)
    with pytest.raises(CascadeError, match="a margin needs at least 2 options; got 1"):
        threshold_score(np.ones((3, 1)), "margin")


def test_temperature_on_a_bound_warns() -> None:
    probs = np.array([[0.9, 0.1], [0.2, 0.8], [0.6, 0.4]])
    with pytest.warns(UserWarning, match="bound"):
        temperature = fit_temperature(probs, np.array([0, 1, 0]))
    assert temperature == pytest.approx(0.05, rel=1e-3)


def test_reliability_curve_bins_by_top_confidence() -> None:
    probs = np.array([[0.95, 0.05], [0.9, 0.1], [0.3, 0.7], [0.45, 0.55], [0.5, 0.5]])
    teacher = np.array([0, 1, 1, 1, 0])
    curve = reliability_curve(probs, teacher, bins=4)
    assert curve["count"] == [1, 2, 2]
    assert curve["lower"] == [0.25, 0.5, 0.75] and curve["upper"] == [0.5, 0.75, 1.0]
    assert curve["confidence"] == pytest.approx([0.5, 0.625, 0.925])
    assert curve["accuracy"] == pytest.approx([1.0, 1.0, 0.5])
    expected = (0.5 + 2 * 0.375 + 2 * 0.425) / 5
    assert curve["ece"] == pytest.approx(expected)
    assert expected_calibration_error(probs, teacher, bins=4) == pytest.approx(expected)


def test_soft_teacher_rows_count_by_their_argmax() -> None:
    probs = np.array([[0.7, 0.3], [0.4, 0.6]])
    confidence, correct = confidence_and_agreement(probs, np.array([[0.2, 0.8], [0.1, 0.9]]))
    np.testing.assert_allclose(confidence, [0.7, 0.6])
    np.testing.assert_array_equal(correct, [False, True])


def test_budget_keeps_exactly_the_share_with_ties_broken_by_position() -> None:
    confidence = np.array([0.5, 0.9, 0.5, 0.9, 0.5, 0.9, 0.5, 0.9, 0.5, 0.9])
    mask = budget_keep_mask(confidence, 0.3)
    np.testing.assert_array_equal(np.flatnonzero(mask), [0, 1, 2, 3, 5, 7, 9])
    correct = np.ones(10, dtype=bool)
    correct[2] = False
    result = threshold_for_budget(confidence, correct, 0.3)
    assert (result.kept_share, result.threshold, result.method) == (0.7, 0.5, "budget")
    assert result.agreement_kept == pytest.approx(6 / 7)
    assert result.agreement_cascade == pytest.approx(0.9)
    assert result.lower_bound == pytest.approx(clopper_pearson_lower(9, 10, 0.05))


@pytest.mark.parametrize(("fraction", "kept"), [(0.0, 100), (0.29, 71), (0.07, 93), (0.999, 1), (1.0, 0)])
def test_budget_rounds_escalations_down(fraction: float, kept: int) -> None:
    confidence = np.random.default_rng(6).random(100)
    assert budget_keep_mask(confidence, fraction).sum() == kept
    result = threshold_for_budget(confidence, np.ones(100, dtype=bool), fraction)
    assert result.kept_share == kept / 100
    assert (result.threshold is None) == (kept == 0)


def test_budget_lower_bound_covers_the_population_agreement() -> None:
    misses = 0
    for seed in range(SEEDS):
        result = threshold_for_budget(*draw(seed, N_CALIBRATION), escalation_fraction=0.4)
        misses += population_agreement(result.threshold) < result.lower_bound
    assert misses <= ALLOWED_FAILURES


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"method": "bonferroni"}, "method must be one of"),
        ({"target": 1.0}, "target"),
        ({"delta": 0.0}, "delta"),
        ({"correct": np.ones(3, dtype=bool)}, "correct has shape"),
        ({"confidence": np.array([0.5, np.nan])}, "finite"),
        ({"correct": np.array([0, 2])}, "correct must be"),
    ],
)
def test_threshold_for_agreement_rejects_bad_input(kwargs: dict, match: str) -> None:
    arguments = {"confidence": np.array([0.9, 0.8]), "correct": np.array([True, False]), **kwargs}
    with pytest.raises(CalibrationError, match=match):
        threshold_for_agreement(**arguments)


def test_probability_inputs_are_checked() -> None:
    with pytest.raises(CalibrationError, match="sum to 1"):
        fit_temperature(np.array([[0.5, 0.6]]), np.array([0]))
    with pytest.raises(CalibrationError, match=r"teacher labels must be in \[0, 2\)"):
        expected_calibration_error(np.array([[0.5, 0.5]]), np.array([2]))
    with pytest.raises(CalibrationError, match="temperature"):
        apply_temperature(np.array([[0.5, 0.5]]), 0.0)
    with pytest.raises(ValueError, match="escalation_fraction"):
        budget_keep_mask(np.array([0.5]), 1.5)
