"""Temperature scaling at run time: the one piece of calibration the router itself applies.

Fitting temperatures and thresholds is offline work (``distill.calibration``); applying them is
runtime work, and ``cascade`` never imports ``distill``. So the formula lives here, once, and the
offline side should import it from here rather than keep its own copy.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from scipy.special import softmax

from cascade.checks import is_finite
from cascade.errors import CascadeError


class TemperatureError(CascadeError, ValueError):
    """A temperature that is not a finite number > 0."""


def apply_temperature(probs: Any, temperature: float) -> np.ndarray:
    """``softmax(log p / T)`` along the last axis: rows still sum to 1, the argmax never moves.

    ``probs`` is one probability row (k,) or rows (n, k), trusted to be distributions (tiers
    return them so); T > 1 softens an over-confident tier, T < 1 sharpens an under-confident one.
    An exact zero stays exactly zero (its log is -inf), as p ** (1 / T) says it should.
    """
    if not (is_finite(temperature) and temperature > 0):
        raise TemperatureError(f"temperature must be a finite number > 0; got {temperature!r}")
    with np.errstate(divide="ignore"):
        log_p = np.log(np.asarray(probs, dtype=np.float64))
    return np.asarray(softmax(log_p / temperature, axis=-1))
