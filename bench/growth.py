"""Growth: the cascade retrained as traffic flows, on AG News replayed in a fixed order.

The traffic is the committed 1.5B label exports read one after another (``--labels``; all 7,600
AG News items, the teacher's answers known for each), in that fixed order. After each of
``--points`` items seen, the store holds the teacher's labels of every item seen (collected
traffic, as `cascade retrain` reads it), and the fast tier is retrained and certified on them:

- each item's part is fixed by a hash of its id and the re-split's salt (50/25/25, as
  ``distill.training.split`` places items): it never moves as traffic grows, as in the library;
- the library's head (MiniLM vectors, hashed word n-grams beside them) is fitted on the train
  part of the items seen, and one threshold on the margin is certified on their calibration part
  at each ``--targets`` / delta 0.05 (``maths.threshold_for_agreement``, as ``cascade calibrate``);
- it is measured on every item not used to train or calibrate it: the evaluation part of the
  items seen and every item not seen yet (future traffic): the share kept, the realised agreement
  with the teacher, and the cost against the teacher alone.

Encoders: the shipped frozen MiniLM on every re-split, and with ``--finetune`` MiniLM fine-tuned on
the train part (``cascade train --finetune``'s defaults) for the first ``--finetune-resplits``
re-splits at the ``--finetune-points`` (a fine-tune takes minutes per 1,000 train items on 2
cores; each is cached under ~/.cache/cascade-bench, so an interrupted run resumes).

Costs are measured, not priced: CPU seconds per item of the teacher and each encoder on
``--cost-items`` items, one thread each, interleaved item by item (``bench.goals``). A cascade's
cost per item is encoder + share escalated x teacher, over the teacher alone.

    PYTHONPATH=. .venv/bin/python -m bench.growth \\
        --labels bench/labels/ag_news.qwen2.5-coder-1.5b.jsonl \\
                 bench/labels/ag_news.qwen2.5-coder-1.5b.items-4001-7600.jsonl \\
        --resplits 10 --targets 0.98 0.995 --finetune --finetune-points 7600 --finetune-resplits 1
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench.common import (
    CACHE_DIR,
    DELTA,
    FINETUNED_DIR,
    TEACHER,
    Items,
    Parts,
    argument_parser,
    cell,
    certified,
    finetuned,
    head_probabilities,
    labels_digest,
    load_items,
    markdown,
    measured_seconds,
    placed,
    task_named,
)
from cascade.encoder.onnx_encoder import EmbeddingCache, Encoder
from cascade.thresholds import CERTIFIED_SCORE, threshold_score
from distill.training.finetune import FinetuneConfig

POINTS = (500, 1000, 2000, 4000, 7600)
SOURCE = "teacher, soft"
ENCODERS = {"frozen": "encoder (frozen, shipped)", "fine-tuned": "encoder (fine-tuned int8)"}
"""Encoder name -> its key among the measured seconds (bench.goals)."""


@dataclass(frozen=True)
class Point:
    """One retrain on one re-split, measured on its held-out items at one target."""

    certified: bool
    kept: float
    agreement: float


def parts_seen(part: np.ndarray, seen: int) -> Parts:
    """The train and calibration parts of the first ``seen`` items; held out: everything else
    (the evaluation part of the items seen, and every item not seen yet)."""
    index = np.arange(len(part))
    first = index < seen
    return Parts(index[first & (part == 0)], index[first & (part == 1)],
                 index[~first | (part == 2)])


def measure(items: Items, emb: np.ndarray, parts: Parts, targets: list[float]) -> dict[float, Point]:
    """The head fitted on the train part, certified on the calibration part, kept and agreement on
    the held-out items, at each target."""
    truth = items.truth[SOURCE]
    cal, held = head_probabilities(items, emb, SOURCE, parts)
    wrong = held.argmax(axis=1) != truth[parts.evaluation]
    score = threshold_score(held, CERTIFIED_SCORE)
    out = {}
    for target in targets:
        threshold = certified(cal, truth[parts.calibration], target, DELTA, CERTIFIED_SCORE)
        keep = score >= threshold
        out[target] = Point(bool(np.isfinite(threshold)), float(keep.mean()),
                            1 - float((keep & wrong).sum()) / len(keep))
    return out


def main() -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("--labels", type=Path, nargs="+", required=True, metavar="TEACHER.jsonl")
    parser.add_argument("--points", type=int, nargs="+", default=list(POINTS))
    parser.add_argument("--resplits", type=int, default=10)
    parser.add_argument("--targets", type=float, nargs="+", default=[0.98, 0.995])
    parser.add_argument("--finetune", action="store_true", help="also fine-tune MiniLM (the finetune extra)")
    parser.add_argument("--finetune-points", type=int, nargs="+", default=list(POINTS))
    parser.add_argument("--finetune-resplits", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2, help="torch threads while fine-tuning (default 2)")
    parser.add_argument("--cost-items", type=int, default=10,
                        help="items the costs are measured on (0: the last published seconds)")
    args = parser.parse_args()
    task = task_named("ag_news")
    items = load_items(args.labels, task, EmbeddingCache(CACHE_DIR, Encoder()))
    if max(args.points) > len(items.ids):
        raise SystemExit(f"--points goes to {max(args.points)} but the exports hold {len(items.ids)} items")
    config, digest = FinetuneConfig(threads=args.threads), labels_digest(args.labels)
    print(f"{len(items.ids)} AG News items labelled by {TEACHER}, replayed in export order; points "
          f"{args.points}; targets {args.targets}, delta {DELTA}; {args.resplits} re-splits", flush=True)
    runs: dict[tuple[str, int, float], list[Point]] = {}
    for number in range(args.resplits):
        part = placed(items.ids, f"growth-{number}")
        for seen in args.points:
            parts = parts_seen(part, seen)
            encoders = {"frozen": items.emb}
            if args.finetune and number < args.finetune_resplits and seen in args.finetune_points:
                encoders["fine-tuned"] = finetuned(items, digest, SOURCE, 0, 1_000_000 * number + seen,
                                                   parts, config)
            for name, emb in encoders.items():
                for target, point in measure(items, emb, parts, args.targets).items():
                    runs.setdefault((name, seen, target), []).append(point)
            print(f"re-split {number + 1}/{args.resplits}: {seen} items seen", flush=True)
    seconds = _seconds(items, args.cost_items, args.finetune)
    _report(runs, seconds, args.targets)


def _seconds(items: Items, count: int, tuned: bool) -> dict[str, float]:
    """Measured CPU seconds per item (bench.goals), or the last published ones when count is 0."""
    if count == 0:
        return {"teacher": 2.004, "encoder (frozen, shipped)": 0.019, "encoder (fine-tuned int8)": 0.0095}
    seconds = measured_seconds(items, task_named("ag_news"), count, False,
                               FINETUNED_DIR / "last.onnx" if tuned else None)
    print("measured on", count, "items, CPU seconds per item, one thread each: "
          + ", ".join(f"{name} {value:.4f}" for name, value in seconds.items()))
    return seconds


def _report(runs: dict[tuple[str, int, float], list[Point]], seconds: dict[str, float],
            targets: list[float]) -> None:
    teacher = seconds["teacher"]
    for target in targets:
        rows = []
        for (name, seen, at), points in sorted(runs.items(), key=lambda kv: (kv[0][0] != "frozen", kv[0][1])):
            if at != target:
                continue
            encoder = seconds[ENCODERS[name]]
            costs = [encoder / teacher + 1 - p.kept for p in points]
            agreement = [p.agreement for p in points]
            certified_on = f"{sum(p.certified for p in points)}/{len(points)}"
            below = f"{sum(a < target for a in agreement)}/{len(points)}"
            kept = cell([p.kept for p in points], ".1%")
            rows.append([f"{seen:,}", name, str(len(points)), certified_on, kept, cell(agreement, ".4f"),
                         below, cell(costs, ".3f", max(costs))])
        print(f"\ntarget {target}, delta {DELTA}:")
        print(markdown(["items seen", "encoder", "re-splits", "certified something", "kept: mean (worst)",
                        "realised agreement: mean (worst)", "below target", "cost / teacher: mean (worst)"],
                       rows))


if __name__ == "__main__":
    main()
