"""What a calibration certifies, and on which items: one object, checked once when made.

``calibrate_bundle`` (and through it ``cascade calibrate``, ``retrain``, ``promote`` and the demo)
takes its options as one ``CalibrationOptions`` instead of a dozen keyword arguments, so that a
value is checked in one place, the way ``distill.options.RunOptions`` is, and a caller that
passes the same options twice (promote certifies two bundles) cannot pass them two ways.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from cascade.checks import is_finite
from distill.calibration.inputs import SOURCES, Source
from distill.calibration.maths import CalibrationError
from distill.calibration.results import CERTIFICATES, Certificate

TEACHER_ITEMS = 16
"""Calibration items a runnable teacher is timed on: enough for its seconds per state and per
token to settle (a readout's cost is nearly linear in tokens), few enough that a 4B on a CPU
adds about a minute."""


@dataclass(frozen=True)
class CalibrationOptions:
    """Thresholds certified for ``target`` agreement with the teacher at level ``delta`` (per
    question, or for all at once with ``family_wise``); or, with ``escalation_fraction``, budget
    mode: each cheap tier escalates that share of what reaches it, and nothing is certified.

    ``certificate``: "joint" certifies a chain of cheap tiers together at the full target and
    delta, "split" gives each of m tiers (1 - target) / m and delta / m. ``source``: the items that
    certify: the bundle's calibration part ("calibration", read from the corpus), the store's
    audits ("audit", those audited at or after ``audits_since``, a Unix time, where given) or
    both. ``held_out``: the item ids that certify in place of the calibration part (a candidate's
    held-out evidence; none may have trained the bundle). ``teacher_items``: calibration items a
    runnable teacher is timed on (0: priced on the roofline). ``keep_costly_tiers``: keep a
    middle tier that costs more than it saves. ``accept_degenerate_teacher``: certify against
    labels the teacher check flags. ``save``: write the result into the bundle (False: only
    return it).
    """

    target: float = 0.98
    delta: float = 0.05
    escalation_fraction: float | None = None
    family_wise: bool = False
    certificate: Certificate = "joint"
    source: Source = "calibration"
    audits_since: float | None = None
    held_out: Collection[str] | None = None
    teacher_items: int = TEACHER_ITEMS
    keep_costly_tiers: bool = False
    accept_degenerate_teacher: bool = False
    save: bool = True

    def __post_init__(self) -> None:
        for name, value in (("target", self.target), ("delta", self.delta)):
            if not is_finite(value) or not 0 < value < 1:
                raise CalibrationError(f"{name} must be a number in (0, 1); got {value!r}")
        fraction = self.escalation_fraction
        if fraction is not None and (not is_finite(fraction) or not 0 <= fraction <= 1):
            raise CalibrationError(f"escalation_fraction must be None or a number in [0, 1]; got "
                                   f"{fraction!r}")
        for name in ("family_wise", "keep_costly_tiers", "accept_degenerate_teacher", "save"):
            if not isinstance(getattr(self, name), bool):
                raise CalibrationError(f"{name} must be True or False; got {getattr(self, name)!r}")
        if self.family_wise and fraction is not None:
            raise CalibrationError("family_wise splits delta over the questions' certificates, and budget "
                                   "mode (escalation_fraction) certifies nothing; give one or the other")
        if self.certificate not in CERTIFICATES:
            raise CalibrationError(f"certificate must be one of {', '.join(CERTIFICATES)}; got "
                                   f"{self.certificate!r}")
        if self.source not in SOURCES:
            raise CalibrationError(f"source must be one of {', '.join(SOURCES)}; got {self.source!r}")
        items = self.teacher_items
        if not isinstance(items, int) or isinstance(items, bool) or items < 0:
            raise CalibrationError(f"teacher_items must be a whole number >= 0; got {items!r}")
        if self.audits_since is not None and not is_finite(self.audits_since):
            raise CalibrationError(f"audits_since must be None or a Unix time; got {self.audits_since!r}")
        if self.held_out is not None and isinstance(self.held_out, str):
            raise CalibrationError("held_out must be a collection of item ids, not one string")

    @property
    def budget_mode(self) -> bool:
        """Whether thresholds are set for a share escalated (nothing certified)."""
        return self.escalation_fraction is not None
