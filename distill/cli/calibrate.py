"""``cascade calibrate``: set a bundle's temperatures and thresholds, and write the report."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from cascade.errors import CascadeError
from distill.cli.common import (
    add_bundle_argument,
    add_calibrate_on_argument,
    add_corpus_argument,
    add_on_error_argument,
    add_placement_arguments,
    add_store_argument,
    add_text_field_argument,
    optional_corpus_input,
    run_options,
)
from distill.cli.endpoint import (
    add_endpoint_arguments,
    add_timeout_argument,
    key_source,
    timeouts,
    url_argument,
)
from distill.cli.serve.upstream import add_upstream_price_argument
from distill.cli.values import probability, share, whole_number

TEACHER_ITEMS = 16
"""``distill.calibration.options.TEACHER_ITEMS``, repeated so that --help imports no library (a test
holds them equal)."""

if TYPE_CHECKING:
    from cascade.teachers.settings import UpstreamSettings
    from distill.calibration.inputs import Source
    from distill.calibration.results import CalibrationResult

SOURCE: dict[str, Source] = {"corpus": "calibration", "traffic": "audit", "all": "both"}
"""--calibrate-on's words (``distill.cli.common.EVIDENCE``) -> ``calibrate_bundle``'s ``source``."""

DEFAULT_TARGET = 0.98

DESCRIPTION = """\
Run every cheap tier of a bundle on its held-out calibration items (never the items the heads
were trained on), compare with the teacher's labels, and write into the bundle, per question and
tier: an acceptance threshold on the tier's raw margin (its top probability's lead over the
runner-up), set on all of the items, and a temperature (fitted on 30% of them) that rescales the
probabilities answers report without moving which answers are kept. A threshold is certified per
question: with probability >= 1 - delta over the calibration draw, that question's answers agree
with the teacher on at least the target share of new items from the same distribution. Each
question spends its own delta, so with Q questions all hold together only with probability >= 1
- Q x delta; --family-wise splits delta over the questions so that all hold at once with
probability >= 1 - delta (the cascade then keeps less). Where the target cannot be certified the
threshold stays empty (the tier keeps nothing) and the table says what is reachable. With
--escalation-fraction, each cheap tier instead escalates that share of the items that reach it
(with m cheap tiers the teacher answers about F^m of them) and the agreement that follows is
reported. Also measures each tier's cost on this machine, the teacher's too where the bundle
pins its GGUF or --teacher gives its URL (--teacher-items). A middle tier (a GGUF between the
encoder and the teacher) that costs more on the calibration items than it saves the teacher is
taken out of the cascade, with the figures printed (--keep-costly-tiers keeps it). First, the
teacher check: per question, the answer distribution, how far answers move with the input, the
first-listed option's share and the letter mass; labels that collapse onto one answer or ignore
the input are refused (--accept-degenerate-teacher). With several cheap tiers (a GGUF or
mid-layer tier between the encoder and the teacher) their thresholds are certified together, one
Learn-then-Test test of the whole system's agreement (--certificate split: each tier its share).
Writes report.html (self-contained) and report.json.

Recalibrating from the audit: `cascade serve` and `cascade decide --audit-store S` keep a seeded
uniform share of live traffic in the store, each item answered by the teacher on every question.
--calibrate-on traffic certifies on those instead (no --corpus needed; --audits-since keeps the
recent ones, e.g. those after a drift alarm): the guarantee is then about new items from the
traffic the audit sampled, for as long as it stays so, and a question the drift alarm demoted
routes again as certified (a new calibration starts the watch afresh). --calibrate-on all pools
the calibration part and the audits: it certifies the pooled mixture, so choose it only where the
two come from one distribution. The words are `cascade retrain`'s (corpus, traffic, all)."""
EPILOG = """\
example:
  cascade calibrate --bundle models/support-v1 --corpus emails.jsonl --store labels.sqlite \\
      --target-agreement 0.98 --delta 0.05 --report models/support-v1/report
  cascade calibrate --bundle models/support-v1 --store labels.sqlite --calibrate-on traffic \\
      --audits-since 2026-11-30T00:00:00Z --report models/support-v1/report
  cascade calibrate --bundle models/support-v1 --corpus emails.jsonl --store labels.sqlite \\
      --teacher https://decide.example.com/v1/systemone --report models/support-v1/report"""


def _cmd_calibrate(args: argparse.Namespace) -> int:
    from cascade.bundle.manifest import Bundle
    from distill.calibration.options import CalibrationOptions
    from distill.calibration.run import calibrate_bundle
    from distill.reports.calibration_report import figures_note, write_report
    from distill.store import LabelStore

    if args.escalation_fraction is not None and args.target_agreement is not None:
        raise CascadeError("--escalation-fraction (budget mode) and --target-agreement ask for two different "
                           "certificates; give one of them")
    if args.audits_since is not None and args.calibrate_on == "corpus":
        raise CascadeError("--audits-since selects audited items, and --calibrate-on corpus certifies on the "
                           "corpus alone; add --calibrate-on traffic (or all)")
    _check_report(args.report)
    bundle = Bundle.load(args.bundle)
    with LabelStore.open_existing(args.store) as store:
        options = CalibrationOptions(
            target=args.target_agreement or DEFAULT_TARGET, delta=args.delta,
            escalation_fraction=args.escalation_fraction,
            family_wise=args.family_wise, teacher_items=args.teacher_items,
            keep_costly_tiers=args.keep_costly_tiers, source=SOURCE[args.calibrate_on],
            audits_since=args.audits_since, accept_degenerate_teacher=args.accept_degenerate_teacher,
            certificate=args.certificate)
        result = calibrate_bundle(bundle, optional_corpus_input(args), store, options, run=run_options(args),
                                  teacher=_teacher(args))
    path = write_report(result, Bundle.load(args.bundle), args.report)
    for check in result.teacher_checks:
        if check.flagged:  # certified only because it was accepted: said before anything else
            print(f"{check.line()}\n  certified anyway (--accept-degenerate-teacher)", file=sys.stderr)
    _print_table(result)
    if result.teacher_traffic is not None and result.teacher_traffic.items:
        print(f"on the certifying items, {result.teacher_traffic.line(args.upstream_price)}")
    for check in result.teacher_checks:
        print(check.line())
    if note := figures_note():
        print(note)
    print(f"report: {path.resolve()}")
    return 0


def _teacher(args: argparse.Namespace) -> UpstreamSettings | None:
    """The URL teacher to time, where given."""
    if args.teacher is None:
        return None
    from cascade.teachers.settings import UpstreamSettings

    return UpstreamSettings(args.teacher, model=args.upstream_model, key=key_source(args),
                            **timeouts(args))


def _print_table(result: CalibrationResult) -> None:
    """One row per (question, tier), then what each unreachable target would need."""
    from distill.reports.calibration_report import drawn_from

    rows = [("question", "tier", "n", "T", "ECE", "threshold", "kept", "agreement", "bound", "guarantee")]
    for fit in result.calibrations:
        threshold = "-" if fit.threshold is None else f"{fit.threshold:.4g}"
        if result.escalation_fraction is not None:
            verdict = "budget"
        else:
            verdict = "yes" if fit.threshold is not None else "no"
        rows.append((fit.question, fit.tier, str(fit.n), f"{fit.temperature:.3g}",
                     f"{fit.ece_before:.3f}->{fit.ece_after:.3f}", threshold, f"{fit.kept_share:.1%}",
                     f"{fit.agreement:.4f}", f"{fit.lower_bound:.4f}", verdict))
    for skip in result.skipped:
        rows.append((skip.question, skip.tier, "-", "-", "-", "-", "0.0%", "-", "-", "skipped"))
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())
    for fit in result.calibrations:
        if not fit.reachable:
            print(f"{fit.question} / {fit.tier}: {fit.message}")
        if fit.temperature_note:
            print(f"{fit.question} / {fit.tier}: temperature not fitted: {fit.temperature_note}; the "
                  f"reported confidences are the raw ones (ECE {fit.ece_after:.3f})")
    for skip in result.skipped:
        print(f"{skip.question} / {skip.tier}: {skip.reason}")
    if result.escalation_fraction is None:
        print(_scope(result))
        print(f"certified on new items from {drawn_from(result)}")
    for tier, cost in result.costs.items():
        for qid, counts in cost.inputs.items():
            if line := counts.line(tier):
                print(f"{qid}: {line}")
    for tier, payoff in result.payoffs.items():
        print(f"tier {tier}: {payoff.reason}")
    print(f"teacher cost: {result.teacher_cost_note}")
    if result.unlabelled_items:
        print(f"{result.unlabelled_items} corpus items of the calibration part have no teacher label "
              "(never labelled, or skipped by the labelling run as too long or failed): not "
              "calibrated on, not covered, still routed")


def _scope(result: CalibrationResult) -> str:
    """The one line that says which statement the thresholds certify."""
    if result.family_wise:
        return (f"guarantee family-wise: all {result.family_size} questions meet the target at once "
                f"with probability >= {1 - result.delta:.1%}")
    return (f"guarantee per question: each meets the target with probability >= {1 - result.delta:.1%} "
            "on its own, not all at once (--family-wise for that)")


def _check_report(folder: Path) -> None:
    """The report's folder made, and checked writable, before the bundle is changed: a report that
    failed after the thresholds were saved left a changed bundle behind an exit status of 2."""
    if str(folder) in ("", "."):  # Path("") is the current folder: the report went there, unasked
        raise CascadeError("--report must name a folder for report.html and report.json")
    if folder.exists() and not folder.is_dir():
        raise CascadeError(f"--report {folder} is a file; give a folder for report.html and "
                           "report.json (checked before the bundle is changed)")
    folder.mkdir(parents=True, exist_ok=True)  # an OSError (a folder no one may make) is one line
    taken = [name for name in ("report.html", "report.json") if (folder / name).is_dir()]
    if taken or not os.access(folder, os.W_OK):
        raise CascadeError(f"--report {folder}: {taken[0] + ' is a folder' if taken else 'not writable'}; "
                           "give a folder the report can be written to (checked before the bundle is "
                           "changed)")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "calibrate",
        help="set a bundle's thresholds for a target agreement with the teacher, and report",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_bundle_argument(p, "bundle folder (from `cascade train`); its manifest is rewritten")
    add_corpus_argument(p, "the JSONL corpus the bundle was trained on (needed unless --calibrate-on "
                        "traffic)", required=False)
    add_store_argument(p, "the label store the bundle was trained from (teacher labels)")
    p.add_argument("--target-agreement", type=probability, metavar="P",
                   help="share of answers that must agree with the teacher, in (0, 1) (default 0.98)")
    p.add_argument("--delta", type=probability, default=0.05, metavar="D",
                   help="allowed probability that the guarantee fails, in (0, 1) (default 0.05)")
    p.add_argument("--escalation-fraction", type=share, metavar="F",
                   help="budget mode: each cheap tier escalates this share of the items that reach "
                   "it, in [0, 1], instead of meeting a target")
    add_upstream_price_argument(p)
    p.add_argument("--certificate", choices=("joint", "split"), default="joint",
                   help="with several cheap tiers: certify their thresholds together against the whole "
                   "system's agreement at the full target and delta (default), or give each tier "
                   "(1 - target) / m and delta / m of them (as before)")
    p.add_argument("--family-wise", action="store_true",
                   help="one guarantee for all questions at once: split delta over the questions "
                   "(default: each question holds on its own at 1 - delta)")
    p.add_argument("--report", type=Path, required=True, metavar="DIR",
                   help="folder for report.html and report.json (created)")
    add_text_field_argument(p, bundle=True)
    p.add_argument("--teacher-items", type=whole_number(0), default=TEACHER_ITEMS, metavar="N",
                   help="calibration items to time the teacher on, where the bundle pins its GGUF or "
                   "--teacher gives its URL, so "
                   "that budgets and the report price it as measured here (default "
                   f"{TEACHER_ITEMS}; 0: price it from its weights on the roofline). A teacher known "
                   "by its labels only is always priced on the roofline")
    url = p.add_argument_group("timing a URL teacher (a bundle labelled through a System One endpoint)")
    url.add_argument("--teacher", type=url_argument, metavar="URL",
                     help="the endpoint the labels came from (http(s)://.../v1/systemone): called on "
                     "--teacher-items states so that budgets and the report price it by its measured "
                     "latency from here; its answers must state the labels' identity (default: not "
                     "called, priced on the roofline as the 4B decision model)")
    add_endpoint_arguments(url, "endpoint")
    add_timeout_argument(url)
    p.add_argument("--accept-degenerate-teacher", action="store_true",
                   help="certify even where the teacher check finds the labels degenerate (one answer "
                   "on >= 95%% of items, answers that do not move with the input, little probability on "
                   "the option letters): refused by default, since agreement with such a teacher says "
                   "nothing; the report then puts the finding above the guarantee")
    p.add_argument("--keep-costly-tiers", action="store_true",
                   help="keep a middle tier that costs more than it saves the top tier on the "
                   "calibration items (by default it is taken out: empty thresholds, never loaded; "
                   "the figures are printed either way)")
    add_calibrate_on_argument(p, "corpus", "the audited live items in --store")
    p.add_argument("--audits-since", type=utc_time, metavar="TIME",
                   help="with --calibrate-on traffic or all: only items audited at or after TIME "
                   "(ISO 8601, e.g. 2026-11-30T12:00:00Z; no zone means UTC)")
    add_on_error_argument(p)
    add_placement_arguments(p)
    p.set_defaults(run=_cmd_calibrate)


def utc_time(text: str) -> float:
    """An ISO 8601 time as Unix seconds (UTC where it names no zone), for argparse."""
    from datetime import datetime, timezone

    try:
        moment = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an ISO 8601 time: {text!r} (e.g. 2026-11-30T12:00:00Z)"
                                         ) from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    return moment.timestamp()
