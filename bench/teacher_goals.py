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

import argparse
import json
import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench.common import read_rows
from bench.encoder_quality import CACHE_DIR, TASKS, Task
from cascade.encoder.ngrams import NgramFeatures, beside
from cascade.encoder.onnx_encoder import EmbeddingCache, Encoder
from cascade.heads import Matrix, SoftmaxHead
from cascade.questions import parse_request
from cascade.readout.scorer import Scorer
from distill.calibration.maths import threshold_for_agreement
from distill.teachers import teacher_path

TARGET, DELTA = 0.98, 0.05
TEACHER = "qwen2.5-coder-1.5b-instruct"
GOAL_KEPT, GOAL_COST = 0.80, 0.25


@dataclass(frozen=True)
class Items:
    """The labelled items in export order, with their features and each source's targets."""

    ids: list[str]
    texts: list[str]
    emb: np.ndarray
    targets: dict[str, np.ndarray]  # source -> (n, k) rows a head learns from
    truth: dict[str, np.ndarray]  # source -> (n,) the answer agreement is measured against


@dataclass(frozen=True)
class Split:
    kept: float
    agreement: float
    hindsight: float


def read_export(paths: Path | Sequence[Path], task: Task) -> tuple[list[str], np.ndarray]:
    """Ids and teacher probabilities (columns in the question's option order) of one export, or
    of several read one after another (a labelling run continued into another file)."""
    (qid, question), = parse_request({"state": "-", "questions": task.questions}).questions.items()
    keys = question.option_keys()
    ids, rows = [], []
    for path in [paths] if isinstance(paths, Path) else paths:
        for line in path.open(encoding="utf-8"):
            row = json.loads(line)
            if row["question"] == qid:
                ids.append(row["id"])
                rows.append([row["probabilities"][key] for key in keys])
    if len(set(ids)) != len(ids):
        raise SystemExit(f"the exports {paths} label some item twice; give each item's label once")
    return ids, np.asarray(rows)


def load_items(path: Path | Sequence[Path], task: Task, cache: EmbeddingCache) -> Items:
    ids, probs = read_export(path, task)
    (question,) = parse_request({"state": "-", "questions": task.questions}).questions.values()
    keys = question.option_keys()
    shared = {row["id"]: row for row in read_rows(task.file)}
    texts = [shared[i]["text"].strip() for i in ids]
    gold = np.array([keys.index(task.option_key(shared[i]["label"])) for i in ids])
    eye = np.eye(len(keys))
    argmax = probs.argmax(axis=1)
    return Items(ids, texts, cache.encode(texts), {"teacher, soft": probs, "teacher, argmax": eye[argmax],
                                                   "gold": eye[gold]},
                 {"teacher, soft": argmax, "teacher, argmax": argmax, "gold": gold})


def hindsight(score: np.ndarray, correct: np.ndarray, target: float = TARGET) -> float:
    """The most one threshold keeps of these items with agreement >= ``target``, chosen on them."""
    order = np.argsort(-score, kind="stable")
    wrong = np.cumsum(~correct[order])
    fine = np.flatnonzero(wrong <= (1 - target) * len(score) + 1e-9)
    return float(fine[-1] + 1) / len(score) if fine.size else 0.0


def one_split(items: Items, order: np.ndarray) -> dict[str, Split]:
    n = len(order)
    train, calibration, evaluation = order[: n // 2], order[n // 2: 3 * n // 4], order[3 * n // 4:]
    grams = NgramFeatures().fit([items.texts[i] for i in train])

    def features(rows: np.ndarray) -> Matrix:
        return beside(items.emb[rows], grams, [items.texts[i] for i in rows])

    X = {"train": features(train), "calibration": features(calibration), "evaluation": features(evaluation)}
    out = {}
    for source, targets in items.targets.items():
        head = SoftmaxHead(C=1.0, max_iter=5000).fit(X["train"], targets[train])
        cal, ev = head.predict_proba(X["calibration"]), head.predict_proba(X["evaluation"])
        truth = items.truth[source]
        chosen = threshold_for_agreement(cal.max(axis=1), cal.argmax(axis=1) == truth[calibration],
                                         TARGET, DELTA)
        keep = ev.max(axis=1) >= (chosen.threshold if chosen.threshold is not None else math.inf)
        correct = ev.argmax(axis=1) == truth[evaluation]
        out[source] = Split(float(keep.mean()), 1.0 - float((keep & ~correct).mean()),
                            hindsight(ev.max(axis=1), correct))
    return out


def measured_cost(items: Items, task: Task, count: int) -> float:
    """Encoder CPU seconds per item over the teacher's, on the first ``count`` items."""
    texts = items.texts[:count]
    encoder = Encoder(threads=1)
    scorer = Scorer(teacher_path(TEACHER), n_ctx=2048, max_branches=1, n_threads=1)
    questions = parse_request({"state": "-", "questions": task.questions}).questions
    teacher, encoded = [], []
    for text in texts:
        started = time.process_time()
        scorer.score(parse_request({"state": text, "questions": task.questions}))
        teacher.append(time.process_time() - started)
        started = time.process_time()
        encoder.encode([text])
        encoded.append(time.process_time() - started)
    scorer.close()
    print(f"measured on {count} items, one thread each: teacher {statistics.mean(teacher):.3f} s/item, "
          f"encoder {statistics.mean(encoded):.4f} s/item ({len(questions)} question)")
    return statistics.mean(encoded) / statistics.mean(teacher)


def summarise(source: str, runs: list[Split], encoder_share: float) -> list[str]:
    kept = np.array([r.kept for r in runs])
    agreement = np.array([r.agreement for r in runs])
    cost = encoder_share + 1 - kept
    return [source, f"{kept.mean():.1%} (worst {kept.min():.1%})",
            f"{agreement.mean():.4f} (worst {agreement.min():.4f})",
            f"{int((agreement < TARGET).sum())}/{len(runs)}",
            f"{cost.mean():.3f} (worst {cost.max():.3f})",
            f"{np.mean([r.hindsight for r in runs]):.1%}"]


def markdown(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return "\n".join([*lines, *("| " + " | ".join(row) + " |" for row in rows)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--labels", type=Path, required=True, metavar="EXPORT.jsonl")
    parser.add_argument("--task", choices=[task.name for task in TASKS], required=True)
    parser.add_argument("--resplits", type=int, default=10)
    parser.add_argument("--cost-items", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    task = next(task for task in TASKS if task.name == args.task)
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
