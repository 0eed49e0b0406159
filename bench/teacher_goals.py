"""The cascade against a real LLM teacher (Qwen2.5-Coder-1.5B-Instruct), from its committed labels.

Reads a label export of bench/labels/ (ids and the teacher's full probabilities; the texts and
gold labels are joined back from ../shared/data by id) and measures, on items used neither to
train nor to calibrate, what the encoder tier keeps while the cascade stays >= 0.98 in agreement
with the teacher, certified at delta 0.05. Each of ``--resplits`` random 50/25/25 splits of the
labelled items fits the library's head (MiniLM embedding with hashed word n-grams beside it) on
the train part, certifies one threshold on the raw top probability with the library's
``threshold_for_agreement`` on the whole calibration part, and applies it to the evaluation part.
Three label sources share every split, so each difference is the labels' alone:

- teacher, soft: heads learn the teacher's probability vectors (what ``cascade train`` does);
- teacher, argmax: heads learn its top answer only;
- gold: the human labels stand in for the teacher (the gold run of bench/cascade_goals.py), so
  agreement is accuracy, on the same items.

Cost is measured, not priced by roofline: the teacher's and the encoder's CPU seconds per item on
``--cost-items`` of these items, side by side in this process, one thread each. The cascade runs
the encoder on every item and the teacher on what it escalates: cost = encoder / teacher + share
escalated (states' lengths vary; the mean per item is used).

    .venv/bin/python -m bench.teacher_goals --labels bench/labels/ag_news.qwen2.5-coder-1.5b.jsonl \\
        --task ag_news --resplits 10
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench.common import (
    CACHE_DIR,
    DELTA,
    GOAL_COST,
    GOAL_KEPT,
    TARGET,
    TASK_NAMES,
    TEACHER,
    Items,
    Task,
    argument_parser,
    cell,
    certified,
    head_probabilities,
    hindsight,
    interleaved,
    load_items,
    markdown,
    parts_of,
    task_named,
)
from cascade.encoder.onnx_encoder import EmbeddingCache, Encoder
from cascade.questions import parse_request
from cascade.readout.scorer import Scorer
from distill.labelling.teachers import teacher_path


@dataclass(frozen=True)
class Split:
    kept: float
    agreement: float
    hindsight: float


def one_split(items: Items, order: np.ndarray) -> dict[str, Split]:
    """Per label source: the library's head, one threshold on the raw top probability certified on
    the calibration part, applied to the evaluation part."""
    parts = parts_of(order)
    out = {}
    for source in items.targets:
        cal, ev = head_probabilities(items, items.emb, source, parts)
        truth = items.truth[source]
        keep = ev.max(axis=1) >= certified(cal, truth[parts.calibration], TARGET, DELTA, "top")
        correct = ev.argmax(axis=1) == truth[parts.evaluation]
        out[source] = Split(float(keep.mean()), 1.0 - float((keep & ~correct).mean()),
                            hindsight(ev.max(axis=1), correct))
    return out


def measured_cost(items: Items, task: Task, count: int) -> float:
    """Encoder CPU seconds per item over the teacher's, on the first ``count`` items."""
    encoder = Encoder(threads=1)
    scorer = Scorer(teacher_path(TEACHER), n_ctx=2048, max_branches=1, n_threads=1)
    questions = parse_request({"state": "-", "questions": task.questions}).questions
    spent = interleaved({
        "teacher": lambda text: scorer.score(parse_request({"state": text, "questions": task.questions})),
        "encoder": lambda text: encoder.encode([text]),
    }, items.texts[:count])
    scorer.close()
    teacher, encoded = spent["teacher"]["cpu"], spent["encoder"]["cpu"]
    print(f"measured on {count} items, one thread each: teacher {statistics.mean(teacher):.3f} s/item, "
          f"encoder {statistics.mean(encoded):.4f} s/item ({len(questions)} question)")
    return statistics.mean(encoded) / statistics.mean(teacher)


def summarise(source: str, runs: list[Split], encoder_share: float) -> list[str]:
    kept = [r.kept for r in runs]
    agreement = [r.agreement for r in runs]
    cost = [encoder_share + 1 - k for k in kept]
    return [source, cell(kept, ".1%"), cell(agreement, ".4f"),
            f"{sum(a < TARGET for a in agreement)}/{len(runs)}", cell(cost, ".3f", max(cost)),
            f"{np.mean([r.hindsight for r in runs]):.1%}"]


def main() -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("--labels", type=Path, required=True, metavar="EXPORT.jsonl")
    parser.add_argument("--task", choices=TASK_NAMES, required=True)
    parser.add_argument("--resplits", type=int, default=10)
    parser.add_argument("--cost-items", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    task = task_named(args.task)
    items = load_items(args.labels, task, EmbeddingCache(CACHE_DIR, Encoder()))
    agree = float((items.truth["teacher, soft"] == items.truth["gold"]).mean())
    print(f"{len(items.ids)} {task.name} items labelled by {TEACHER}; it agrees with gold on {agree:.1%}; "
          f"target {TARGET}, delta {DELTA}, {args.resplits} random 50/25/25 re-splits (seed {args.seed})")
    encoder_share = measured_cost(items, task, args.cost_items)
    rng = np.random.default_rng(args.seed)
    runs: dict[str, list[Split]] = {}
    for _ in range(args.resplits):
        for source, split in one_split(items, rng.permutation(len(items.ids))).items():
            runs.setdefault(source, []).append(split)
    header = ["labels the heads learn and agreement is measured against", "encoder keeps: mean (worst)",
              "realised agreement: mean (worst)", "splits below 0.98", "cost / teacher alone: mean (worst)",
              "hindsight keeps"]
    print(markdown(header, [summarise(source, split, encoder_share) for source, split in runs.items()]))
    print(f"goals (teacher labels): keep >= {GOAL_KEPT:.0%}, agreement >= {TARGET}, cost <= {GOAL_COST}")


if __name__ == "__main__":
    main()
