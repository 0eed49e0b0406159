"""The pieces of calibration the router itself applies: temperature scaling, and the score a
threshold is compared with.

Fitting temperatures and thresholds is offline work (``distill.calibration``); applying them is
runtime work, and ``cascade`` never imports ``distill``. So the formulas live here, once, and the
offline side imports them from here rather than keep its own copy: a threshold certified on one
number and compared with another certifies nothing.
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np
from scipy.special import softmax

from cascade.checks import is_finite
from cascade.errors import CascadeError, TemperatureError


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


ThresholdScore = Literal["top", "margin"]
"""What a bundle's thresholds are compared with (``Manifest.threshold_on``): the raw top
probability (``top``, bundle schema 1), or its lead over the runner-up (``margin``)."""

CERTIFIED_SCORE: ThresholdScore = "margin"
"""What ``cascade calibrate`` certifies thresholds on. The margin ranks answers by how likely the
teacher is to share them better than the top probability does: a 0.6 whose runner-up holds 0.35
is a near tie, a 0.6 over three options at 0.13 is not. On the real teacher's AG News labels it
certified 1.7-2.1 more points of items kept at the same target (BENCHMARKS.md). With two options
it is 2p - 1: the same ranking as the top probability."""


def threshold_score(probs: Any, kind: ThresholdScore) -> np.ndarray:
    """The number a threshold is compared with, per probability row: (k,) -> (), (n, k) -> (n,).

    Always computed on the tier's RAW probabilities (before temperature), as calibration did.
    """
    rows = np.asarray(probs, dtype=np.float64)
    if kind == "top":
        return np.asarray(rows.max(axis=-1))
    if rows.shape[-1] < 2:
        raise CascadeError(f"a margin needs at least 2 options; got {rows.shape[-1]}")
    two = np.partition(rows, rows.shape[-1] - 2, axis=-1)[..., -2:]
    return np.asarray(two[..., 1] - two[..., 0])
