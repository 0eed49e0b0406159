"""``cascade train``: fit the encoder tier on a label store's teacher labels into a model bundle."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from distill.cli.common import (
    CORPUS_HELP,
    THREADS_DEFAULT,
    add_bundle_argument,
    add_cache_dir_argument,
    add_corpus_argument,
    add_device_argument,
    add_on_error_argument,
    add_questions_argument,
    add_store_argument,
    add_text_field_argument,
    corpus_input,
    finetune_config,
    run_options,
)
from distill.cli.values import positive_number, whole_number

if TYPE_CHECKING:
    from cascade.tiers.kinds import AnyTierSpec
    from distill.training.mid_layer import MidLayerConfig

DEFAULT_EPOCHS = 4
"""FinetuneConfig's default, stated here so that ``cascade --help`` need not import the library
(a test checks the two agree)."""

DESCRIPTION = """\
Embed every corpus item the label store has teacher labels for (once: vectors are cached, so a
retrain re-embeds nothing), split the items by a hash of their id into train / calibration /
evaluation parts, and fit one softmax head per question on the train part with the teacher's
probabilities; each head reads the item's embedding with its hashed word 1-2 grams beside it
(--no-ngrams: the embedding alone). Writes a bundle folder: manifest.json (tiers, pinned model
files, questions, thresholds to be calibrated), heads.npz, ngrams.npz and split.json. A question
with too few train labels, or a single answer among them, gets no head and starts at the next
tier.

--finetune first trains the encoder itself on the train part's teacher probabilities (one head
per question, soft cross-entropy, a held-out tenth picking the epoch), exports it as int8 ONNX
into the bundle (encoder.onnx, sha256-pinned) and fits the heads on its vectors; routing,
calibration and evaluation then use it as they use the shared encoder. It needs the finetune
extra (pip install -e '.[finetune]': torch 2.13.0 CPU and the float MiniLM) and takes
about 12 minutes per 2,000 AG News items on one core here (see BENCHMARKS.md for what it buys).
The bundle is built beside --bundle and swapped in whole, so an interrupted run leaves the
previous bundle as it was."""
EPILOG = """\
example:
  cascade train --questions q.json --corpus emails.jsonl --store labels.sqlite \\
      --bundle models/support-v1 --teacher-model qwen3.5-4b-q4_k_m.gguf"""



def _layer_or_auto(text: str) -> int | str:
    return "auto" if text == "auto" else whole_number(1)(text)


def _mid_layer_config(args: argparse.Namespace) -> MidLayerConfig | None:
    from cascade.readout.placement import Placement
    from distill.training.mid_layer import MidLayerConfig, MidLayerError

    if args.mid_layer is None:
        if args.mid_layer_items is not None or args.mid_layer_reader != "head":
            raise MidLayerError("--mid-layer-reader and --mid-layer-items set how the mid-layer tier is "
                                "trained; add --mid-layer L or --mid-layer auto")
        return None
    return MidLayerConfig(layer=args.mid_layer, reader=args.mid_layer_reader, max_items=args.mid_layer_items,
                          placement=Placement(gpu_layers=args.teacher_gpu_layers, threads=args.threads))


def _tier_text(tier: AnyTierSpec) -> str:
    """A tier's name, with its blocks for a mid-layer tier."""
    from cascade.tiers.mid_layer import MidLayerSpec

    if isinstance(tier, MidLayerSpec):
        return f"{tier.name} (first {tier.layer} of {tier.n_layer} blocks, {tier.reader})"
    return tier.name


def _cmd_train(args: argparse.Namespace) -> int:
    from cascade.corpus import load_questions
    from cascade.readout.placement import Placement
    from distill.calibration.teacher_check import judge_store
    from distill.store import LabelStore
    from distill.training.mid_layer import AUTO_TARGET
    from distill.training.run import middle_tier, train_bundle

    questions = load_questions(args.questions)
    with LabelStore.open_existing(args.store) as store:
        store.check_questions(questions)
        checks = judge_store(store, questions)
        bundle = train_bundle(
            questions, corpus_input(args), store, args.bundle, C=args.C, run=run_options(args),
            teacher_model=args.teacher_model, teacher_placement=Placement(gpu_layers=args.teacher_gpu_layers),
            ngrams=args.ngrams, finetune=finetune_config(args),
            middle=[middle_tier(path, n_ctx=args.middle_n_ctx) for path in args.middle],
            mid_layer=_mid_layer_config(args),
        )
    tier = bundle.manifest.encoder_tier
    heads = tier.heads if tier is not None else {}
    rows = [("question", "train n", "held-out n", "agreement", "head")]
    for qid, info in heads.items():
        agreement = "-" if info.held_out_agreement is None else f"{info.held_out_agreement:.3f}"
        rows.append((qid, str(info.train_items), str(info.held_out_items), agreement,
                     "yes" if info.has_head else f"none: {info.skipped}"))
    widths = [max(len(row[column]) for row in rows) for column in range(4)]
    for row in rows:
        cells = [cell.ljust(width) for cell, width in zip(row[:4], widths, strict=True)]
        print("  ".join([*cells, row[4]]))
    for candidate in bundle.manifest.training.mid_layer or []:
        print(f"mid-layer {candidate.layer:>3}: held-out agreement {candidate.agreement:.3f}, kept at "
              f"{AUTO_TARGET} {candidate.kept:.3f}, estimated cost {candidate.cost:.3f} of the teacher")
    for check in checks:  # what training learnt from; calibrate refuses a degenerate teacher
        print(check.line(), file=sys.stderr)
    print(f"tiers: {' -> '.join(_tier_text(tier) for tier in bundle.manifest.tiers)}")
    print(f"bundle: {bundle.directory.resolve()}")
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train",
        help="fit the fast encoder tier on teacher labels into a model bundle",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_questions_argument(p)
    add_corpus_argument(p, f"the labelled {CORPUS_HELP}")
    add_store_argument(p, "label store holding the teacher's labels (from `cascade label`)")
    add_bundle_argument(p, "bundle folder to write (created; an existing bundle there is replaced)")
    add_text_field_argument(p)
    add_on_error_argument(p)
    p.add_argument("--C", type=positive_number, default=1.0, metavar="C",
                   help="inverse L2 regularisation strength of the heads (default 1.0)")
    p.add_argument("--no-ngrams", dest="ngrams", action="store_false",
                   help="heads read the sentence embedding alone, without the hashed word 1-2 grams "
                   "beside it (by default they read both: on the benchmark sets the fast tier then "
                   "keeps more at the same certified agreement; see BENCHMARKS.md)")
    add_device_argument(p, "where the encoder runs (default cpu; cuda needs onnxruntime-gpu)")
    p.add_argument("--teacher-model", type=Path, metavar="MODEL.gguf",
                   help="the teacher's GGUF, pinned as the top tier (needed when the store's "
                   "teacher is a GGUF; its sha256 must match the store's). A store labelled through a "
                   "URL (label --teacher URL, or collected traffic) needs none: the bundle records the "
                   "endpoint's identity, and decide/serve --teacher URL answer its top tier, checked")
    p.add_argument("--teacher-gpu-layers", type=whole_number(0), metavar="N",
                   help="record N GPU layers as the teacher tier's default placement (decide, "
                   "calibrate and evaluate use it unless given --gpu-layers); default: none (CPU)")
    p.add_argument("--middle", type=Path, action="append", default=[], metavar="MODEL.gguf",
                   help="a GGUF logit-readout tier between the encoder and the teacher, named after its "
                   "file (repeat for several, cheapest first); it keeps nothing until `cascade "
                   "calibrate` certifies its thresholds, and is worth it only where it answers enough "
                   "escalations to pay for reading all of them (BENCHMARKS.md measures a 0.5B)")
    p.add_argument("--middle-n-ctx", type=whole_number(1), default=4096, metavar="N",
                   help="context size of the middle tiers (default 4096)")
    p.add_argument("--mid-layer", type=_layer_or_auto, metavar="L|auto",
                   help="add the teacher's own first L blocks as a tier just below it: each question is "
                   "answered from the layer-L state at its answer position, at about L/N of a teacher "
                   "pass (needs --teacher-model). 'auto' reads about 8 candidate layers in one pass "
                   "per train item and keeps the one whose estimated cascade cost on held-out train "
                   "items is lowest; the sweep is printed and kept in the manifest. Like every tier "
                   "it keeps nothing until `cascade calibrate` certifies it (BENCHMARKS.md: where it pays)")
    p.add_argument("--mid-layer-reader", choices=("head", "lens"), default="head",
                   help="how the mid-layer tier reads a state: a softmax head per question trained on "
                   "the teacher's labels (default), or the logit lens (the model's final norm and its "
                   "option letters' output rows; no training)")
    p.add_argument("--mid-layer-items", type=whole_number(10), metavar="N",
                   help="collect the mid-layer states of at most N train items (the same ones on every "
                   "run); default: all of them")
    p.add_argument("--finetune", action="store_true",
                   help="fine-tune the encoder on the teacher's labels and serve it from the bundle as "
                   "int8 ONNX (needs the finetune extra; minutes to hours on a CPU)")
    p.add_argument("--epochs", type=whole_number(1), metavar="N",
                   help=f"with --finetune: most epochs; a held-out tenth stops earlier when it stops "
                   f"improving (default {DEFAULT_EPOCHS})")
    p.add_argument("--seed", type=whole_number(0), metavar="S",
                   help="with --finetune: seed of the shuffles, the held-out tenth and the heads' "
                   "initial weights; the same seed and threads give the same encoder (default 0)")
    p.add_argument("--threads", type=whole_number(1), metavar="N",
                   help="CPU threads of every model training runs: the encoder, the teacher's blocks "
                   f"with --mid-layer, torch with --finetune {THREADS_DEFAULT}")
    add_cache_dir_argument(p)
    p.set_defaults(run=_cmd_train)
