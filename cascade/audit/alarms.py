"""Anytime-valid alarms: is a question's agreement with the teacher still at least its target?

A test by betting (Waudby-Smith and Ramdas, JRSS B 2024): before each audited item a gambler
stakes, from the earlier items only, on "this item disagrees more than the target allows". While
agreement holds the wealth is a nonnegative supermartingale, so by Ville's inequality it ever
reaches ``1 / alpha`` with probability at most ``alpha``, however often it is read. The alarm's
stake is sized by online Newton steps (the default); the confidence sequences use the paper's
predictable plug-in stakes (``stake="plug-in"`` alarms on those, for comparison). How it works and
what it measured: docs/auditing.md.
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
    def wealth(self) -> float:
        """The alarm's own bet against "agreement >= target": it rises to ``threshold`` (1/alpha)
        exactly when the alarm does, and is what an alarm message names as its cause."""
        log_wealth = self._alarm_wealth if self.stake == "ons" else float(self._below[-1])
        return math.exp(min(log_wealth, 700.0))

    @property
    def threshold(self) -> float:
        """The wealth at which the alarm rises: 1 / alpha."""
        return 1 / self.alpha

    def explain(self) -> str:
        """What raised (or has not yet raised) the alarm, with the bounds as bounds, in one line."""
        state = "rose past" if self.alarm else "is below"
        observed = f"{self.agreement:.3f}" if self.agreement is not None else "none yet"
        return (f"the bet against agreement >= {self.target:.3f} {state} its alarm level: wealth "
                f"{self.wealth:.3g} against 1/delta = {self.threshold:.3g}, after {self.items} audited "
                f"items (agreement seen {observed}; anytime bounds [{self.lower:.3f}, {self.upper:.3f}], "
                "which alone do not raise it)")

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
