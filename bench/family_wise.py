"""What a family-wise guarantee costs in coverage, on the demo corpus.

By default each question's thresholds are certified at level delta on their own, so with Q
questions all Q statements hold together only with probability >= 1 - Q x delta. Family-wise
calibration splits delta over the Q questions (Bonferroni), so that all hold at once with
probability >= 1 - delta. This runs the library as a user would, twice on the same bundle:
the demo's generated support messages (``distill.demo.synthetic``, its labels imported as the
teacher), the encoder tier trained on the 50% train part, ``calibrate_bundle`` on the 25%
calibration part per question and family-wise, and ``evaluate_bundle`` on the 25% evaluation
part (escalations answered from the recorded labels). It prints, per question, the share the
encoder keeps on the calibration items and on the evaluation items, and the cost ratio.

    .venv/bin/python -m bench.family_wise --items 2000 --target 0.95 --delta 0.05
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from bench.common import CACHE_DIR, argument_parser
from cascade.bundle.manifest import Bundle
from cascade.corpus import load_questions
from cascade.cost.roofline import measure_cpu_flops
from cascade.encoder.onnx_encoder import Encoder
from distill.calibration.evaluate import Evaluation, evaluate_bundle
from distill.calibration.options import CalibrationOptions
from distill.calibration.results import CalibrationResult
from distill.calibration.run import calibrate_bundle
from distill.demo.synthetic import generate, write_corpus, write_labels, write_questions
from distill.labelling.transfer import import_labels
from distill.options import CorpusInput, RunOptions
from distill.store import LabelStore, Teacher
from distill.training.run import train_bundle


def run(family_wise: bool, bundle: Bundle, corpus: Path, store: LabelStore, args: argparse.Namespace,
        encoder: Encoder, flops: float) -> tuple[CalibrationResult, Evaluation]:
    copy = Bundle(bundle.manifest, bundle.directory, bundle.heads).save(
        bundle.directory.parent / ("family" if family_wise else "per-question"))
    result = calibrate_bundle(copy, CorpusInput(corpus), store,
                              CalibrationOptions(target=args.target, delta=args.delta,
                                                 family_wise=family_wise),
                              run=RunOptions(progress=False, flops_per_second=flops), encoder=encoder)
    evaluation = evaluate_bundle(copy.directory, CorpusInput(corpus), store,
                                 run=RunOptions(progress=False, cache_dir=CACHE_DIR, flops_per_second=flops))
    return result, evaluation


def rows(name: str, result: CalibrationResult, evaluation: Evaluation) -> list[str]:
    out = []
    for fit in result.calibrations:
        shares = {t.name: t.share for t in evaluation.questions[fit.question].tiers}
        threshold = "-" if fit.threshold is None else f"{fit.threshold:.4f}"
        out.append(f"{name:<13} {fit.question:<11} {result.tier_delta:>8.4f} {threshold:>9} "
                   f"{fit.kept_share:>9.1%} {shares['encoder']:>9.1%} "
                   f"{evaluation.questions[fit.question].agreement:>9.4f}")
    kept = next(t.share for t in evaluation.tiers if t.name == "encoder")
    out.append(f"{name:<13} {'all':<11} {'':>8} {'':>9} {'':>9} {kept:>9.1%} {evaluation.agreement:>9.4f}"
               f"   cost ratio {evaluation.cost_ratio:.3f}")
    return out


def main() -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("--items", type=int, default=2000, help="generated messages (demo default 2000)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--target", type=float, default=0.95)
    parser.add_argument("--delta", type=float, default=0.05)
    args = parser.parse_args()
    encoder, flops = Encoder(), measure_cpu_flops()
    with tempfile.TemporaryDirectory(prefix="cascade-family-wise-") as work:
        root = Path(work)
        items = generate(args.items, args.seed)
        corpus = write_corpus(items, root / "corpus.jsonl")
        questions = load_questions(write_questions(root / "questions.json"))
        with LabelStore(root / "labels.sqlite", Teacher(kind="external", model="generator")) as store:
            import_labels(store, write_labels(items, root / "labels.jsonl"), questions)
            bundle = train_bundle(questions, CorpusInput(corpus), store, root / "bundle", encoder=encoder,
                                  run=RunOptions(progress=False, cache_dir=CACHE_DIR))
            runs = {name: run(name == "family-wise", bundle, corpus, store, args, encoder, flops)
                    for name in ("per-question", "family-wise")}
    result = runs["per-question"][0]
    print(f"demo corpus: {args.items} generated items (seed {args.seed}), {len(questions)} questions, "
          f"{result.items} calibration items; target {args.target}, delta {args.delta}; "
          "teacher: the generator's labels")
    print(f"{'guarantee':<13} {'question':<11} {'level':>8} {'threshold':>9} {'kept cal':>9} "
          f"{'kept eval':>9} {'agreement':>9}")
    for name, (calibration, evaluation) in runs.items():
        print("\n".join(rows(name, calibration, evaluation)))


if __name__ == "__main__":
    main()
