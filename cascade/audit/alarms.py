"""Anytime-valid alarms: is a question's agreement with the teacher still at least its target?

Calibration certifies that a question's answers agree with the teacher on at least ``target`` of
new items from the calibration distribution. Audited live items arrive one by one, each with
``agreed`` True or False, and the question is asked again after every one. A fixed-window test
re-run at each look loses its stated confidence (every look is another chance of a false alarm).
A test by betting does not (Waudby-Smith and Ramdas, "Estimating means of bounded random
variables by betting", JRSS B 2024):

To test "agreement >= g", a gambler starts with wealth 1 and before each item stakes a fraction
``lam`` (chosen from the earlier items only) on "this item disagrees more than g allows": the
wealth is multiplied by ``1 + lam * (g - x)``, with ``x`` 1 for agreement, 0 for disagreement.
Where agreement really is at least g, no such strategy gains in expectation: the wealth is a
nonnegative supermartingale, and by Ville's inequality it ever reaches ``1 / alpha`` with
probability at most ``alpha``, however long the stream and however often it is looked at. So an
alarm raised the first time the wealth for g = target reaches ``1 / alpha`` is false with
probability at most ``alpha`` over the whole stream. Betting the other way, ``1 + lam * (x - g)``,
tests "agreement <= g". Run on a grid of g, the values of g never rejected form confidence
sequences: ``upper`` (from the first bets) and ``lower`` (from the second) each hold at every
time at once with probability at least ``1 - alpha``.

The bounds' stakes are the paper's predictable plug-in: ``lam_t = sqrt(2 log(1/alpha) / (v_{t-1} t
log(1 + t)))``, with ``v`` a running variance of the earlier outcomes, truncated so that a bet
never stakes more than half of the wealth (``1 + lam * (g - x) >= 1/2``). Those stakes shrink with
t whatever the data say, which suits an estimate from the start, but an alarm must catch a drop
that comes after a long quiet stretch: by then plug-in stakes are small, and each agreement before
the drop cost the wealth a little. So the alarm's own bet on the target is sized by online Newton
steps (ONS; Cutkosky and Orabona 2018, as Shekhar and Ramdas test by betting): the stake follows
the gradient of the log wealth, so while agreement holds it stays near 0 (little staked, little
lost) and after a drop it grows towards the growth-optimal bet. Any stake chosen from earlier
items keeps the wealth a supermartingale, so the level is the same. Measured on real AG News
streams after 400 quiet audits (bench/drift_streams.py), the ONS alarm caught the drops in a
median 173 and 825 audited items where the plug-in stakes needed 682 and 2,199, both under the
level on streams without a shift (BENCHMARKS.md). ``stake="plug-in"`` alarms on the plug-in bet,
for that comparison.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Literal

import numpy as np

from cascade.checks import is_finite

MAX_STAKE = 0.5
"""Largest share of the wealth one bet may lose (the paper's truncation c = 1/2)."""
ONS_STEP = 2 / (2 - math.log(3))
"""The online Newton step's rate for exp-concave log wealth (Cutkosky and Orabona)."""

Stake = Literal["ons", "plug-in"]


def _check_level(name: str, value: float) -> None:
    if not (is_finite(value) and 0 < value < 1):
        raise ValueError(f"{name} must be a number in (0, 1); got {value!r}")


class AgreementMonitor:
    """One question's audited agreement: the alarm on ``target`` and the anytime bounds.

    ``grid`` candidate agreement rates (evenly spaced in (0, 1)) set the bounds' resolution;
    the alarm bets on ``target`` itself, never on a grid point near it, with the stakes ``stake``
    names (online Newton steps by default; the bounds' plug-in ones, for comparison).
    """

    def __init__(self, target: float, alpha: float = 0.05, grid: int = 1000, stake: Stake = "ons") -> None:
        _check_level("target", target)
        _check_level("alpha", alpha)
        if isinstance(grid, bool) or not isinstance(grid, int) or grid < 2:
            raise ValueError(f"grid must be a whole number >= 2; got {grid!r}")
        if stake not in ("ons", "plug-in"):
            raise ValueError(f"stake must be 'ons' or 'plug-in'; got {stake!r}")
        self.stake = stake
        self._ons_stake, self._ons_curvature, self._alarm_wealth = 0.0, 1.0, 0.0
        self.target = float(target)
        self.alpha = float(alpha)
        self.items = 0
        self.agreed = 0
        self.alarm_at: int | None = None  # the audited item at which the alarm was raised
        self._rates = np.append((np.arange(grid) + 0.5) / grid, self.target)
        self._below = np.zeros(len(self._rates))  # log wealth against "agreement >= g"
        self._above = np.zeros(len(self._rates))  # log wealth against "agreement <= g"
        self._rejected_below = np.zeros(len(self._rates), dtype=bool)
        self._rejected_above = np.zeros(len(self._rates), dtype=bool)
        self._mean, self._spread = 0.5, 0.25  # the plug-in's running estimates, before any item

    def update(self, agreed: Iterable[bool]) -> None:
        """Add audited items in the order they were audited (True: the cascade agreed)."""
        threshold = math.log(1 / self.alpha)
        for outcome in agreed:
            if not isinstance(outcome, bool | np.bool_):
                raise TypeError(f"each audited outcome must be True or False; got {outcome!r}")
            x = float(outcome)
            stake = self._stake(threshold)
            self._below += np.log1p(np.minimum(stake, MAX_STAKE / self._rates_up()) * (self._rates - x))
            self._above += np.log1p(np.minimum(stake, MAX_STAKE / self._rates) * (x - self._rates))
            self._rejected_below |= self._below >= threshold
            self._rejected_above |= self._above >= threshold
            self._bet_on_target(x)
            self.items += 1
            self.agreed += int(outcome)
            self._learn(x)
            rejected = self._alarm_wealth >= threshold if self.stake == "ons" else self._rejected_below[-1]
            if self.alarm_at is None and rejected:
                self.alarm_at = self.items

    @property
    def alarm(self) -> bool:
        """True once the audit rejected "agreement >= target" (false with probability <= alpha)."""
        return self.alarm_at is not None

    @property
    def agreement(self) -> float | None:
        """The audited share of agreement; None before any item."""
        return self.agreed / self.items if self.items else None

    @property
    def lower(self) -> float:
        """Anytime lower confidence bound on the agreement rate (0 before evidence)."""
        kept = self._grid(~self._rejected_above)
        return float(kept.min() - 0.5 / (len(self._rates) - 1)) if kept.size else 1.0

    @property
    def upper(self) -> float:
        """Anytime upper confidence bound on the agreement rate (1 before evidence)."""
        kept = self._grid(~self._rejected_below)
        return float(kept.max() + 0.5 / (len(self._rates) - 1)) if kept.size else 0.0

    def _grid(self, mask: np.ndarray) -> np.ndarray:
        return self._rates[:-1][mask[:-1]]

    def _rates_up(self) -> np.ndarray:
        """``1 - g``: what a bet on "agreement >= g" loses per unit stake on an agreement."""
        return 1.0 - self._rates

    def _stake(self, threshold: float) -> float:
        t = self.items + 1
        return math.sqrt(2 * threshold / (self._spread * t * math.log1p(t)))

    def _bet_on_target(self, x: float) -> None:
        """The alarm's ONS bet against "agreement >= target": win ``target - x`` per unit staked,
        then step the stake along the log wealth's gradient, kept within [0, the truncation]."""
        payoff = self.target - x
        gain = 1 + self._ons_stake * payoff
        self._alarm_wealth += math.log(gain)
        gradient = payoff / gain
        self._ons_curvature += gradient ** 2
        stake = self._ons_stake + ONS_STEP * gradient / self._ons_curvature
        self._ons_stake = min(max(stake, 0.0), MAX_STAKE / (1 - self.target))

    def _learn(self, x: float) -> None:
        """The running mean and variance the next stake reads (the paper's regularised ones),
        after ``self.items`` items counting ``x``."""
        n = self.items
        self._spread = (self._spread * n + (x - self._mean) ** 2) / (n + 1)
        self._mean = (self._mean * n + x) / (n + 1)
