"""Deterministic train / calibration / evaluation split of item ids.

Each id's part depends on the sha256 of (salt, id) alone, never on the other ids or on Python's
per-process ``hash``: the same id lands in the same part on every machine and every run, and
adding items to a corpus never moves an old one, so a threshold calibrated on held-out items
stays held out after the corpus grows.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

from cascade.checks import is_real
from cascade.hashing import seeded_unit

PARTS = ("train", "calibration", "evaluation")
DEFAULT_FRACTIONS: dict[str, float] = {"train": 0.5, "calibration": 0.25, "evaluation": 0.25}
DEFAULT_SALT = "cascade-split-v1"
_FRACTION_TOLERANCE = 1e-9


def check_fractions(fractions: Mapping[str, float]) -> dict[str, float]:
    """The fractions in PARTS order; ValueError naming the bad one unless they are a distribution."""
    if not isinstance(fractions, Mapping) or set(fractions) != set(PARTS):
        shown = sorted(fractions) if isinstance(fractions, Mapping) else fractions
        raise ValueError(f"fractions must map exactly {list(PARTS)} to numbers; got {shown!r}")
    for part in PARTS:
        value = fractions[part]
        if not is_real(value) or not 0 <= value <= 1:
            raise ValueError(f"fractions[{part!r}] must be a number in [0, 1]; got {value!r}")
    total = math.fsum(fractions.values())
    if abs(total - 1.0) > _FRACTION_TOLERANCE:
        raise ValueError(f"fractions must sum to 1; {dict(fractions)} sums to {total!r}")
    if fractions["train"] == 0:
        raise ValueError("fractions['train'] must be > 0: a head needs training items")
    return {part: float(fractions[part]) for part in PARTS}


def part_of(
    item_id: str,
    fractions: Mapping[str, float] = DEFAULT_FRACTIONS,
    salt: str = DEFAULT_SALT,
) -> str:
    """The part ``item_id`` belongs to: "train", "calibration" or "evaluation"."""
    return _part(_unit(item_id, salt), check_fractions(fractions))


def split_ids(
    item_ids: Iterable[str],
    fractions: Mapping[str, float] = DEFAULT_FRACTIONS,
    salt: str = DEFAULT_SALT,
) -> dict[str, list[str]]:
    """Every part's ids, sorted; each id is placed by ``part_of`` and appears once."""
    checked = check_fractions(fractions)
    parts: dict[str, list[str]] = {part: [] for part in PARTS}
    for item_id in sorted(set(item_ids)):
        parts[_part(_unit(item_id, salt), checked)].append(item_id)
    return parts


def _unit(item_id: str, salt: str) -> float:
    """A uniform number in [0, 1) from the first 8 bytes of sha256(salt NUL id)."""
    return seeded_unit(salt, item_id, "\0")


def _part(unit: float, fractions: dict[str, float]) -> str:
    edge = 0.0
    for part in PARTS:
        edge += fractions[part]
        if unit < edge:
            return part
    return next(part for part in reversed(PARTS) if fractions[part] > 0)
