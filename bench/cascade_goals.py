"""The router's goals on real data: what the fast tier keeps while the cascade stays >= 98% in
agreement with its teacher (certified at delta 0.05), against the baseline of the issue.

Gold labels are imported as the teacher (Teacher kind "external"), so the teacher agrees with
the truth by construction and agreement is accuracy. Per dataset, N items are sampled (seeded:
the sample of bench/encoder_quality.py, whose embedding cache they hit), written as a corpus and
a labels JSONL, imported into a label store and run through the library as a user would run it:
train_bundle (50/25/25 by id hash; heads on the embedding with hashed word n-grams beside
it), calibrate_bundle (threshold on the raw top probability, certified on every calibration
item; temperature on 30% of them, for reported probabilities only) and evaluate_bundle on the
evaluation part.

On the same evaluation items come three references: the naive rule (keep when the raw top
probability is >= the target), the best single threshold chosen in hindsight on those items,
and the oracle (every right answer plus the wrong ones the target allows). Then variants that
each move one lever: every one is fitted on the train part, tuned (if at all) on the temperature
part, and certified with the library's threshold_for_agreement on calibration items it was not
tuned on, before the evaluation items are looked at, so each keeps the guarantee. Last, the
main rules run again on random re-splits of the same items: one evaluation part of ~1000 items
is one draw, and the realised agreement on it moves by ~0.004.

    .venv/bin/python -m bench.cascade_goals --items 4000
"""

from __future__ import annotations

import json
import math
import tempfile
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
from sklearn.linear_model import LogisticRegression

from bench.common import CACHE_DIR, DELTA, TARGET, TASKS, Task, argument_parser, markdown, sample
from cascade.bundle.manifest import Bundle
from cascade.cost.roofline import measure_cpu_flops
from cascade.encoder.ngrams import NgramFeatures, beside
from cascade.encoder.onnx_encoder import EmbeddingCache, Encoder
from cascade.heads import Matrix, SoftmaxHead
from cascade.questions import Question, parse_request
from cascade.routing.router import Cascade
from cascade.tiers.base import Item
from distill.calibration.evaluate import Evaluation, evaluate_bundle
from distill.calibration.fits import TEMPERATURE_SHARE, in_temperature_part
from distill.calibration.maths import apply_temperature, fit_temperature, threshold_for_agreement
from distill.calibration.options import CalibrationOptions
from distill.calibration.results import CalibrationResult
from distill.calibration.run import calibrate_bundle
from distill.labelling.transfer import import_labels
from distill.options import CorpusInput, RunOptions
from distill.store import LabelStore, Teacher
from distill.training.run import ENCODER_TIER, TEACHER_TIER, train_bundle

GOAL_FACTOR = 1.5
MIN_PLATT_ITEMS = 10
Probs = Callable[[str], np.ndarray]
"""part name -> (n, k) probabilities of a fitted model on that part's items."""


@dataclass(frozen=True)
class Baseline:
    """The issue's baseline: all-MiniLM + LR, one Clopper-Pearson threshold on max prob."""

    kept: float
    oracle: float


BASELINES = {"sms_spam": Baseline(0.99, 1.00), "ag_news": Baseline(0.38, 0.90),
             "zomato": Baseline(0.16, 0.59)}


@dataclass
class LibraryRun:
    """What the library pipeline made and measured for one dataset."""

    qid: str
    bundle: Bundle
    calibration: CalibrationResult
    evaluation: Evaluation
    costs: dict[str, tuple[float, float]]
    """evaluation item id -> predicted seconds of (encoder tier, teacher) for its question."""
    seconds: float


@dataclass
class Parts:
    """The sample as arrays, in the bundle's parts; "calibration" is split again, as calibration
    splits it, into "temperature" (30%) and "threshold" (70%)."""

    ids: dict[str, list[str]]
    texts: dict[str, list[str]]
    emb: dict[str, np.ndarray]
    y: dict[str, np.ndarray]
    n_classes: int


@dataclass
class Outcome:
    """What one rule keeps of the evaluation items; ``lower_bound`` is its certificate on
    calibration items (None for a reference, which certifies nothing)."""

    name: str
    keep: np.ndarray
    correct: np.ndarray
    score: np.ndarray
    lower_bound: float | None

    @property
    def kept(self) -> float:
        return float(self.keep.mean())

    @property
    def agreement(self) -> float:
        return 1.0 - float((self.keep & ~self.correct).mean())

    @property
    def wrong(self) -> str:
        """Kept and wrong items against the most the target allows on these items."""
        allowed = math.floor((1 - TARGET) * len(self.keep) + 1e-9)
        return f"{int((self.keep & ~self.correct).sum())}/{allowed}"

    @property
    def hindsight(self) -> float:
        return hindsight_share(self.score, self.correct)

    @property
    def oracle(self) -> float:
        n = len(self.correct)
        return min(1.0, (int(self.correct.sum()) + math.floor((1 - TARGET) * n + 1e-9)) / n)


def answer_value(question: Question, key: str) -> bool | int | str:
    """The hard label as import_labels types it: noul bool, score level int, choice key."""
    if question.type == "noul":
        return key == "true"
    return int(key) if question.type == "score" else key


def write_inputs(task: Task, rows: list[dict[str, Any]], question: tuple[str, Question],
                 workdir: Path) -> tuple[Path, Path]:
    """The corpus and the gold labels as the JSONL files a user would give the CLI."""
    qid, q = question
    corpus, labels = workdir / "corpus.jsonl", workdir / "labels.jsonl"
    with corpus.open("w", encoding="utf-8") as texts, labels.open("w", encoding="utf-8") as answers:
        for row in rows:
            texts.write(json.dumps({"id": row["id"], "text": row["text"]}) + "\n")
            answer = answer_value(q, task.option_key(row["label"]))
            answers.write(json.dumps({"id": row["id"], "question": qid, "answer": answer}) + "\n")
    return corpus, labels


def run_library(task: Task, rows: list[dict[str, Any]], workdir: Path, encoder: Encoder,
                flops: float) -> LibraryRun:
    """Import, train, calibrate and evaluate through the library's public functions."""
    began = time.perf_counter()
    questions = dict(parse_request({"state": "-", "questions": task.questions}).questions)
    (qid, question), = questions.items()
    corpus, labels_path = write_inputs(task, rows, (qid, question), workdir)
    teacher = Teacher(kind="external", model=f"gold labels of {task.file}")
    with LabelStore(workdir / "labels.sqlite", teacher) as store:
        import_labels(store, labels_path, questions)
        bundle = train_bundle(questions, CorpusInput(corpus), store, workdir / "bundle", encoder=encoder,
                              run=RunOptions(progress=False, cache_dir=CACHE_DIR))
        calibration = calibrate_bundle(bundle, CorpusInput(corpus), store,
                                       CalibrationOptions(target=TARGET, delta=DELTA), encoder=encoder,
                                       run=RunOptions(progress=False, flops_per_second=flops))
        evaluation = evaluate_bundle(bundle.directory, CorpusInput(corpus), store, run=RunOptions(
            progress=False, cache_dir=CACHE_DIR, flops_per_second=flops))
        labels = {qid: store.labels(qid)}
    bundle = Bundle.load(bundle.directory)
    costs = item_costs(bundle, labels, rows, qid, flops)
    return LibraryRun(qid, bundle, calibration, evaluation, costs, time.perf_counter() - began)


def item_costs(bundle: Bundle, labels: Mapping[str, Mapping[str, Mapping[str, float]]],
               rows: list[dict[str, Any]], qid: str, flops: float) -> dict[str, tuple[float, float]]:
    """Per evaluation item, the router's predicted seconds for each tier, to price the variants
    exactly as evaluate_bundle prices the library's cascade."""
    wanted = set(bundle.split_ids()["evaluation"])
    items = [Item(row["id"], row["text"]) for row in rows if row["id"] in wanted]
    with Cascade.load(bundle.directory, labels=labels, cache_dir=CACHE_DIR, flops_per_second=flops,
                      threads=1) as cascade:
        batch = cascade.costs.batch(items)
        return {item.id: (batch.seconds(ENCODER_TIER, n, [qid]), batch.seconds(TEACHER_TIER, n, [qid]))
                for n, item in enumerate(items)}


def load_parts(bundle: Bundle, rows: list[dict[str, Any]], task: Task, cache: EmbeddingCache) -> Parts:
    """Texts, cached embeddings and class indices of every part, in sorted id order."""
    (question,) = bundle.manifest.parsed_questions().values()
    keys = question.option_keys()
    by_id = {row["id"]: row for row in rows}
    split = bundle.split_ids()
    calibration = split["calibration"]
    ids = {"train": split["train"], "calibration": calibration, "evaluation": split["evaluation"],
           "temperature": [i for i in calibration if in_temperature_part(i)],
           "threshold": [i for i in calibration if not in_temperature_part(i)]}
    texts = {part: [by_id[i]["text"].strip() for i in part_ids] for part, part_ids in ids.items()}
    y = {part: np.array([keys.index(task.option_key(by_id[i]["label"])) for i in part_ids])
         for part, part_ids in ids.items()}
    emb = {part: cache.encode(part_texts) for part, part_texts in texts.items()}
    return Parts(ids, texts, emb, y, len(keys))


def hindsight_share(score: np.ndarray, correct: np.ndarray) -> float:
    """The most one threshold on ``score`` keeps of these items with agreement >= TARGET here."""
    n = len(score)
    order = np.argsort(-score, kind="stable")
    ranked, wrong = score[order], np.cumsum(~correct[order])
    ends = np.flatnonzero(np.append(ranked[1:] != ranked[:-1], True))
    fine = ends[wrong[ends] <= (1 - TARGET) * n + 1e-9]
    return float(fine[-1] + 1) / n if fine.size else 0.0


def temperature_on(probs: np.ndarray, y: np.ndarray) -> float:
    """T fitted on the temperature part; 1.0 where the fit runs onto a bound, as calibration does."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        temperature = fit_temperature(probs, y)
    return 1.0 if any("stopped at the bound" in str(w.message) for w in caught) else temperature


def correct_on(probs: Probs, parts: Parts, part: str) -> np.ndarray:
    return np.asarray(probs(part).argmax(axis=1) == parts.y[part])


def certify(name: str, score: Probs, probs: Probs, parts: Parts, on: str) -> Outcome:
    """One threshold on ``score``, certified by LTT on part ``on``, applied to the evaluation part."""
    chosen = threshold_for_agreement(score(on), correct_on(probs, parts, on), TARGET, DELTA)
    evaluated = score("evaluation")
    keep = evaluated >= (chosen.threshold if chosen.threshold is not None else math.inf)
    return Outcome(name, keep, correct_on(probs, parts, "evaluation"), evaluated, chosen.lower_bound)


def one_threshold(name: str, probs: Probs, parts: Parts, temperature: bool = True) -> Outcome:
    """Without temperature, the library's rule: the raw top probability, certified on the whole
    calibration part (the score is fixed in advance, so every item certifies). With it, the
    previous rule: the top probability after a temperature fitted on the temperature part,
    certified on the other 70%."""
    T = temperature_on(probs("temperature"), parts.y["temperature"]) if temperature else 1.0
    return certify(name, lambda part: apply_temperature(probs(part), T).max(axis=1), probs, parts,
                   "threshold" if temperature else "calibration")


def per_class_path(name: str, probs: Probs, parts: Parts) -> Outcome:
    """Per-class thresholds along ONE fixed sequence: a Platt map of the top probability fitted
    per predicted class on the temperature part, then a single LTT threshold on the mapped score.
    Each level of the score is one threshold per class, and the sequence is fixed before the
    threshold part is seen, so the fixed-sequence guarantee holds with no delta spent."""
    mapped = platt_per_class(probs("temperature"), parts.y["temperature"])
    return certify(name, lambda part: mapped(probs(part)), probs, parts, "threshold")


def platt_per_class(probs: np.ndarray, y: np.ndarray) -> Callable[[np.ndarray], np.ndarray]:
    """P(right | logit of top probability) per predicted class; the pooled fit where a class has
    too few items or only one outcome."""
    pooled = _platt(probs, y)
    fits = {}
    for k in range(probs.shape[1]):
        mine = probs.argmax(axis=1) == k
        outcomes = set((probs[mine].argmax(axis=1) == y[mine]).tolist())
        enough = mine.sum() >= MIN_PLATT_ITEMS and len(outcomes) == 2
        fits[k] = _platt(probs[mine], y[mine]) if enough else pooled

    def mapped(rows: np.ndarray) -> np.ndarray:
        predicted = rows.argmax(axis=1)
        out = np.empty(len(rows))
        for k, fit in fits.items():
            out[predicted == k] = fit(rows[predicted == k])
        return out

    return mapped


def _platt(probs: np.ndarray, y: np.ndarray) -> Callable[[np.ndarray], np.ndarray]:
    model = LogisticRegression(C=1.0).fit(_top_logit(probs), probs.argmax(axis=1) == y)
    return lambda rows: model.predict_proba(_top_logit(rows))[:, 1] if len(rows) else np.empty(0)


def _top_logit(probs: np.ndarray) -> np.ndarray:
    top = np.clip(probs.max(axis=1), 1e-12, 1 - 1e-12)
    return np.log(top / (1 - top))[:, None]


def fit_head(features: Mapping[str, Matrix], parts: Parts, C: float) -> Probs:
    """A head fitted on the train part's ``features``, read on any part's."""
    one_hot = np.eye(parts.n_classes)[parts.y["train"]]
    head = SoftmaxHead(C=C, max_iter=5000).fit(features["train"], one_hot)
    return lambda part: head.predict_proba(features[part])


def head_probs(C: float, parts: Parts) -> Probs:
    """A head on the embedding alone (the library before n-grams)."""
    return fit_head(parts.emb, parts, C)


def hashed_probs(C: float, parts: Parts) -> Probs:
    """The library's head: the embedding with hashed word n-grams beside it, idf from the train part."""
    grams = NgramFeatures().fit(parts.texts["train"])
    return fit_head({part: beside(parts.emb[part], grams, texts) for part, texts in parts.texts.items()},
                    parts, C)


def library_probs(run: LibraryRun, parts: Parts) -> Probs:
    """The bundle's own head and n-grams, as the router runs them."""
    head, grams = run.bundle.heads[run.qid], run.bundle.ngrams
    return lambda part: head.predict_proba(beside(parts.emb[part], grams, parts.texts[part]))


def variants(run: LibraryRun, parts: Parts) -> list[Outcome]:
    """The library rule replayed, then one lever moved at a time."""
    library, plain = library_probs(run, parts), head_probs(1.0, parts)
    return [
        one_threshold("library: embedding + n-grams, raw top prob, all calibration items certify "
                      "(replayed)", library, parts, temperature=False),
        one_threshold("embedding alone (no n-grams), same rule", plain, parts, temperature=False),
        one_threshold("library heads, T on 30%, threshold on the other 70% (the previous rule)",
                      library, parts),
        per_class_path("library heads, per-class thresholds, one fixed sequence", library, parts),
    ]


def resplit(parts: Parts, rng: np.random.Generator) -> Parts:
    """The same items split again at random, 50/25/25 and the calibration part 30/70, for how
    much the realised agreement on ~1000 evaluation items moves from one split to the next."""
    every = ("train", "calibration", "evaluation")
    ids = [i for part in every for i in parts.ids[part]]
    texts = [t for part in every for t in parts.texts[part]]
    emb, y = (np.concatenate([arrays[part] for part in every]) for arrays in (parts.emb, parts.y))
    order, n = rng.permutation(len(ids)), len(ids)
    train, calibration = n // 2, 3 * n // 4
    temperature = train + round(TEMPERATURE_SHARE * (calibration - train))
    cuts = {"train": order[:train], "calibration": order[train:calibration],
            "temperature": order[train:temperature], "threshold": order[temperature:calibration],
            "evaluation": order[calibration:]}
    return Parts({part: [ids[i] for i in rows] for part, rows in cuts.items()},
                 {part: [texts[i] for i in rows] for part, rows in cuts.items()},
                 {part: emb[rows] for part, rows in cuts.items()},
                 {part: y[rows] for part, rows in cuts.items()}, parts.n_classes)


def resplit_rows(task: Task, parts: Parts, count: int, seed: int) -> list[list[str]]:
    """The library rule with and without n-grams, with and without temperature, on ``count``
    random re-splits of the same items."""
    rng = np.random.default_rng(seed)
    runs: dict[str, list[Outcome]] = {}
    for _ in range(count):
        again = resplit(parts, rng)
        plain, hashed = head_probs(1.0, again), hashed_probs(1.0, again)
        for outcome in (one_threshold("library rule (n-grams, raw, all calibration)", hashed, again, False),
                        one_threshold("n-grams, T on 30%, threshold on 70%", hashed, again),
                        one_threshold("embedding alone, raw, all calibration", plain, again, False),
                        one_threshold("embedding alone, T on 30%, threshold on 70%", plain, again)):
            runs.setdefault(outcome.name, []).append(outcome)
    rows = []
    for name, outcomes in runs.items():
        kept = np.array([o.kept for o in outcomes])
        agreement = np.array([o.agreement for o in outcomes])
        rows.append([task.name, name, str(count), f"{kept.mean():.1%} ({kept.min():.1%}-{kept.max():.1%})",
                     f"{np.median(agreement):.4f} ({agreement.min():.4f}-{agreement.max():.4f})",
                     f"{int((agreement < TARGET).sum())}/{count}",
                     f"{np.mean([o.hindsight for o in outcomes]):.1%}"])
    return rows


def naive(run: LibraryRun, parts: Parts) -> Outcome:
    """Keep when the raw top probability is >= the target: no temperature, no certificate."""
    probs = library_probs(run, parts)("evaluation")
    score = probs.max(axis=1)
    return Outcome("naive", score >= TARGET, probs.argmax(axis=1) == parts.y["evaluation"], score, None)


def cost_ratio(outcome: Outcome, run: LibraryRun, parts: Parts) -> float:
    """Predicted cost of the cascade over the teacher alone: the encoder reads every item, the
    teacher answers what the fast tier does not keep (the router's own cost model)."""
    enc, teacher = (np.array([run.costs[i][t] for i in parts.ids["evaluation"]]) for t in (0, 1))
    return float((enc.sum() + teacher[~outcome.keep].sum()) / teacher.sum())


def summary_row(task: Task, run: LibraryRun, parts: Parts, replay: Outcome) -> list[str]:
    ev, baseline = run.evaluation, BASELINES[task.name]
    kept = next(t.share for t in ev.tiers if t.name == ENCODER_TIER)
    escalated = next(t.share for t in ev.tiers if t.name == TEACHER_TIER)
    plain = naive(run, parts)
    goal = "n/a (at ceiling)" if task.name == "sms_spam" else (
        "yes" if kept >= GOAL_FACTOR * baseline.kept and ev.agreement >= TARGET else "no")
    return [task.name, str(ev.answers), f"{ev.agreement:.4f}", f"{kept:.1%}", f"{escalated:.1%}",
            f"{ev.cost_ratio:.4f}", f"{plain.kept:.1%} / {plain.agreement:.4f}",
            f"{replay.hindsight:.1%}", f"{replay.oracle:.1%}",
            f"{baseline.kept:.0%} / {baseline.oracle:.0%}", f"{kept / baseline.kept:.2f}x", goal]


def variant_rows(task: Task, outcomes: list[Outcome], run: LibraryRun, parts: Parts) -> list[list[str]]:
    baseline = BASELINES[task.name].kept
    return [[task.name, o.name, f"{o.kept:.1%}", f"{o.kept / baseline:.2f}x", f"{o.agreement:.4f}", o.wrong,
             "-" if o.lower_bound is None else f"{o.lower_bound:.4f}",
             "yes" if o.agreement >= TARGET else "NO", f"{o.hindsight:.1%}", f"{o.oracle:.1%}",
             f"{cost_ratio(o, run, parts):.4f}"] for o in outcomes]


def check_replay(task: Task, run: LibraryRun, replay: Outcome) -> str:
    """The replayed library rule must reproduce evaluate_bundle, or the variants compare nothing."""
    ev = run.evaluation.questions[run.qid]
    kept = next(t.share for t in ev.tiers if t.name == ENCODER_TIER)
    same = abs(kept - replay.kept) < 1e-9 and abs(ev.agreement - replay.agreement) < 1e-9
    return (f"{task.name}: replay {'matches' if same else 'DIFFERS FROM'} evaluate_bundle "
            f"(kept {replay.kept:.4f} vs {kept:.4f}, agreement {replay.agreement:.4f} vs {ev.agreement:.4f})")


def calibration_line(task: Task, run: LibraryRun, parts: Parts, replay: Outcome, seconds: float) -> str:
    """What calibration decided and saw on its calibration items, and the head's plain accuracy."""
    (fit,) = run.calibration.calibrations
    return (f"{task.name}: T={fit.temperature:.3f}, threshold {fit.threshold}; on its "
            f"{fit.n_threshold} calibration items it keeps {fit.kept_share:.1%} at agreement "
            f"{fit.agreement:.4f} (lower bound {fit.lower_bound:.4f}); head accuracy on the "
            f"evaluation items {replay.correct.mean():.4f}; encoder on every item costs "
            f"{cost_ratio(replace(replay, keep=np.ones_like(replay.keep)), run, parts):.4f} of the "
            f"teacher alone; library pipeline {run.seconds:.0f} s, "
            f"variants and re-splits {seconds:.0f} s")


RESPLITS = ["dataset", "rule", "splits", "keeps: mean (min-max)", "agreement: median (min-max)",
             "splits below 0.98", "hindsight (mean)"]
SUMMARY = ["dataset", "n eval", "agreement", "fast tier keeps", "escalated", "cost ratio",
           "naive >=0.98: keeps / agreement", "hindsight", "oracle", "baseline keeps / oracle",
           "x baseline", "goal (>=1.5x, >=0.98)"]
VARIANTS = ["dataset", "variant", "keeps", "x baseline", "agreement", "wrong kept / allowed",
            "lower bound (cal)",
            "held >=0.98", "hindsight", "oracle", "cost ratio"]


def main() -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("--items", type=int, default=4000, help="items sampled per dataset")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--resplits", type=int, default=10, help="random re-splits per dataset")
    args = parser.parse_args()
    print("gold labels imported as the teacher: the teacher agrees with the truth by construction")
    encoder = Encoder()
    cache = EmbeddingCache(CACHE_DIR, encoder)
    flops = measure_cpu_flops()
    print(f"encoder {encoder.name}; cache {cache.path}; CPU {flops / 1e9:.1f} GFLOP/s (numpy float32); "
          f"target {TARGET}, delta {DELTA}; {args.items} items per dataset, seed {args.seed}")
    summary, table, again, notes = [], [], [], []
    for task in TASKS:
        rows = sample(task, args.items, args.seed)
        with tempfile.TemporaryDirectory(prefix=f"cascade-goals-{task.name}-") as workdir:
            run = run_library(task, rows, Path(workdir), encoder, flops)
            began = time.perf_counter()
            parts = load_parts(run.bundle, rows, task, cache)
            outcomes = variants(run, parts)
            again += resplit_rows(task, parts, args.resplits, args.seed)
        summary.append(summary_row(task, run, parts, outcomes[0]))
        table += variant_rows(task, outcomes, run, parts)
        notes += [check_replay(task, run, outcomes[0]),
                  calibration_line(task, run, parts, outcomes[0], time.perf_counter() - began)]
    print(f"\n{markdown(SUMMARY, summary)}\n\n{markdown(VARIANTS, table)}\n\n{markdown(RESPLITS, again)}\n")
    print("\n".join(notes))
    print(f"{cache.misses} texts embedded this run (the rest from the cache; calibrate_bundle "
          "always runs the encoder on the calibration items, to time it)")


if __name__ == "__main__":
    main()
