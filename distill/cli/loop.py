"""``cascade loop``: retrain and promote as one command, every N new teacher labels, restart-safe."""

from __future__ import annotations

import argparse

from distill.cli.common import (
    add_bundle_argument,
    add_store_argument,
    finetune_config,
    optional_corpus_input,
    run_options,
)
from distill.cli.retrain import add_retrain_arguments
from distill.cli.values import positive_seconds, whole_number

DESCRIPTION = """\
Watch the serving bundle's label store and keep the bundle current: every --poll seconds, count
the store's teacher labels (audits, escalations, collected requests); once --every of them are
new since the last retrain, run `cascade retrain` into a new folder PATH.versions/v-NNNN beside
--bundle PATH, then `cascade promote`, which swaps it in (a `cascade serve --bundle PATH` follows)
only where its gate says it keeps more. One decision at a time, never two retrains at once.

Beside PATH: PATH.loop.jsonl, one JSON line per decision (the label counts seen, the candidate,
promoted / kept aside / failed / discarded, the reason), also printed as one line; the gate's own
figures in PATH.promotions.jsonl; the state in PATH.loop.json (the label count at the last
retrain, the attempt counter), written atomically, so a killed loop restarts where it was: a
candidate it was making when killed is removed unfinished, never promoted, and made again when
due. PATH.loop.lock is held while the loop runs: a second `cascade loop` on PATH is refused.
A retrain or gate that fails (too little held-out evidence, say, or a missing --corpus) is logged
as failed and tried again after --every more labels, or at once by a loop started with --now
(after you fixed the command). A promotion run by hand meanwhile (`cascade promote`) is refused
while the loop's gate runs, and the other way round (PATH.promote.lock)."""
EPILOG = """\
example (serve through a link, so each promotion is one rename):
  ln -s support-v1 models/support
  cascade serve --bundle models/support --teacher http://gpu-box:8000 \\
      --audit-store labels.sqlite --escalation-share 1 &
  cascade loop --bundle models/support --store labels.sqlite --corpus emails.jsonl \\
      --every 500
  tail -f models/support.loop.jsonl
once, from cron (give it what the loop above is given):
  cascade loop --bundle models/support --store labels.sqlite --corpus emails.jsonl \\
      --every 500 --once
after fixing what made an attempt fail, try again without waiting for 500 more:
  cascade loop --bundle models/support --store labels.sqlite --corpus emails.jsonl \\
      --every 500 --once --now"""


def _cmd_loop(args: argparse.Namespace) -> int:
    from distill.loop.watch import RetrainSettings, watch

    settings = RetrainSettings(corpus=optional_corpus_input(args), finetune=finetune_config(args),
                               target=args.target_agreement, delta=args.delta, calibrate_on=args.calibrate_on,
                               teacher_items=args.teacher_items, run=run_options(args))
    decisions = watch(args.bundle, args.store, args.every, settings, poll=args.poll, once=args.once,
                      now=args.now)
    return 1 if any(decision.outcome == "failed" for decision in decisions) else 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("loop", help="retrain and promote every N new teacher labels, as one restart-safe "
                       "command", description=DESCRIPTION, epilog=EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    add_bundle_argument(p, "PATH: the serving bundle as `cascade serve --bundle` follows it (a link or "
                        "pointer file is best: a promotion then renames it; a folder is copied over)")
    add_store_argument(p, "the serving bundle's label store, watched for new teacher labels")
    p.add_argument("--every", type=whole_number(1), required=True, metavar="N",
                   help="retrain once N teacher labels are new since the last retrain")
    p.add_argument("--poll", type=positive_seconds, default=60.0, metavar="SECONDS",
                   help="seconds between two looks at the store (default 60)")
    p.add_argument("--once", action="store_true",
                   help="look once (retrain and promote if due), then exit: for cron; exit status 1 if "
                   "that attempt failed")
    p.add_argument("--now", action="store_true",
                   help="retrain at the first look whatever the count (after fixing what made an attempt "
                   "fail: a failed attempt is otherwise tried again after N more labels)")
    add_retrain_arguments(p, certificate=False,
                          finetune_help="fine-tune the encoder too at each retrain (the finetune extra)")
    p.set_defaults(run=_cmd_loop)
