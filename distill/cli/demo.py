"""``cascade demo``: the whole offline flow, for real, on a generated corpus (or your own data)."""

from __future__ import annotations

import argparse
from pathlib import Path

from distill.cli.common import (
    THREADS_DEFAULT,
    add_corpus_argument,
    add_on_error_argument,
    add_placement_arguments,
    add_questions_argument,
)
from distill.cli.renamed import add_old_flag
from distill.cli.values import probability, whole_number

DESCRIPTION = """\
Run every step of the cascade, end to end, on embedded defaults:
  1. a corpus: support messages generated from parts (seeded), or your --corpus
  2. teacher labels: by default a real LLM's, Qwen2.5-Coder-1.5B-Instruct, made once with
     `cascade label` and shipped with the project, with a few items scored live by the model
     where the teachers extra is installed (--labels-from live labels every item now;
     --labels-from generator uses the corpus generator's own labels), or your --labels
  3. the encoder tier trained on them
  4. a bundle with the embedded gemma-3-270m GGUF as a readout tier between encoder and teacher
  5. thresholds calibrated for the --target-agreement with the teacher
  6. the calibration report (HTML)
  7. the evaluation items routed through the cascade: per-tier shares, agreement with the
     teacher, cost against the teacher answering everything alone
Everything goes into --workdir. A re-run reuses the label store, the embedding cache and, when
nothing it depends on changed, the calibrated bundle (--force rebuilds it)."""
EPILOG = """\
examples:
  cascade demo
  cascade demo --labels-from live          # label the corpus with the 1.5B now (about an hour)
  cascade demo --labels-from generator --items 2000
  cascade demo --labels-from generator --items 600 --gemma-items 80 --eval-items 80 --workdir /tmp/demo
  cascade demo --corpus emails.jsonl --questions q.json --labels labels.jsonl"""


CONFIG_FIELDS = {"workdir": "workdir", "items": "items", "seed": "seed", "labels_from": "teacher",
                  "live_items": "live_items", "gemma_items": "gemma_items", "eval_items": "eval_items",
                  "target_agreement": "target", "delta": "delta", "family_wise": "family_wise",
                  "threads": "threads", "gpu_layers": "gpu_layers", "extra_buffers": "extra_buffers",
                  "gguf": "gguf", "corpus": "corpus", "questions": "questions", "labels": "labels",
                  "force": "force", "on_error": "on_error"}
"""Each flag's destination -> the DemoConfig field it sets (named as every other command names it)."""


def _cmd_demo(args: argparse.Namespace) -> int:
    from distill.demo.run import DemoConfig, format_summary, run_demo

    given = {field: getattr(args, dest) for dest, field in CONFIG_FIELDS.items() if hasattr(args, dest)}
    result = run_demo(DemoConfig(**given))
    print()
    steps = ", ".join(f"{step} {seconds:.1f} s" for step, seconds in result.seconds.items())
    print(f"time per step: {steps}")
    print(format_summary(result))
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Options left out keep DemoConfig's defaults (stated in the help, checked by the tests), so
    that ``cascade --help`` need not import the library to know them."""
    p = sub.add_parser(
        "demo",
        help="run the whole flow (corpus, teacher, training, calibration, routing) on defaults",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        argument_default=argparse.SUPPRESS,
    )
    p.add_argument("--workdir", type=Path, metavar="DIR",
                   help="where every file of the run goes (default runs/demo)")
    p.add_argument("--items", type=whole_number(1), metavar="N",
                   help="messages to generate (default: the shipped teacher labels' count; 2000 with "
                   "--labels-from generator)")
    p.add_argument("--seed", type=whole_number(0), metavar="S", help="generator seed (default 0)")
    labels_from = p.add_argument(
        "--labels-from", choices=("shipped", "generator", "live"),
        help="where the labels that teach and calibrate the cascade come from: the real 1.5B LLM's "
        "shipped labels (default shipped), the corpus generator's, or the 1.5B labelling now (needs "
        "pip install -e '.[teachers]')")
    add_old_flag(p, "--teacher", labels_from)
    p.add_argument("--live-items", type=whole_number(0), metavar="N",
                   help="with the shipped labels: items the 1.5B scores live beside them, when the "
                   "teachers extra is installed; 0: none (default 3)")
    p.add_argument("--gemma-items", type=whole_number(1), metavar="N",
                   help="about N calibration items, each scored by gemma: its main cost (default 300, or "
                   "30%% of fewer than 1000 items; the split draws each item's part by its id's hash, "
                   "so the count is N give or take a few)")
    p.add_argument("--eval-items", type=whole_number(1), metavar="N",
                   help="about N evaluation items routed through the cascade (default 200, or 20%% of "
                   "fewer than 1000 items; drawn by hash as --gemma-items are)")
    target = p.add_argument("--target-agreement", type=probability, metavar="P",
                            help="share of answers that must agree with the teacher, in (0, 1) "
                            "(default 0.95)")
    add_old_flag(p, "--target", target)
    p.add_argument("--delta", type=probability, metavar="D",
                   help="allowed probability that the guarantee fails, in (0, 1) (default 0.05)")
    p.add_argument("--family-wise", action="store_true",
                   help="certify all questions at once at 1 - D (default: each question on its own)")
    p.add_argument("--threads", type=whole_number(1), metavar="N",
                   help=f"CPU threads for the encoder and gemma {THREADS_DEFAULT}")
    add_placement_arguments(p, threads=False, gpu_default=" 0")
    add_on_error_argument(p)
    p.add_argument("--gguf", type=Path, metavar="MODEL.gguf",
                   help="the readout tier's GGUF (default: the embedded gemma-3-270m)")
    add_corpus_argument(p, 'your own corpus, one {"id": ..., "text": ...} object per line '
                        "(with --questions and --labels)", required=False)
    add_questions_argument(p, required=False,
                           help='questions file for your corpus: {"questions": {id: question}}')
    p.add_argument("--labels", type=Path, metavar="LABELS.jsonl",
                   help="teacher labels of your corpus: {id, question, answer | probabilities} rows")
    p.add_argument("--force", action="store_true",
                   help="retrain and recalibrate even when the previous bundle could be reused")
    p.set_defaults(run=_cmd_demo)
