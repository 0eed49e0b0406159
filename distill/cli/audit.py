"""``cascade audit``: the certificate on audited traffic, per question, with a plot over time."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from distill.cli.common import STORE_METAVAR, store_argument

DESCRIPTION = """\
Read the audits `cascade serve` and `cascade decide --audit-store` kept in a label store (a seeded
share of routed items, each answered by the teacher on every bundle question) and replay, per
question, the anytime-valid drift alarm on the bundle's certified target: audited items, their
agreement with the teacher, the anytime bounds on it (valid however often they are read, at the
calibration's delta), the target, and the alarm. The alarm is a bet against "agreement >= target":
it rises when that bet's wealth reaches 1/delta, not when the lower bound dips below the target
(on a quiet stream the bound may sit under the target for long without evidence of drift). Only
audits made under the bundle's current calibration count, each audited state once. Writes the
agreement and its lower bound over the audited items as a PNG.

Exit status: 0 where every alarm is quiet, 3 where one rose (a cron job or a CI step can act on
it), 1 where the store holds no audit of this calibration (nothing was watched), 2 on an error."""

ALARM_STATUS = 3
"""``cascade audit``'s exit status where a drift alarm rose: it exited 0 then, as on a quiet
stream, and a script watching for drift could not tell."""


def _cmd_audit(args: argparse.Namespace) -> int:
    from cascade.bundle.manifest import Bundle
    from distill.loop.auditing import audit_report, plot_audit

    manifest = Bundle.load(args.bundle).manifest
    version = manifest.calibration.version()
    report = audit_report(manifest, version, args.store)
    rows = report.questions
    target = manifest.calibration.target
    assert target is not None  # audit_report refuses an uncalibrated bundle
    print(f"bundle {manifest.name!r}, calibration {version}, target {target}, delta "
          f"{manifest.calibration.delta}")
    print(f"{'question':<18} {'audited':>8} {'agreement':>10} {'bounds':>15} {'target':>7} "
          f"{'wealth':>9}  alarm (rises when the wealth reaches 1/delta)")
    for row in rows:
        m = row.monitor
        agreement = f"{m.agreement:.3f}" if m.agreement is not None else "-"
        alarm = (f"raised at audited item {m.alarm_at}: wealth reached {m.threshold:.3g}" if m.alarm
                 else f"quiet (wealth {m.wealth:.3g} < {m.threshold:.3g})")
        bounds = f"[{m.lower:.3f}, {m.upper:.3f}]"
        print(f"{row.question:<18} {m.items:>8} {agreement:>10} {bounds:>15} {target:>7} {m.wealth:>9.3g}  "
              f"{alarm}")
    print(f"{report.stored} audits in the store: {report.other_calibrations} of other calibrations set "
          f"aside (the alarm watches this one), {report.repeated} repeated states counted once")
    if report.stored == report.other_calibrations:  # every row above is empty: nothing was watched
        print(f"no audit of calibration {version} in {args.store}: the figures above watch nothing; a "
              "server writes its audits under the calibration it serves", file=sys.stderr)
        return 1
    if any(row.monitor.alarm for row in rows):
        print(f"to certify on what the audit saw: cascade calibrate --bundle {args.bundle} --store "
              f"{args.store} --calibrate-on traffic --report REPORT_DIR (add --audits-since TIME to keep "
              "the recent audits only)")
    plot = args.plot or (args.store.with_suffix(".audit.png") if isinstance(args.store, Path)
                         else Path(f"{args.store.database}.audit.png"))
    print(f"plot: {plot_audit(rows, target, plot)}")
    return ALARM_STATUS if any(row.monitor.alarm for row in rows) else 0


def png_path(value: str) -> Path:
    """argparse's type for --plot: a path ending in .png (the plot is a PNG, whatever the name)."""
    if not value.lower().endswith(".png"):
        raise argparse.ArgumentTypeError(f"the plot is a PNG: give a path ending in .png; got {value!r}")
    return Path(value)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("audit", help="the certificate on audited traffic: agreement, anytime bound, alarm",
                       description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog="example: cascade audit --bundle models/support-v1 --store labels.sqlite")
    p.add_argument("--bundle", type=Path, required=True, metavar="DIR", help="model bundle folder")
    p.add_argument("--store", type=store_argument, required=True, metavar=STORE_METAVAR,
                   help="the label store the audits went to (--audit-store of serve or decide)")
    p.add_argument("--plot", type=png_path, metavar="P.png", help="where to write the plot, a .png "
                   "(default: beside the store, S.audit.png; for a URL, DATABASE.audit.png here)")
    p.set_defaults(run=_cmd_audit)
