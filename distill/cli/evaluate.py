"""``cascade evaluate``: replay a bundle's cascade on its held-out items against the teacher's labels."""

from __future__ import annotations

import argparse
import json

from distill.cli.common import (
    add_batch_size_argument,
    add_budget_arguments,
    add_bundle_argument,
    add_cache_dir_argument,
    add_corpus_argument,
    add_device_argument,
    add_on_error_argument,
    add_placement_arguments,
    add_store_argument,
    add_text_field_argument,
    budget_of,
    corpus_input,
    run_options,
)
from distill.cli.serve.upstream import add_upstream_price_argument
from distill.cli.values import output_file

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
    from distill.calibration.evaluate import evaluate_bundle, format_evaluation
    from distill.store import LabelStore

    with LabelStore.open_existing(args.store) as store:
        evaluation = evaluate_bundle(args.bundle, corpus_input(args), store, budget_of(args),
                                     batch_items=args.batch_size, run=run_options(args))
    args.json.write_text(json.dumps(evaluation.model_dump(mode="json"), indent=2) + "\n",
                         encoding="utf-8")
    print(format_evaluation(evaluation, args.upstream_price))
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
    add_bundle_argument(p)
    add_corpus_argument(p, "the labelled JSONL corpus the bundle was trained on")
    add_store_argument(p, "label store of the bundle's teacher")
    p.add_argument("--json", type=output_file, required=True, metavar="OUT.json",
                   help="where to write the full report")
    add_budget_arguments(p)
    add_text_field_argument(p, bundle=True)
    add_on_error_argument(p)
    add_batch_size_argument(p, 256, "items routed together, each batch with its own budget (default 256)")
    add_cache_dir_argument(p, "embedding cache training filled, so items are not embedded again "
                           "(default: ~/.cache/cascade, as cascade train)")
    add_device_argument(p)
    add_placement_arguments(p)
    add_upstream_price_argument(p)
    p.set_defaults(run=_cmd_evaluate)
