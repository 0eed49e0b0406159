"""``cascade promote``: a retrained bundle replaces the serving one only where a paired comparison on
the same held-out evidence says it keeps more; every decision, with its rule and figures, goes to
the promotions log."""

from __future__ import annotations

import argparse
from pathlib import Path

from distill.cli.common import (
    add_bundle_argument,
    add_cache_dir_argument,
    add_device_argument,
    add_placement_arguments,
    add_store_argument,
    run_options,
)

KEPT_ASIDE = 1
"""Exit status when the candidate is kept aside (a decision, not an error: a script can branch)."""

DESCRIPTION = """\
Weigh a bundle made by `cascade retrain` (--candidate) against the serving one (--bundle) on the
same evidence: the held-out items that certified the candidate and the uniform draws of its
evaluation part, less any the serving bundle trained on: neither trained on them. Both are
certified afresh on all of them, at half the delta this attempt may spend (the k-th attempt since
the last promotion, counted from the log, spends delta x 6/(pi^2 k^2)), so the certificate of the
one serving after the gate holds whichever is chosen. The rule: on the same items, the share of
answers each bundle's cheap tiers keep with agreement at least a target (the plug-in share,
averaged over the questions and over five targets from the candidate's up to the one its
certificate effectively asks of these items, about 0.987 on 1,600 of them at 0.98, since served
thresholds sit there) is compared paired, item by item; the candidate replaces the serving
bundle only if the 80% paired bootstrap lower bound on how much more it keeps is above 0 (a tie
never promotes). A promoted candidate is served with the thresholds the gate certified, its
manifest's delta the level they were certified at. Kept aside, the serving bundle is served
with the thresholds the gate certified for it instead, from a copy beside the candidate
(CANDIDATE.serving), where its own keep nothing (it certified nothing yet), or where its own were
a gate's and keep fewer of the items weighed (every certificate a bundle serves between
promotions then holds together with probability 1 - 0.81 delta; one `cascade calibrate` made is
never replaced while it keeps anything). Where the store's audits show a drift alarm risen on
the serving bundle's calibration (its certificate refuted on live traffic), only the held-out
items labelled after the alarm are weighed and certify, the bundle swapped in keeps to them
(calibration.evidence_after), and with none the gate refuses, waiting for more traffic: a
promotion would otherwise lift the demotion on evidence of the traffic before the drift.
Promoted, it is swapped in as a running `cascade serve --bundle PATH` follows PATH: where PATH is a
link or a pointer file (best), it is replaced in one rename to name the candidate's folder;
where PATH is the bundle folder itself, the candidate is copied over it (the replaced bundle kept
as NAME.previous beside it). Kept aside, the candidate stays where it is with the reason in its
promotion.json. Every decision, promoted or not, is one line of PATH.promotions.jsonl: both
bundles' names, manifest hashes and calibration versions, when, the rule and its figures. It is
logged before the swap, and a run killed between the two is finished by the next promotion of
PATH; one promotion of PATH at a time (PATH.promote.lock: a second, or one beside `cascade loop`'s
gate, is refused). Exit status 0 promoted, 1 kept aside, 2 an error (one line). See
docs/retraining.md."""
EPILOG = """\
example:
  cascade retrain --bundle models/support --store labels.sqlite --out models/support-r2
  cascade promote --bundle models/support --candidate models/support-r2 --store labels.sqlite"""


def _cmd_promote(args: argparse.Namespace) -> int:
    from distill.loop.promote import promote
    from distill.loop.promotions import promotions_log
    from distill.store import LabelStore

    with LabelStore.open_existing(args.store) as store:
        record = promote(args.bundle, args.candidate, store, run=run_options(args), log=args.log)
    gate = record.gate
    print(f"rule: {gate.rule} at one-sided level {gate.alpha} ({gate.resamples} paired resamples of "
          f"{gate.weighed()} held-out items); attempt {gate.attempt} against this serving bundle")
    targets = ", ".join(f"{t:.4g}" for t in gate.band or (gate.target,))
    print(f"kept at targets {targets} (plug-in, mean over questions and targets): serving "
          f"{gate.serving_plugin:.1%}, "
          f"candidate {gate.candidate_plugin:.1%}, difference {gate.difference:+.1%}, lower bound "
          f"{gate.lower_bound:+.1%} (promotes only above 0)")
    print(f"certified on the {gate.certified()} held-out items at delta {gate.certificate_delta:.4g} each "
          f"(delta {gate.delta} x 6/(pi^2 {gate.attempt}^2) / 2):")
    rows = [("question", "serving keeps", "candidate keeps")]
    rows += [(qid, f"{share['serving']:.1%}", f"{share['candidate']:.1%}")
             for qid, share in gate.shares.items()]
    rows.append(("mean", f"{gate.serving_share:.1%}", f"{gate.candidate_share:.1%}"))
    widths = [max(len(row[column]) for row in rows) for column in range(3)]
    for row in rows:
        print("  " + "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())
    if gate.serving_before is not None:
        print(f"the serving bundle's own thresholds keep {gate.serving_before:.1%} of the same items")
    if gate.evidence_after:
        print(f"weighed only items labelled after the drift alarm of {gate.evidence_after}: {gate.set_aside} "
              "held-out items from before it set aside")
    if gate.excluded:
        print(f"{gate.excluded} held-out items of the candidate trained the serving bundle: left out of both")
    print(record.reason)
    if record.previous:
        print(f"the replaced bundle is kept at {record.previous}")
    if record.refreshed:
        print(f"serving now: {record.refreshed} (the serving bundle with the thresholds this gate certified)")
    print(f"log: {args.log or promotions_log(args.bundle)}")
    return 0 if record.promoted else KEPT_ASIDE


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("promote", help="swap a retrained bundle in only where a paired comparison says it "
                       "keeps more",
                       description=DESCRIPTION, epilog=EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    add_bundle_argument(p, "PATH: the serving bundle as `cascade serve --bundle` follows it (a link, a "
                        "pointer file or the folder; swapped if the candidate passes)")
    p.add_argument("--candidate", type=Path, required=True, metavar="DIR",
                   help="the bundle `cascade retrain` wrote (--out)")
    add_store_argument(p, "the label store both bundles were trained from")
    p.add_argument("--log", type=Path, metavar="FILE",
                   help="promotions log to append to (default: NAME.promotions.jsonl beside --bundle)")
    add_device_argument(p)
    add_cache_dir_argument(p)
    add_placement_arguments(p)
    p.set_defaults(run=_cmd_promote)
