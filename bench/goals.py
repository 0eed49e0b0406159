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

import argparse
import hashlib
import itertools
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import get_args

import numpy as np

from bench.encoder_quality import CACHE_DIR, TASKS, Task
from bench.finetune import finetuned_vectors
from bench.teacher_goals import GOAL_COST, GOAL_KEPT, Items, hindsight, load_items, markdown, read_export
from cascade.encoder.ngrams import NgramFeatures, beside
from cascade.encoder.onnx_encoder import EmbeddingCache, Encoder, EncoderFiles, default_encoder_files
from cascade.heads import SoftmaxHead
from cascade.questions import parse_request
from cascade.readout.scorer import Scorer
from cascade.thresholds import CERTIFIED_SCORE, ThresholdScore, threshold_score
from distill.calibration.maths import threshold_for_agreement
from distill.finetune import FinetuneConfig
from distill.teachers import teacher_path

TARGET, DELTA = 0.98, 0.05
TEACHER, MIDDLE = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"
SOURCES = {"teacher": "teacher, soft", "gold": "gold"}
FINETUNED_DIR = CACHE_DIR / "finetuned"


@dataclass(frozen=True)
class Parts:
    train: np.ndarray
    calibration: np.ndarray
    evaluation: np.ndarray


@dataclass(frozen=True)
class Outcome:
    """One cascade on one split's evaluation part."""

    encoder: float  # share the encoder keeps
    middle: float  # share the middle tier keeps (0 without one)
    agreement: float  # realised agreement with the source
    reach_middle: float  # share the middle tier reads
    hindsight: float  # the most one encoder threshold keeps at the target, chosen on these items

    @property
    def cheap(self) -> float:
        return self.encoder + self.middle


def parts_of(order: np.ndarray) -> Parts:
    n = len(order)
    return Parts(order[: n // 2], order[n // 2: 3 * n // 4], order[3 * n // 4:])


def head_probabilities(items: Items, emb: np.ndarray, source: str, parts: Parts
                       ) -> tuple[np.ndarray, np.ndarray]:
    """The library's head on ``emb`` (+ n-grams), fitted on the train part: calibration and
    evaluation probabilities."""
    grams = NgramFeatures().fit([items.texts[i] for i in parts.train])

    def features(rows: np.ndarray) -> np.ndarray:
        return beside(emb[rows], grams, [items.texts[i] for i in rows])

    head = SoftmaxHead(C=1.0, max_iter=5000).fit(features(parts.train), items.targets[source][parts.train])
    return head.predict_proba(features(parts.calibration)), head.predict_proba(features(parts.evaluation))


def certified(cal: np.ndarray, truth: np.ndarray, target: float, delta: float, score: ThresholdScore
              ) -> float:
    """The lowest raw-``score`` threshold certified on the calibration items (inf: none)."""
    chosen = threshold_for_agreement(threshold_score(cal, score), cal.argmax(axis=1) == truth, target, delta)
    return chosen.threshold if chosen.threshold is not None else np.inf


def cascade_outcome(encoder: tuple[np.ndarray, np.ndarray], middle: tuple[np.ndarray, np.ndarray] | None,
                    truth: np.ndarray, parts: Parts, score: ThresholdScore, target: float = TARGET
                    ) -> Outcome:
    """Thresholds certified as ``cascade calibrate`` sets them, then the cascade on the evaluation
    part: each cheap tier keeps what clears its threshold among what reaches it."""
    tiers = [encoder] if middle is None else [encoder, middle]
    tier_target, tier_delta = 1 - (1 - target) / len(tiers), DELTA / len(tiers)
    cal_truth, ev_truth = truth[parts.calibration], truth[parts.evaluation]
    reaching = np.ones(len(parts.evaluation), dtype=bool)
    kept, wrong = [], 0
    for cal, ev in tiers:
        threshold = certified(cal, cal_truth, tier_target, tier_delta, score)
        keep = reaching & (threshold_score(ev, score) >= threshold)
        kept.append(float(keep.mean()))
        wrong += int((keep & (ev.argmax(axis=1) != ev_truth)).sum())
        reaching &= ~keep
    reach_middle = 1 - kept[0] if middle is not None else 0.0
    best = hindsight(threshold_score(encoder[1], score), encoder[1].argmax(axis=1) == ev_truth, target)
    return Outcome(kept[0], kept[1] if middle is not None else 0.0, 1 - wrong / len(ev_truth), reach_middle,
                   best)


def labels_digest(paths: list[Path]) -> str:
    """The label exports' digest (one file: its sha256, as the cache of fine-tuned vectors keys it)."""
    digest = hashlib.sha256()
    for path in paths:
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def finetuned(items: Items, digest: str, source: str, seed: int, number: int, parts: Parts,
              config: FinetuneConfig) -> np.ndarray:
    """All items' vectors from MiniLM fine-tuned on this split's train part (bench.finetune's
    ``finetuned_vectors``), cached per split by the labels file's ``digest`` and the settings."""
    key = hashlib.sha256(f"{digest} {source} {seed} {number} {config!r}".encode()).hexdigest()[:20]
    cached = FINETUNED_DIR / f"{key}.npy"
    if cached.exists():
        return np.load(cached)
    FINETUNED_DIR.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as work:
        emb, _, onnx = finetuned_vectors(items, source, parts.train, Path(work), config)
        shutil.copyfile(onnx, FINETUNED_DIR / "last.onnx")
    np.save(cached.with_suffix(".tmp.npy"), emb)
    cached.with_suffix(".tmp.npy").replace(cached)
    return emb


def measured_seconds(items: Items, task: Task, count: int, middle: bool, finetuned_file: Path | None
                     ) -> dict[str, float]:
    """CPU seconds per item of each part, one thread each, interleaved item by item."""
    request = {"state": "-", "questions": task.questions}
    tokenizer = default_encoder_files().tokenizer
    encoders = {"encoder (frozen, shipped)": Encoder(threads=1)}
    if finetuned_file is not None:
        files = EncoderFiles(model=finetuned_file, tokenizer=tokenizer)
        encoders["encoder (fine-tuned int8)"] = Encoder(files, threads=1)
    models = {"teacher": TEACHER, **({"middle": MIDDLE} if middle else {})}
    scorers = {name: Scorer(teacher_path(model), n_ctx=2048, max_branches=1, n_threads=1)
               for name, model in models.items()}
    spent: dict[str, list[float]] = {name: [] for name in [*scorers, *encoders]}
    try:
        for text in items.texts[:count]:
            for name, scorer in scorers.items():
                started = time.process_time()
                scorer.score(parse_request(request | {"state": text}))
                spent[name].append(time.process_time() - started)
            for name, encoder in encoders.items():
                started = time.process_time()
                encoder.encode([text])
                spent[name].append(time.process_time() - started)
    finally:
        for scorer in scorers.values():
            scorer.close()
    return {name: statistics.mean(values) for name, values in spent.items()}


def summary(name: str, runs: list[Outcome], costs: list[float], middle: bool, target: float) -> list[str]:
    def cell(values: list[float], fmt: str, worst: float) -> str:
        return f"{statistics.mean(values):{fmt}} (worst {worst:{fmt}})"

    cheap = [r.cheap for r in runs]
    agreement = [r.agreement for r in runs]
    return [name, f"{statistics.mean(r.encoder for r in runs):.1%}",
            f"{statistics.mean(r.middle for r in runs):.1%}" if middle else "-",
            cell(cheap, ".1%", min(cheap)), cell(agreement, ".4f", min(agreement)),
            f"{sum(a < target for a in agreement)}/{len(runs)}", cell(costs, ".3f", max(costs)),
            f"{statistics.mean(r.hindsight for r in runs):.1%}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", choices=[task.name for task in TASKS], required=True)
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
    task = next(task for task in TASKS if task.name == args.task)
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
    runs: dict[tuple[float, str, str, bool, str], list[Outcome]] = {}
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


def _report(runs: dict[tuple[float, str, str, bool, str], list[Outcome]], seconds: dict[str, float],
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
