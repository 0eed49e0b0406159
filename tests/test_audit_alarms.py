"""Anytime-valid agreement alarms (cascade.audit.alarms), on simulated audit streams.

Each property is checked over many seeded streams, with a margin of three binomial standard
errors over the number of streams, so that a correct monitor fails with negligible probability
and a wrong one (a bound that is not anytime-valid) fails reliably.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from cascade.audit.alarms import AgreementMonitor

ALPHA = 0.05


def stream(agreement: float, n: int, seed: int) -> list[bool]:
    return list(np.random.default_rng(seed).random(n) < agreement)


def allowed(rate: float, runs: int) -> float:
    """``rate`` plus three binomial standard errors over ``runs`` independent runs."""
    return rate + 3 * math.sqrt(rate * (1 - rate) / runs)


def test_at_the_target_an_alarm_is_raised_over_the_whole_stream_at_most_alpha_of_the_time() -> None:
    """Looked at after every one of 2,000 items: a fixed-level test re-run at each look would
    alarm far more often than alpha; this one may not, over the whole stream."""
    runs = 300
    alarms = 0
    for seed in range(runs):
        monitor = AgreementMonitor(target=0.95, alpha=ALPHA, grid=10)
        monitor.update(stream(0.95, 2000, seed))
        alarms += monitor.alarm
    assert alarms / runs <= allowed(ALPHA, runs)


def test_a_drop_below_the_target_raises_the_alarm_and_records_when() -> None:
    raised = []
    for seed in range(40):
        monitor = AgreementMonitor(target=0.95, alpha=ALPHA, grid=10)
        monitor.update(stream(0.88, 1500, seed))
        raised.append(monitor.alarm_at)
    assert all(at is not None for at in raised)
    assert 20 < float(np.median([at for at in raised if at is not None])) < 1500


def test_a_drop_after_a_long_quiet_stretch_is_caught_within_a_few_hundred_items() -> None:
    """2,000 items well above the target, then a drop to 0.88: the online-Newton stake sinks to 0
    while agreement holds and grows after the drop, catching it within 500 items on every stream;
    the plug-in stakes, shrunk by then, catch none of the same streams within 3,000 (measured:
    the reason the alarm bets by ONS)."""
    caught: dict[str, list[int | None]] = {"ons": [], "plug-in": []}
    for seed in range(30):
        outcomes = stream(0.995, 2000, seed) + stream(0.88, 3000, 100 + seed)
        for stake, times in caught.items():
            monitor = AgreementMonitor(target=0.95, alpha=ALPHA, grid=2, stake=stake)  # type: ignore[arg-type]
            monitor.update(outcomes[:2000])
            assert not monitor.alarm
            monitor.update(outcomes[2000:])
            times.append(None if monitor.alarm_at is None else monitor.alarm_at - 2000)
    assert all(at is not None and at < 500 for at in caught["ons"])
    assert np.median([at for at in caught["ons"] if at is not None]) < 250
    assert caught["plug-in"].count(None) > 20


def test_the_bounds_hold_the_true_agreement_at_every_look() -> None:
    runs, truth = 100, 0.9
    misses = 0
    for seed in range(runs):
        monitor = AgreementMonitor(target=0.95, alpha=ALPHA, grid=200)
        missed = False
        for outcome in stream(truth, 600, 1000 + seed):
            monitor.update([outcome])
            missed |= not monitor.lower <= truth <= monitor.upper
        misses += missed
    assert misses / runs <= allowed(2 * ALPHA, runs)  # two one-sided sequences, alpha each


def test_bounds_tighten_around_the_audited_share() -> None:
    monitor = AgreementMonitor(target=0.95)
    assert (monitor.lower, monitor.upper, monitor.agreement) == (0.0, 1.0, None)
    monitor.update(stream(0.97, 4000, 7))
    assert monitor.agreement is not None
    assert monitor.lower < monitor.agreement < monitor.upper
    assert monitor.upper - monitor.lower < 0.03
    assert not monitor.alarm and monitor.lower > 0.95


def test_feeding_items_one_by_one_or_together_gives_the_same_state() -> None:
    outcomes = stream(0.9, 300, 3)
    together, one_by_one = AgreementMonitor(0.95, grid=50), AgreementMonitor(0.95, grid=50)
    together.update(outcomes)
    for outcome in outcomes:
        one_by_one.update([outcome])
    assert (together.lower, together.upper, together.alarm_at) == (
        one_by_one.lower, one_by_one.upper, one_by_one.alarm_at)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"target": 1.0}, r"target must be a number in \(0, 1\); got 1.0"),
    ({"target": 0.9, "alpha": 0.0}, r"alpha must be a number in \(0, 1\); got 0.0"),
    ({"target": 0.9, "grid": 1}, r"grid must be a whole number >= 2; got 1"),
])
def test_bad_settings_are_named(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        AgreementMonitor(**kwargs)  # type: ignore[arg-type]


def test_an_outcome_that_is_not_a_boolean_is_refused() -> None:
    with pytest.raises(TypeError, match="True or False; got 1"):
        AgreementMonitor(0.9).update([1])  # type: ignore[list-item]


def test_the_alarm_names_its_wealth_against_one_over_delta_and_the_bounds_as_bounds() -> None:
    monitor = AgreementMonitor(0.9, 0.05)
    monitor.update([True] * 30)
    assert not monitor.alarm and monitor.wealth < monitor.threshold == pytest.approx(20)
    assert "is below its alarm level" in monitor.explain()
    monitor.update([False] * 40)
    assert monitor.alarm and monitor.wealth >= monitor.threshold
    text = monitor.explain()
    assert "rose past its alarm level" in text and "against 1/delta = 20" in text
    assert f"[{monitor.lower:.3f}, {monitor.upper:.3f}], which alone do not raise it" in text
