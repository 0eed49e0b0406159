"""``cascade evaluate``: replay a bundle's cascade on its held-out items against the teacher's labels."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from distill.cli.common import (
    add_budget_arguments,
    add_on_error_argument,
    add_placement_arguments,
    placement_of,
    report_skipped,
)

DESCRIPTION = """\
Route the bundle's "evaluation" items (never its train or calibration items) through its tiers,
answering escalations from the label store instead of running the teacher, and report what the
cascade delivers there: agreement with the teacher (argmax equal), overall and per question;
the share of answers each tier gave; and its predicted cost relative to the teacher answering
everything. Prints a table and writes the full report as JSON."""
EPILOG = """\
example:
  cascade evaluate --bundle models/support-v1 --corpus emails.jsonl --store labels.sqlite \\
      --max-escalation 0.1 --json evaluation.json"""


def _cmd_evaluate(args: argparse.Namespace) -> int:
    from cascade.errors import RequestError
    from cascade.routing.budget import Budget
    from distill.evaluate import evaluate_bundle, format_evaluation
    from distill.store import LabelStore
    from distill.train import default_cache_dir

    if args.batch_size < 1:
        raise RequestError(f"--batch-size must be at least 1; got {args.batch_size}")
    budget = Budget(ms_per_call=args.budget_ms, max_escalation_fraction=args.max_escalation)
    with LabelStore.open_existing(args.store) as store:
        evaluation = evaluate_bundle(args.bundle, args.corpus, store, budget,
                                     text_field=args.text_field, device=args.device,
                                     batch_items=args.batch_size,
                                     cache_dir=args.cache_dir or default_cache_dir(),
                                     placement=placement_of(args), on_error=args.on_error,
                                     on_bad=report_skipped)
    args.json.write_text(json.dumps(evaluation.model_dump(mode="json"), indent=2) + "\n",
                         encoding="utf-8")
    print(format_evaluation(evaluation))
    print(f"report: {args.json}")
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "evaluate",
        help="replay a bundle's cascade on its held-out items: agreement, tier shares, cost ratio",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--bundle", type=Path, required=True, metavar="DIR", help="model bundle folder")
    p.add_argument("--corpus", type=Path, required=True, metavar="C.jsonl",
                   help="the labelled JSONL corpus the bundle was trained on")
    p.add_argument("--store", type=Path, required=True, metavar="S.sqlite",
                   help="label store of the bundle's teacher")
    p.add_argument("--json", type=Path, required=True, metavar="OUT.json",
                   help="where to write the full report")
    add_budget_arguments(p)
    p.add_argument("--text-field", metavar="NAME",
                   help="corpus field holding each state (default: the one the bundle was trained on)")
    add_on_error_argument(p)
    p.add_argument("--batch-size", type=int, default=256, metavar="N",
                   help="items routed together, each batch with its own budget (default 256)")
    p.add_argument("--cache-dir", type=Path, metavar="DIR",
                   help="embedding cache training filled, so items are not embedded again "
                   "(default: ~/.cache/cascade, as cascade train)")
    p.add_argument("--device", choices=("cpu", "cuda", "auto"), default="cpu",
                   help="where the encoder runs (default cpu)")
    add_placement_arguments(p)
    p.set_defaults(run=_cmd_evaluate)
