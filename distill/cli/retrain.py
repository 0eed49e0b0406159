"""``cascade retrain``: a new bundle trained on everything the serving bundle's store holds, calibrated
on held-out evidence, ready for ``cascade promote``."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from distill.cli.calibrate import TEACHER_ITEMS
from distill.cli.common import (
    THREADS_DEFAULT,
    add_bundle_argument,
    add_cache_dir_argument,
    add_calibrate_on_argument,
    add_corpus_argument,
    add_device_argument,
    add_on_error_argument,
    add_placement_arguments,
    add_store_argument,
    add_text_field_argument,
    finetune_config,
    optional_corpus_input,
    run_options,
)
from distill.cli.values import local_threads, probability, whole_number

if TYPE_CHECKING:
    from distill.loop.retrain import RetrainResult

DESCRIPTION = """\
Retrain the serving bundle's fast tier on every teacher-labelled state its label store holds: the
corpus labels (their states read from --corpus), the audits, and what serving adds (escalations,
collected traffic). Each state counts once (the same state audited twice, or seen in the corpus
and again as traffic, is one item); the store's teacher must be the bundle's. Items keep the part
the serving bundle's split gives their id, so an item never moves as traffic grows; escalations
and what the serving bundle trained on go to the train part. The new bundle is calibrated on the
calibration part's uniform draws (--calibrate-on: all of them, traffic only, or the corpus only,
the words `cascade calibrate` takes):
escalations are chosen by the serving cascade, so they train but never certify, except census
escalations: those of questions the serving cascade sent to the teacher whatever the item (it
held no threshold for them yet), a uniform draw of traffic like an audit. It is written to
--out with its evidence (evidence.jsonl) and lineage (lineage.json); the serving bundle is not
touched: `cascade promote` swaps the new one in only where its gate's paired comparison says it
keeps more (a tie never does). Two retrains into one --out at once: the second is refused."""
EPILOG = """\
example:
  cascade retrain --bundle models/support --store labels.sqlite --corpus emails.jsonl \\
      --out models/support-r2 --finetune
  cascade promote --bundle models/support --candidate models/support-r2 --store labels.sqlite"""



def _cmd_retrain(args: argparse.Namespace) -> int:
    from cascade.bundle.manifest import Bundle
    from cascade.serve.swap import resolve
    from distill.loop.auditing import drift_alarms
    from distill.loop.retrain import retrain_bundle
    from distill.store import LabelStore

    serving = Bundle.load(resolve(args.bundle))  # a folder, a link to one, or a pointer file
    with LabelStore.open_existing(args.store) as store:
        result = retrain_bundle(serving, store, args.out, optional_corpus_input(args),
                                finetune=finetune_config(args), target=args.target_agreement,
                                delta=args.delta, calibrate_on=args.calibrate_on,
                                certificate=args.certificate, run=run_options(args),
                                teacher_items=args.teacher_items)
        alarmed = sorted(drift_alarms(serving.manifest, store.each_audit()))
    _print(result, args)
    if alarmed:
        print(f"a drift alarm rose on the serving bundle's calibration ({', '.join(alarmed)}): the "
              "certificate above rests on items labelled before it too; `cascade promote` weighs and "
              "certifies both bundles only on the items labelled after it")
    return 0


def _print(result: RetrainResult, args: argparse.Namespace) -> None:
    evidence, calibration = result.lineage["evidence"], result.calibration
    origins = ", ".join(f"{n} {origin}" for origin, n in sorted(evidence["origins"].items()))
    print(f"evidence: {evidence['items']} labelled states ({origins}); {evidence['duplicates']} repeats "
          "counted once")
    print("parts: " + ", ".join(f"{part} {n}" for part, n in evidence["parts"].items())
          + f"; certified on {len(result.lineage['certified_on'])} held-out items ({args.calibrate_on})")
    if unequal := evidence["certified_on_unequal"]:
        drawn = "; ".join(f"{int(d['items'])} {origin} drawn at {d['lowest']:.3g}-{d['highest']:.3g}"
                          for origin, d in sorted(unequal.items()))
        print(f"drawn unequally: {drawn} (a queue that dropped at random under load, or a share changed "
              "between runs): the certificate counts each item alike, so it leans toward the periods "
              "drawn most; each item's probability is in the store")
    for qid, shares in calibration.cascades.items():
        cheap = 1 - shares.answered_by.get(calibration.teacher_tier, 1.0)
        tiers = ", ".join(f"{tier} {share:.1%}" for tier, share in shares.answered_by.items())
        print(f"{qid}: cheap tiers keep {cheap:.1%} ({tiers}), agreement {shares.agreement:.4f} at target "
              f"{calibration.target} / delta {calibration.delta} ({calibration.certificate} certificate)")
    for fit in calibration.calibrations:
        if not fit.reachable:
            print(f"{fit.question} / {fit.tier}: {fit.message}")
    print(f"bundle: {result.bundle.directory.resolve()}")
    print(f"next: cascade promote --bundle {args.bundle} --candidate {args.out} --store {args.store}")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("retrain", help="retrain the fast tier on everything the label store holds, into a "
                       "new calibrated bundle", description=DESCRIPTION, epilog=EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    add_bundle_argument(p, "the serving bundle: its folder, a link to it or a pointer file, as `cascade "
                        "serve --bundle` takes it (read, never written)")
    add_store_argument(p, "the serving bundle's label store: corpus labels, audits, escalations, traffic")
    p.add_argument("--out", type=Path, required=True, metavar="DIR",
                   help="folder of the new bundle (created; an earlier bundle there is replaced)")
    add_retrain_arguments(p, certificate=True,
                          finetune_help="fine-tune the encoder too (the finetune extra: pip install -e "
                          "'.[finetune]')")
    p.set_defaults(run=_cmd_retrain)


def add_retrain_arguments(p: argparse.ArgumentParser, *, certificate: bool, finetune_help: str) -> None:
    """What a retrain reads and how it certifies and runs: retrain's flags, which ``cascade loop``
    takes too for the retrains it starts (``certificate``: offer --certificate)."""
    add_corpus_argument(p, "the corpus of the store's corpus labels (needed where it holds any)",
                        required=False)
    add_text_field_argument(p, bundle=True)
    add_on_error_argument(p)
    p.add_argument("--target-agreement", type=probability, metavar="P",
                   help="agreement to certify, in (0, 1) (default: the serving bundle's)")
    p.add_argument("--delta", type=probability, metavar="D", help="in (0, 1) (default: the serving bundle's)")
    add_calibrate_on_argument(p, "all", "the audited, collected and census-escalated states in --store")
    if certificate:
        p.add_argument("--certificate", choices=("joint", "split"), default="joint",
                       help="several cheap tiers: one certificate for the chain (default), or each tier its "
                       "share of the target and delta")
    p.add_argument("--teacher-items", type=whole_number(0), default=TEACHER_ITEMS, metavar="N",
                   help=f"calibration items to time a GGUF teacher on (default {TEACHER_ITEMS}; 0: price it "
                   "on the roofline)")
    p.add_argument("--finetune", action="store_true", help=finetune_help)
    p.add_argument("--epochs", type=whole_number(1), metavar="N", help="with --finetune: most epochs")
    p.add_argument("--seed", type=whole_number(0), metavar="S", help="with --finetune: the seed")
    p.add_argument("--threads", type=local_threads, metavar="N",
                   help=f"CPU threads of every model {THREADS_DEFAULT}")
    add_device_argument(p)
    add_cache_dir_argument(p)
    add_placement_arguments(p, threads=False)
