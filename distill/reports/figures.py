"""The calibration report's figures: matplotlib plots drawn to base64 PNGs, with their numbers.

Each figure keeps the numbers it was drawn from, which ``report.json`` holds beside it, so a
plot can be checked or redrawn without the page. Drawn with the Agg renderer on a ``Figure``
of its own: no display, no pyplot state shared between calls. matplotlib comes with the
``report`` extra and is imported only to draw: without it there are no figures, and
``FIGURES_NEED`` says how to get them.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from distill.calibration.results import CalibrationResult, QuestionTier

if TYPE_CHECKING:
    from matplotlib.figure import Figure

FIGURES_NEED = "figures need matplotlib: pip install -e '.[report]'"
_DPI = 110
_SIZE = (5.2, 3.7)


@dataclass(frozen=True)
class ReportFigure:
    """One plot: where it belongs, what it shows, the numbers behind it and its PNG."""

    id: str
    question: str
    tier: str | None
    kind: str
    title: str
    data: dict[str, Any]
    png: str

    def as_json(self) -> dict[str, Any]:
        return {"id": self.id, "question": self.question, "tier": self.tier, "kind": self.kind,
                "title": self.title, "data": self.data}


def tier_seconds(result: CalibrationResult, tier: str) -> float:
    """Measured seconds of one decision of a cheap tier, on a calibration state of mean length."""
    cost = result.costs[tier]
    return cost.seconds_per_state + cost.tokens / max(cost.states, 1) * cost.seconds_per_token


def matplotlib_missing() -> bool:
    """True where matplotlib cannot be imported (the ``report`` extra is not installed)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return True
    return False


def draw_figures(
    result: CalibrationResult, keys: Mapping[str, list[str]], teacher_seconds: float
) -> list[ReportFigure]:
    """Three figures per calibrated (question, tier), then one cost figure per question; none
    without matplotlib."""
    if matplotlib_missing():
        return []
    figures: list[ReportFigure] = []
    for fit in result.calibrations:
        for kind, draw in _TIER_FIGURES.items():
            data, fig = draw(fit, keys[fit.question])
            figures.append(_figure(fit.question, fit.tier, kind, fig, data))
    for qid, shares in result.cascades.items():
        data = _cost_data(result, qid, teacher_seconds)
        figures.append(_figure(qid, None, "cost", _cost_plot(qid, data, shares.answered_by), data))
    return figures


def _figure(question: str, tier: str | None, kind: str, fig: Figure, data: dict[str, Any]) -> ReportFigure:
    title = str(fig.axes[0].get_title()) if fig.axes else kind
    ident = "-".join(part for part in (question, tier, kind) if part)
    return ReportFigure(ident, question, tier, kind, title, data, _png(fig))


def _png(fig: Figure) -> str:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    buffer = io.BytesIO()
    FigureCanvasAgg(fig)
    fig.savefig(buffer, format="png", dpi=_DPI)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def _reliability(fit: QuestionTier, keys: list[str]) -> tuple[dict[str, Any], Figure]:
    """Mean confidence against agreement per bin, raw and after temperature scaling.

    One marker per non-empty bin, its area growing with the bin's items: with a few dozen
    items most bins hold a handful, and lines between them would suggest a trend that is noise.
    """
    n = fit.n - fit.n_temperature  # the items the temperature was not fitted on
    data = {"temperature": fit.temperature, "ece_before": fit.ece_before, "ece_after": fit.ece_after,
            "n": n, "before": fit.reliability_before, "after": fit.reliability_after}
    fig, ax = _axes()
    ax.plot([0, 1], [0, 1], color="#999", lw=1, ls=":", label="perfect calibration")
    for curve, color, label in (
        (fit.reliability_before, "#c0392b", f"raw (ECE {fit.ece_before:.3f})"),
        (fit.reliability_after, "#2471a3", f"T={fit.temperature:.3g} (ECE {fit.ece_after:.3f})"),
    ):
        sizes = 12 + 140 * np.asarray(curve["count"]) / max(n, 1)
        ax.scatter(curve["confidence"], curve["accuracy"], s=sizes, color=color, alpha=0.75, label=label,
                   zorder=3)
    ax.set(xlim=(0, 1.02), ylim=(0, 1.02), xlabel="confidence (top probability)",
           ylabel="agreement with the teacher",
           title=f"{fit.question} / {fit.tier}: reliability ({n} items not used to fit T)")
    ax.legend(loc="best", fontsize=8)
    return data, fig


def _coverage(fit: QuestionTier, keys: list[str]) -> tuple[dict[str, Any], Figure]:
    """Share kept by the tier against the cascade's agreement, as the threshold falls."""
    curve = fit.curve
    data = {"curve": curve, "target": fit.target, "delta": fit.delta, "threshold": fit.threshold,
            "kept_share": fit.kept_share, "agreement": fit.agreement, "lower_bound": fit.lower_bound,
            "escalation_rate": 1.0 - fit.kept_share, "reachable": fit.reachable}
    fig, ax = _axes()
    kept = [0.0, *curve["kept_share"]]
    ax.plot(kept, [1.0, *curve["agreement"]], color="#2471a3", lw=1.5, label="empirical agreement")
    ax.plot(kept, [1.0, *curve["lower_bound"]], color="#2471a3", lw=1, ls="--",
            label=f"{1 - fit.delta:.1%} lower bound")
    if fit.target is not None:
        ax.axhline(fit.target, color="#c0392b", lw=1, label=f"target {fit.target:.4g}")
    ax.axvline(fit.kept_share, color="#d35400", lw=1, ls=":")
    ax.scatter([fit.kept_share], [fit.agreement], s=70, color="#d35400", zorder=4, marker="D",
               label=_chosen_label(fit))
    floor = min([*curve["lower_bound"], fit.target or 1.0, 1.0])
    ax.set(xlim=(-0.02, 1.02), ylim=(max(0.0, floor - 0.05), 1.005),
           xlabel="coverage: share kept (threshold on the raw margin)",
           ylabel="cascade agreement with the teacher",
           title=f"{fit.question} / {fit.tier}: coverage vs agreement")
    ax.legend(loc="lower left", fontsize=8)
    return data, fig


def _chosen_label(fit: QuestionTier) -> str:
    if fit.threshold is None:
        return "chosen: keep nothing"
    return f"chosen: t={fit.threshold:.3g}, keeps {fit.kept_share:.0%}"


def _confusion(fit: QuestionTier, keys: list[str]) -> tuple[dict[str, Any], Figure]:
    """Which answer the tier gave (columns) for each answer of the teacher (rows)."""
    matrix = np.asarray(fit.confusion)
    data = {"options": keys, "rows": "teacher", "columns": fit.tier, "matrix": fit.confusion,
            "n": fit.n}
    fig, ax = _axes()
    ax.imshow(matrix, cmap="Blues")
    k = len(matrix)
    for (row, col), count in np.ndenumerate(matrix):
        dark = count > matrix.max() / 2
        ax.text(col, row, str(count), ha="center", va="center", fontsize=max(6, 12 - k // 2),
                color="white" if dark else "black")
    ax.set_xticks(range(k), keys, rotation=30 if k > 4 else 0, fontsize=8)
    ax.set_yticks(range(k), keys, fontsize=8)
    ax.set(xlabel=f"{fit.tier} answer", ylabel="teacher answer",
           title=f"{fit.question} / {fit.tier}: confusion ({fit.n} items)")
    return data, fig


def _cost_data(result: CalibrationResult, qid: str, teacher_seconds: float) -> dict[str, Any]:
    """Expected seconds per decision of the cascade for one question, against the teacher alone."""
    shares = result.cascades[qid].answered_by
    keepers = {fit.tier for fit in result.calibrations if fit.question == qid and fit.threshold is not None}
    keepers -= result.dropped()
    reach, tiers = 1.0, {}
    for name in result.cheap_tiers:
        seconds = tier_seconds(result, name) if name in keepers else 0.0
        tiers[name] = {"reach": reach, "seconds_per_decision": seconds, "expected": reach * seconds}
        reach -= shares.get(name, 0.0)
    cascade = sum(row["expected"] for row in tiers.values()) + reach * teacher_seconds
    return {"tiers": tiers, "escalation_rate": reach, "teacher_seconds": teacher_seconds,
            "cascade_seconds": cascade, "ratio": cascade / teacher_seconds}


def _cost_plot(qid: str, data: dict[str, Any], answered_by: Mapping[str, float]) -> Figure:
    """The teacher alone against the cascade's expected cost, split by the tier that pays it."""
    fig, ax = _axes()
    teacher_ms = data["teacher_seconds"] * 1e3
    ax.barh(["teacher\nalone"], [teacher_ms], color="#999")
    left = 0.0
    colors = iter(["#2471a3", "#5dade2", "#a9cce3"])
    for name, row in data["tiers"].items():
        ax.barh(["cascade\n(expected)"], [row["expected"] * 1e3], left=left, color=next(colors, "#ccc"),
                label=f"{name}: reached by {row['reach']:.0%}")
        left += row["expected"] * 1e3
    escalated = data["escalation_rate"] * teacher_ms
    ax.barh(["cascade\n(expected)"], [escalated], left=left, color="#999", hatch="//",
            label=f"teacher: escalated {data['escalation_rate']:.0%}")
    for row, value in ((0, teacher_ms), (1, data["cascade_seconds"] * 1e3)):
        ax.text(value, row, f" {value:.1f} ms", va="center", fontsize=9)
    ax.set_xlim(0, max(teacher_ms, data["cascade_seconds"] * 1e3, 1e-3) * 1.35)
    ax.set(xlabel="milliseconds per decision on this machine",
           title=f"{qid}: cost per decision, {data['ratio']:.1%} of the teacher's")
    ax.legend(loc="upper right", fontsize=8)
    return fig


_TIER_FIGURES: dict[str, Callable[[QuestionTier, list[str]], tuple[dict[str, Any], Figure]]] = {
    "reliability": _reliability, "coverage": _coverage, "confusion": _confusion,
}


def _axes() -> tuple[Figure, Any]:
    from matplotlib.figure import Figure

    fig = Figure(figsize=_SIZE, layout="constrained")
    return fig, fig.add_subplot()
