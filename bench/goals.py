"""The real-teacher goals in one command: the cascade against Qwen2.5-Coder-1.5B, from committed labels.

Reads label exports of bench/labels/ (ids and full probability vectors; texts and gold labels
are joined back from ../shared/data by id): the teacher's (the 1.5B) and, with ``--middle``, a
cheaper GGUF's (the 0.5B) on the same items, read by the same prompt. Each of ``--resplits``
random 50/25/25 splits (the permutations of bench/teacher_goals.py for the same seed) fits the
library's head (MiniLM vectors with hashed word n-grams beside them) on the train part and
certifies thresholds on the calibration part as ``cascade calibrate`` does, on the raw score the
library certifies (``--scores``: the margin of the top probability over the runner-up; ``top``,
the top probability itself, is what bundles of schema 1 used): with m cheap tiers each is
certified on all calibration items to disagree on at most (1 - target) / m of them at level
delta / m. Everything is measured on the evaluation part.

Cascades, for each label source (the teacher's probabilities, and gold labels standing in for
the teacher on the same items, so the difference a real teacher makes is visible):

- encoder -> teacher;
- encoder -> 0.5B -> teacher (with ``--middle``): the 0.5B answers what the encoder escalates.

Encoders: the shipped frozen MiniLM, and with ``--finetune SOURCE...`` MiniLM fine-tuned on each
split's train part for those label sources (``cascade train --finetune``'s defaults). A
fine-tune takes minutes of CPU, so each split's vectors are cached under ~/.cache/cascade-bench
by labels file, source, seed, split and settings: an interrupted run resumes where it stopped.

The last column is what a single encoder threshold could keep at the target if it were chosen
on the evaluation items themselves: the ceiling a certificate on 1,000 calibration items works
under.

Costs are measured, never priced by roofline: CPU seconds per item of the teacher, the middle
GGUF and each encoder on ``--cost-items`` of these items, one thread each, interleaved item by
item in this process. The cascade's cost per item is encoder + share reaching the middle x
middle + share escalated x teacher, over the teacher alone.

    PYTHONPATH=. .venv/bin/python -m bench.goals --task ag_news \\
        --labels bench/labels/ag_news.qwen2.5-coder-1.5b.jsonl \\
        --middle bench/labels/ag_news.qwen2.5-coder-0.5b.jsonl --resplits 10 --finetune teacher
"""

from __future__ import annotations

import itertools
import statistics
from pathlib import Path
from typing import get_args

import numpy as np

from bench.common import (
    CACHE_DIR,
    DELTA,
    FINETUNED_DIR,
    GOAL_COST,
    GOAL_KEPT,
    MIDDLE,
    SOURCES,
    TARGET,
    TASK_NAMES,
    TEACHER,
    CascadeOutcome,
    Items,
    Task,
    argument_parser,
    cascade_outcome,
    cell,
    finetuned,
    head_probabilities,
    labels_digest,
    load_items,
    markdown,
    measured_seconds,
    parts_of,
    read_export,
    task_named,
)
from cascade.encoder.onnx_encoder import EmbeddingCache, Encoder
from cascade.thresholds import CERTIFIED_SCORE, ThresholdScore
from distill.training.finetune import FinetuneConfig


def summary(name: str, runs: list[CascadeOutcome], costs: list[float], middle: bool, target: float
            ) -> list[str]:
    cheap = [r.cheap for r in runs]
    agreement = [r.agreement for r in runs]
    return [name, f"{statistics.mean(r.encoder for r in runs):.1%}",
            f"{statistics.mean(r.middle for r in runs):.1%}" if middle else "-",
            cell(cheap, ".1%"), cell(agreement, ".4f"),
            f"{sum(a < target for a in agreement)}/{len(runs)}", cell(costs, ".3f", max(costs)),
            f"{statistics.mean(r.hindsight for r in runs):.1%}"]


def main() -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("--task", choices=TASK_NAMES, required=True)
    parser.add_argument("--labels", type=Path, nargs="+", required=True, metavar="TEACHER.jsonl",
                        help="the teacher's label exports (several: read one after another)")
    parser.add_argument("--middle", type=Path, metavar="MIDDLE.jsonl",
                        help="the 0.5B's export on the same items: adds encoder -> 0.5B -> teacher")
    parser.add_argument("--resplits", type=int, default=10)
    parser.add_argument("--finetune", nargs="*", choices=sorted(SOURCES), default=[],
                        help="label sources to fine-tune MiniLM on per split (cached; minutes each)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads while fine-tuning (default 1)")
    parser.add_argument("--cost-items", type=int, default=20)
    parser.add_argument("--scores", nargs="+", choices=get_args(ThresholdScore), default=[CERTIFIED_SCORE],
                        help="raw scores to certify thresholds on, side by side (default: the "
                             f"library's, {CERTIFIED_SCORE})")
    parser.add_argument("--targets", type=float, nargs="+", default=[TARGET],
                        help=f"agreement targets to certify, each in a table of its own (default {TARGET})")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    task = task_named(args.task)
    items = load_items(args.labels, task, EmbeddingCache(CACHE_DIR, Encoder()))
    middle = _middle_probabilities(args.middle, task, items) if args.middle else None
    config = FinetuneConfig(seed=args.seed, threads=args.threads)
    digest = labels_digest(args.labels)
    gold = float((items.truth["teacher, soft"] == items.truth["gold"]).mean())
    print(f"{len(items.ids)} {task.name} items labelled by {TEACHER}, which agrees with gold on {gold:.1%}; "
          f"targets {args.targets}, delta {DELTA}; {args.resplits} random 50/25/25 re-splits "
          f"(seed {args.seed})",
          flush=True)
    if middle is not None:
        agree = float((middle.argmax(axis=1) == items.truth["teacher, soft"]).mean())
        print(f"middle tier {MIDDLE}: its top answer is the teacher's on {agree:.1%} of the items")
    rng = np.random.default_rng(args.seed)
    runs: dict[tuple[float, str, str, bool, str], list[CascadeOutcome]] = {}
    for number, order in enumerate((rng.permutation(len(items.ids)) for _ in range(args.resplits)), 1):
        parts = parts_of(order)
        for name, source in SOURCES.items():
            encoders = {"frozen": items.emb}
            if name in args.finetune:
                encoders["fine-tuned"] = finetuned(items, digest, source, args.seed, number, parts, config)
            truth = items.truth[source]
            for encoder, emb in encoders.items():
                probs = head_probabilities(items, emb, source, parts)
                for target, score in itertools.product(args.targets, args.scores):
                    outcome = cascade_outcome(probs, None, truth, parts, score, target)
                    runs.setdefault((target, name, encoder, False, score), []).append(outcome)
                    if middle is not None:
                        pair = (middle[parts.calibration], middle[parts.evaluation])
                        outcome = cascade_outcome(probs, pair, truth, parts, score, target)
                        runs.setdefault((target, name, encoder, True, score), []).append(outcome)
        print(f"split {number}/{args.resplits} done", flush=True)
    tuned = FINETUNED_DIR / "last.onnx" if args.finetune else None
    seconds = measured_seconds(items, task, args.cost_items, middle is not None, tuned)
    _report(runs, seconds, args.cost_items, middle is not None, task)


def _middle_probabilities(path: Path, task: Task, items: Items) -> np.ndarray:
    """The middle GGUF's probabilities in the teacher export's item order; every item needed."""
    ids, probs = read_export(path, task)
    row = {item: i for i, item in enumerate(ids)}
    missing = [item for item in items.ids if item not in row]
    if missing:
        raise SystemExit(f"{path} lacks {len(missing)} of the teacher's {len(items.ids)} items "
                         f"(first: {missing[0]}): label them all with the middle model first")
    return probs[[row[item] for item in items.ids]]


def _report(runs: dict[tuple[float, str, str, bool, str], list[CascadeOutcome]], seconds: dict[str, float],
            count: int, middle: bool, task: Task) -> None:
    teacher = seconds["teacher"]
    print(f"\nmeasured on {count} items, CPU seconds per item, one thread each: "
          + ", ".join(f"{name} {value:.4f}" for name, value in seconds.items()))
    scores = {key[-1] for key in runs}
    for target in sorted({key[0] for key in runs}):
        rows = []
        for (at, source, encoder, with_middle, score), outcomes in runs.items():
            if at != target:
                continue
            encoder_seconds = seconds["encoder (fine-tuned int8)" if encoder == "fine-tuned" else
                                      "encoder (frozen, shipped)"]
            costs = [(encoder_seconds + o.reach_middle * seconds.get("middle", 0.0)) / teacher + (1 - o.cheap)
                     for o in outcomes]
            chain = f"{encoder} encoder -> {'0.5B -> ' if with_middle else ''}teacher"
            if len(scores) > 1:
                chain += f", thresholds on the {score}"
            rows.append(summary(f"{source}: {chain}", outcomes, costs, with_middle, target))
        header = ["labels: cascade", "encoder keeps", "0.5B keeps", "cheaper tiers keep: mean (worst)",
                  "realised agreement: mean (worst)", f"splits below {target}",
                  "cost / teacher alone: mean (worst)", "encoder alone, in hindsight"]
        print(f"\ntarget {target}, delta {DELTA}:")
        print(markdown(header, rows))
    print(f"goals ({task.name}, teacher labels, target {TARGET}): cheaper tiers keep >= {GOAL_KEPT:.0%}, "
          f"agreement >= {TARGET} on every split, cost <= {GOAL_COST} of the teacher alone, measured")


if __name__ == "__main__":
    main()
