"""The calibration report: one self-contained HTML page, and the same figures as JSON.

A report is read long after the run, on another machine, maybe offline and attached to a ticket,
so the page carries everything: plots are base64 PNGs (``figures``), the style is inline,
and nothing is fetched. ``report.json`` holds the numbers behind every plot, so a figure can be
checked or redrawn without the page. This module says what the figures mean: the guarantee in
words, the summary and cost tables, and the page around them, as a ``ReportPage`` of formatted
values; the package's jinja2 template (``templates/report.html.j2``, autoescaped) lays it out, so
every value shown is escaped in one place and no HTML is written in Python.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any, Literal

import jinja2

from cascade.bundle.manifest import Bundle
from cascade.tiers.kinds import kind_of
from distill.calibration.results import CalibrationResult, QuestionTier
from distill.reports.figures import FIGURES_NEED, ReportFigure, draw_figures, matplotlib_missing, tier_seconds

HTML_NAME, JSON_NAME = "report.html", "report.json"
TEMPLATE_NAME = "report.html.j2"
"""The page's template, package data in ``distill/reports/templates``."""


@dataclass(frozen=True)
class _TeacherCost:
    """The teacher's seconds per decision, whether they were measured or estimated, and how."""

    tokens_per_state: float
    seconds_per_decision: float
    source: str
    assumption: str


def figures_note() -> str | None:
    """What a report written now says about its figures: None where they are drawn, else how to
    install what draws them."""
    return FIGURES_NEED if matplotlib_missing() else None


def write_report(result: CalibrationResult, bundle: Bundle, report_dir: Path) -> Path:
    """Write ``report.html`` and ``report.json`` into ``report_dir``; returns the HTML's path.

    Without matplotlib (the ``report`` extra) both are written without figures and say so.
    """
    report_dir = Path(report_dir)
    report_dir.mkdir(parents=True, exist_ok=True)
    teacher = _teacher_cost(result, bundle)
    figures = draw_figures(result, _option_keys(bundle), teacher.seconds_per_decision)
    summary = _summary_rows(result, bundle)
    data = {
        "bundle": result.bundle, "name": result.name, "mode": result.mode, "target": result.target,
        "delta": result.delta, "escalation_fraction": result.escalation_fraction,
        "family_wise": result.family_wise, "family_size": result.family_size,
        "unlabelled_items": result.unlabelled_items, "source": result.source,
        "audits": None if result.audits is None else result.audits.model_dump(),
        "tier_target": result.tier_target, "tier_delta": result.tier_delta,
        "calibration_items": result.items, "temperature_share": result.temperature_share,
        "guarantee": _guarantee_text(result), "not_promised": _NOT_PROMISED,
        "cost_assumption": teacher.assumption, "summary": summary,
        "costs": _cost_rows(result, teacher),
        "payoffs": {tier: payoff.model_dump() for tier, payoff in result.payoffs.items()},
        "cascades": {qid: c.model_dump() for qid, c in result.cascades.items()},
        "skipped": [s.model_dump() for s in result.skipped],
        "teacher_checks": [check.model_dump() for check in result.teacher_checks],
        "teacher_traffic": None if result.teacher_traffic is None else result.teacher_traffic.model_dump(),
        "figures": [figure.as_json() for figure in figures],
        **({"figures_note": note} if (note := figures_note()) else {}),
    }
    (report_dir / JSON_NAME).write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    path = report_dir / HTML_NAME
    path.write_text(render_page(report_page(result, bundle, data, figures)), encoding="utf-8")
    return path


def _teacher_cost(result: CalibrationResult, bundle: Bundle) -> _TeacherCost:
    """The teacher's seconds per decision: timed on calibration items where it could run here,
    else its roofline on this machine."""
    cost = result.teacher_cost
    if cost is None:
        return _roofline_teacher(result, bundle)
    tokens = cost.tokens / max(cost.states, 1)
    seconds = cost.seconds_per_state + tokens * cost.seconds_per_token
    assumption = (
        f"Teacher tier {result.teacher_tier!r} {result.teacher_cost_note}, each asked all the bundle's "
        f"questions at once (one prefill, or one call): {cost.seconds_per_state * 1e3:.1f} "
        f"ms per state + {tokens:.1f} tokens x {cost.seconds_per_token * 1e3:.3f} ms = "
        f"{seconds * 1e3:.1f} ms per decision. " + _CHEAP_MEASURED
    )
    return _TeacherCost(tokens, seconds, "measured", assumption)


def _roofline_teacher(result: CalibrationResult, bundle: Bundle) -> _TeacherCost:
    """The roofline of a teacher decision on this machine: 2 x weights x tokens / FLOP/s.

    A GGUF teacher's matmul weights come from its file; an external one (labels known by name, or
    a System One endpoint, named as such) is taken to be the 4B decision model (the router's cost
    model assumes the same). Tokens are the first cheap tier's count per state, which leaves out
    the prompt's template and question: the teacher's cost, and so the saving shown, are
    understated.
    """
    top, teacher = bundle.manifest.tiers[-1], bundle.manifest.teacher
    params, who = kind_of(top).weights(top)
    if teacher.kind == "endpoint":  # not labels known by name: the URL the bundle escalates to
        who = f"the System One endpoint of model {teacher.model!r}, taken as a {params / 1e9:.0f}B model"
    first = result.costs[result.cheap_tiers[0]]
    tokens = first.tokens / max(first.states, 1)
    seconds = 2.0 * params * tokens / result.flops_per_second
    assumption = (
        f"Teacher tier {result.teacher_tier!r} ({who}) estimated, not measured "
        f"({result.teacher_cost_note or 'not timed'}): 2 x {params:.3g} weights x "
        f"{tokens:.1f} tokens per state / {result.flops_per_second:.3g} FLOP/s (this machine's numpy "
        f"float32 matmul throughput) = {seconds * 1e3:.1f} ms per decision. The tokens are the "
        f"{first.tier} tier's count per state; the teacher's prompt adds its template and the "
        "question, so its cost and the saving are understated. " + _CHEAP_MEASURED
    )
    return _TeacherCost(tokens, seconds, "roofline estimate", assumption)


_CHEAP_MEASURED = (
    "Cheap tiers are measured on the calibration items on this machine (seconds per state + "
    "tokens x seconds per token). A question's cascade cost counts each cheap tier that can keep "
    "its answer for the share of items reaching it, and the teacher for the share escalated, as if "
    "it were the only question asked.")


def _option_keys(bundle: Bundle) -> dict[str, list[str]]:
    return {qid: q.option_keys() for qid, q in bundle.manifest.parsed_questions().items()}


_NOT_PROMISED = [
    "Not a promise about any one item: it bounds the rate of disagreement over many items, and "
    "any single answer kept by a cheap tier may still differ from the teacher's.",
    "Not under distribution shift: new kinds of states, another mix of questions, edited "
    "question wording, another teacher or prompt version all void it. Recalibrate on fresh "
    "labelled items from the new distribution.",
    "Not agreement with the truth: it is agreement with the teacher. Where the teacher is "
    "wrong, a cascade that agrees with it is wrong too.",
    "Not about items the teacher could not label (too long for its context, or failing under "
    "--on-error skip): they never enter calibration, yet the router answers them with its cheap "
    "tiers like any other item.",
    "Not certain: in up to a share delta of calibration draws the bound fails (for a question, or "
    "for some question of the family when calibrated family-wise); the report cannot tell "
    "whether this draw is one of them.",
]


def _guarantee_text(result: CalibrationResult) -> str:
    """What holds, in words: its scope (per question or all at once) first, then how."""
    if result.escalation_fraction is not None:
        return _budget_text(result) + _unlabelled_text(result)
    return (
        _scope_text(result) + " Each threshold is the lowest one a Learn-then-Test procedure "
        "(exact binomial tests in a fixed order, strict to lax) certifies on the tier's raw margin "
        "(its top probability's lead over the runner-up) over all calibration items, which never "
        "trained the heads; the temperature rescales reported probabilities only and never moves "
        "which answers are kept. A tier whose threshold could not be certified keeps nothing: the "
        "teacher answers, so the guarantee still holds, at full cost."
        + _source_text(result) + _split_text(result) + _unlabelled_text(result)
    )


def _scope_text(result: CalibrationResult) -> str:
    """Per question, each statement spends its own delta; family-wise, they share one."""
    q, delta, target = result.family_size, result.delta, f"{result.target:.4g}"
    if result.family_wise:
        return (f"For all {q} calibrated questions at once: with probability at least "
                f"{1 - delta:.1%} (1 - delta) over the draw of the calibration items, every one of "
                f"them agrees with the teacher on at least {target} (the target) of new items from "
                f"{drawn_from(result)} (family-wise: delta is split over the questions).")
    joint = (f"all {q} hold together only with probability at least {max(0.0, 1 - q * delta):.0%} "
             f"(1 - {q} x delta, by the union bound)" if q > 1 else "there is one question")
    return (f"For each question on its own: with probability at least {1 - delta:.1%} (1 - delta) "
            "over the draw of the calibration items, that question's answers agree with the "
            f"teacher on at least {target} (the target) of new items from {drawn_from(result)}. "
            f"Each question spends its own delta, so {joint}; calibrate with --family-wise "
            "(family_wise=True) for one statement about all questions at once, at a cost in "
            "coverage.")


def drawn_from(result: CalibrationResult) -> str:
    """The distribution the certificate is about, in words: the items it was certified on."""
    span = result.audits
    if result.source == "calibration" or span is None:
        return "the same distribution"
    audited = (f"the traffic the audit sampled ({span.items} items audited from {span.first} to "
               f"{span.last})")
    if result.source == "audit":
        return audited
    return (f"the pool of the calibration part ({result.items - span.items} items) and {audited}, in "
            "those proportions; for either alone only where the two are one distribution")


def _items_text(result: CalibrationResult) -> str:
    audited = 0 if result.audits is None else result.audits.items
    if result.source == "calibration":
        return f"{result.items} calibration items"
    if result.source == "audit":
        return f"{audited} audited items"
    return f"{result.items - audited} calibration items and {audited} audited ones"


def _source_text(result: CalibrationResult) -> str:
    """What a certificate on audited traffic holds for, with a leading space; or nothing."""
    if result.source == "calibration":
        return ""
    return (" Audited items are a seeded uniform share of the routed traffic, chosen before any tier "
            "ran, and the heads never trained on them: the certificate holds for traffic like it, "
            "for as long as it stays so, which the drift alarm watches on the audits made under "
            "this calibration.")


def _split_text(result: CalibrationResult) -> str:
    """How delta (and the error budget, over tiers) was split, with a leading space; or nothing."""
    m, q = len(result.cheap_tiers), result.family_size if result.family_wise else 1
    if m * q == 1:
        return ""
    dropped = (f" {', '.join(sorted(result.dropped()))} was taken out of the cascade afterwards (it "
               "cost more than it saved): its share goes unspent, and the others' certificates "
               "stand." if result.dropped() else "")
    if result.certificate == "joint" and result.mode == "agreement":
        return _chain_text(result, m, q, dropped)
    over = " x ".join(part for part, n in ((f"{m} cheap tiers", m), (f"{q} questions", q)) if n > 1)
    return (f" delta is split evenly over the {over}: each (question, tier) threshold is certified "
            f"at level {result.tier_delta:.3g}, for agreement >= {result.tier_target:.4g} per tier, "
            f"and a union bound adds them up.{dropped}")


def _chain_text(result: CalibrationResult, m: int, q: int, dropped: str) -> str:
    """The joint certificate in words: one test for the chain, delta split over questions only."""
    questions = (f" delta is split evenly over the {q} questions, each certified at level "
                 f"{result.tier_delta:.3g}, and a union bound adds them up." if q > 1 else "")
    chain = (f" The {m} cheap tiers are certified together: one Learn-then-Test test along a path "
             "of threshold vectors (built on the temperature part, tested on the other calibration "
             f"items) certifies the whole system's agreement >= {result.tier_target:.4g}, with no "
             "share of the target or of delta per tier." if m > 1 else "")
    taken = dropped.replace("its share goes unspent, and the others' certificates stand",
                            "that only sends more to the teacher, so the certificate stands")
    return chain + questions + taken


def _budget_text(result: CalibrationResult) -> str:
    fraction, m = result.escalation_fraction or 0.0, len(result.cheap_tiers)
    chain = (f" With {m} cheap tiers one after another the teacher answers about "
             f"{fraction:.0%}^{m} = {fraction ** m:.1%} of items (the shares per question are in "
             "the table)." if m > 1 else "")
    return (
        f"Budget mode: each cheap tier escalates {fraction:.0%} of the items that reach it (its "
        "least confident; its threshold is set on the calibration items the tiers below it "
        f"escalate), whatever that costs in agreement.{chain} The agreement shown is measured on "
        "the calibration items, and its lower bound (Clopper-Pearson at "
        f"{1 - result.tier_delta:.1%}) treats the threshold as if fixed in advance, which it is "
        "not. No target is certified in this mode."
    )


def _unlabelled_text(result: CalibrationResult) -> str:
    """Items without a teacher label never reach calibration, yet the router answers them."""
    if not result.unlabelled_items:
        return ""
    n = result.unlabelled_items
    return (f" {n} corpus item{'s' if n > 1 else ''} of the calibration part had no teacher label "
            "(never labelled, say by a run given --limit or --sample, or skipped by the labelling "
            "run as too long for the teacher's context or failed under --on-error skip), so "
            "calibration never saw them, and nothing here is certified about items like them; the "
            "router still answers such items with its cheap tiers.")


def _summary_rows(result: CalibrationResult, bundle: Bundle) -> list[dict[str, Any]]:
    types = {qid: q.type for qid, q in bundle.manifest.parsed_questions().items()}
    rows: list[dict[str, Any]] = []
    for fit in result.calibrations:
        rows.append({
            "question": fit.question, "type": types[fit.question], "tier": fit.tier, "n": fit.n,
            "n_temperature": fit.n_temperature, "n_threshold": fit.n_threshold,
            "temperature": fit.temperature, "ece_before": fit.ece_before,
            "ece_after": fit.ece_after, "threshold": fit.threshold, "kept_share": fit.kept_share,
            "escalation_rate": result.cascades[fit.question].answered_by[result.teacher_tier],
            "agreement": fit.agreement, "lower_bound": fit.lower_bound,
            "guarantee": _guarantee_cell(result, fit), "message": fit.message,
        })
    for skip in result.skipped:
        rows.append({"question": skip.question, "type": types[skip.question], "tier": skip.tier,
                     "guarantee": "escalates all", "message": skip.reason})
    order = list(types)
    return sorted(rows, key=lambda row: order.index(row["question"]))


def _guarantee_cell(result: CalibrationResult, fit: QuestionTier) -> str:
    if fit.tier in result.dropped():
        return "taken out of the cascade: it costs more than it saves (see Costs)"
    if result.escalation_fraction is not None:
        return "none (budget mode)"
    if fit.threshold is None:
        return "not reachable: keeps nothing"
    return f"yes: >= {fit.target:.4g} at {1 - fit.delta:.1%}"


def _cost_rows(result: CalibrationResult, teacher: _TeacherCost) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = [
        {"tier": name, "kind": cost.kind, "source": "measured", "states": cost.states,
         "tokens_per_state": cost.tokens / max(cost.states, 1),
         "seconds_per_state": cost.seconds_per_state, "seconds_per_token": cost.seconds_per_token,
         "seconds_per_decision": tier_seconds(result, name)}
        for name, cost in result.costs.items()
    ]
    measured = result.teacher_cost
    rows.append({"tier": result.teacher_tier, "kind": "teacher", "source": teacher.source,
                 "states": measured.states if measured else None,
                 "tokens_per_state": teacher.tokens_per_state,
                 "seconds_per_state": measured.seconds_per_state if measured else 0.0,
                 "seconds_per_token": (measured.seconds_per_token if measured else
                                       teacher.seconds_per_decision / max(teacher.tokens_per_state, 1e-9)),
                 "seconds_per_decision": teacher.seconds_per_decision})
    return rows


@dataclass(frozen=True, slots=True)
class Message:
    """One coloured line of the page: ok or warn, led by its tier in bold where it has one."""

    status: Literal["ok", "warn"]
    text: str
    tier: str | None = None


@dataclass(frozen=True, slots=True)
class Row:
    """One table row: plain cells, then an optional coloured last cell spanning ``span`` columns."""

    cells: list[str]
    last: str | None = None
    status: Literal["ok", "warn"] = "ok"
    span: int = 1


@dataclass(frozen=True, slots=True)
class TeacherCheck:
    """The teacher check's box; ``flagged`` heads it with what an overridden finding voids."""

    flagged: bool
    lines: list[Message]


@dataclass(frozen=True, slots=True)
class Figure:
    """One plot on the page: its base64 PNG, its id (``report.json``'s) and its title as alt text."""

    id: str
    title: str
    png: str


@dataclass(frozen=True, slots=True)
class Section:
    """One question: each tier's outcome in words, then its figures."""

    question: str
    type: str
    instructions: str
    messages: list[Message]
    figures: list[Figure]


@dataclass(frozen=True, slots=True)
class ReportPage:
    """What ``report.html.j2`` shows, every value already formatted: the template only lays it
    out and escapes it, so no HTML is written here. Plain frozen dataclasses, not pydantic: the
    values come from a validated result, and nothing reads them back."""

    name: str
    bundle: str
    tiers: str
    mode: str
    items: str
    temperature: str
    rest: str
    teacher_check: TeacherCheck | None
    guarantee: str
    not_promised: list[str]
    summary: list[Row]
    costs: list[Row]
    payoffs: list[Message]
    cost_assumption: str
    figures_note: str | None
    sections: list[Section]


@cache
def _template() -> jinja2.Template:
    """The page's template from package data, loaded and compiled once per process; every value
    it shows is escaped (autoescape on for every template), and a name it lacks is an error."""
    environment = jinja2.Environment(
        loader=jinja2.PackageLoader("distill.reports", "templates"),
        autoescape=jinja2.select_autoescape(default=True, default_for_string=True),
        undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True,
    )
    return environment.get_template(TEMPLATE_NAME)


def render_page(page: ReportPage) -> str:
    """The report's HTML: ``page`` laid out by the package's template."""
    return _template().render(page=page)


def report_page(result: CalibrationResult, bundle: Bundle, data: dict[str, Any],
                figures: list[ReportFigure]) -> ReportPage:
    """What the page shows, formatted: the run, the guarantee, the tables, then each question;
    ``data`` is what ``report.json`` holds."""
    questions = bundle.manifest.parsed_questions()
    shown = {fit.question for fit in result.calibrations} | set(result.cascades)
    scope = "for all questions at once" if result.family_wise else "per question"
    mode = (f"target agreement {result.target:.4g}, delta {result.delta:.3g} {scope}"
            if result.escalation_fraction is None
            else f"budget mode: escalation fraction {result.escalation_fraction:.3g}")
    return ReportPage(
        name=result.name, bundle=result.bundle, mode=mode, items=_items_text(result),
        temperature=f"{result.temperature_share:.0%}", rest=f"{1 - result.temperature_share:.0%}",
        tiers=" -> ".join([*(f"{name} (taken out)" if name in result.dropped() else name
                             for name in result.cheap_tiers), result.teacher_tier]),
        teacher_check=_teacher_check(result), guarantee=data["guarantee"], not_promised=_NOT_PROMISED,
        summary=[_summary_row(row) for row in data["summary"]],
        costs=[_cost_row(row) for row in data["costs"]],
        payoffs=[*(Message(status="ok" if p.kept else "warn", tier=tier, text=p.reason)
                   for tier, p in result.payoffs.items()), *_traffic_note(result)],
        cost_assumption=data["cost_assumption"], figures_note=data.get("figures_note"),
        sections=[_section(qid, questions[qid].type, questions[qid].instructions, result, figures)
                  for qid in questions if qid in shown],
    )


def _traffic_note(result: CalibrationResult) -> list[Message]:
    """What the thresholds would send a teacher behind a URL, on the certifying items."""
    traffic = result.teacher_traffic
    if traffic is None or not traffic.items:
        return []
    return [Message(status="ok", text=f"On the certifying items, {traffic.line()}.")]


def _teacher_check(result: CalibrationResult) -> TeacherCheck | None:
    """The teacher check, above the guarantee: a finding there voids what the guarantee says."""
    if not result.teacher_checks:
        return None
    return TeacherCheck(
        flagged=any(check.flagged for check in result.teacher_checks),
        lines=[Message(status="warn" if c.flagged else "ok", text=c.line()) for c in result.teacher_checks])


def _section(qid: str, qtype: str, instructions: Any, result: CalibrationResult,
             figures: list[ReportFigure]) -> Section:
    """Each tier's outcome in words, then every figure of the question in one grid."""
    messages: list[Message] = []
    for fit in (f for f in result.calibrations if f.question == qid):
        out = (" It was taken out of the cascade: it costs more than it saves (see Costs)."
               if fit.tier in result.dropped() else "")
        messages.append(Message(status="warn" if out else _status(fit), tier=fit.tier,
                                text=fit.message + out))
        if fit.temperature_note:
            messages.append(Message(status="warn", text=(
                f"tier {fit.tier}: temperature not fitted: {fit.temperature_note}; the confidences "
                f"answers report are the raw ones (ECE {fit.ece_after:.3f})")))
    for tier, cost in result.costs.items():
        counts = cost.inputs.get(qid)
        if counts is not None and (line := counts.line(tier)):
            messages.append(Message(status="warn", text=line))
    return Section(question=qid, type=qtype, instructions=str(instructions), messages=messages,
                   figures=[Figure(id=f.id, title=f.title, png=f.png) for f in figures if f.question == qid])


def _status(fit: QuestionTier) -> Literal["ok", "warn"]:
    return "ok" if fit.threshold is not None else "warn"


def _summary_row(row: dict[str, Any]) -> Row:
    """A calibrated (question, tier) with its numbers, or a skipped one with why, across the rest."""
    if "n" not in row:
        return Row(cells=[row["question"], row["type"], row["tier"]],
                   last=f"not calibrated: {row['message']}", status="warn", span=10)
    ok = row["threshold"] is not None and "taken out" not in row["guarantee"]
    return Row(cells=[row["question"], row["type"], row["tier"], f"{row['n']} ({row['n_temperature']})",
                      f"{row['temperature']:.3g}", f"{row['ece_before']:.3f}", f"{row['ece_after']:.3f}",
                      _fmt(row["threshold"], ".4g"), f"{row['kept_share']:.1%}",
                      f"{row['escalation_rate']:.1%}", f"{row['agreement']:.4f}",
                      f"{row['lower_bound']:.4f}"],
               last=row["guarantee"], status="ok" if ok else "warn")


def _cost_row(row: dict[str, Any]) -> Row:
    return Row(cells=[row["tier"], row["kind"], row["source"], _fmt(row["states"], "d"),
                      f"{row['tokens_per_state']:.1f}", f"{row['seconds_per_state']:.3g}",
                      f"{row['seconds_per_token']:.3g}", f"{row['seconds_per_decision'] * 1e3:.2f}"])


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)
