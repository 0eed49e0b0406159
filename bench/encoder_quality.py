"""How well the tier-0 encoder head agrees with its teacher, next to a TF-IDF reference.

The gold labels stand in for the teacher here, so the agreement measured is accuracy against the
truth, and the teacher itself is right by construction. Per dataset, N items are sampled (seeded)
and split 50% train / 25% calibration / 25% evaluation; every model is trained on the train part
only, regularisation strengths are picked on the calibration part, and all rates are on the
evaluation part. The reference is what a practitioner would try first without an encoder: TF-IDF
word 1-2 grams (sublinear tf) with logistic regression. Embeddings are cached, so reruns only fit.

    .venv/bin/python -m bench.encoder_quality --items 4000
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp
from sklearn.feature_extraction.text import HashingVectorizer, TfidfTransformer, TfidfVectorizer
from sklearn.linear_model import LogisticRegression
from sklearn.pipeline import make_pipeline

from bench.common import CACHE_DIR, TASKS, Task, argument_parser, sample
from cascade.encoder.onnx_encoder import EmbeddingCache, Encoder
from cascade.heads import SoftmaxHead
from cascade.questions import parse_request

C_GRID = (0.1, 1.0, 10.0, 100.0)


@dataclass
class Split:
    """One dataset's sampled items: texts, class indices and embeddings, in three parts."""

    texts: dict[str, list[str]]
    y: dict[str, np.ndarray]
    emb: dict[str, np.ndarray]
    n_classes: int
    kind: str


Fit = Callable[[float, Split], Callable[[str], np.ndarray]]
"""Trains at C on the train part; returns part name -> predicted class indices."""


def load_split(task: Task, items: int, seed: int, cache: EmbeddingCache) -> Split:
    """Sample ``items`` rows, map gold labels to option indices, embed, and split 50/25/25."""
    rows = sample(task, items, seed)
    (question,) = parse_request({"state": "-", "questions": task.questions}).questions.values()
    keys = question.option_keys()
    bounds = {"train": (0, items // 2), "cal": (items // 2, 3 * items // 4), "eval": (3 * items // 4, items)}
    texts = {part: [row["text"] for row in rows[a:b]] for part, (a, b) in bounds.items()}
    y = {part: np.array([keys.index(task.option_key(row["label"])) for row in rows[a:b]])
         for part, (a, b) in bounds.items()}
    emb = {part: cache.encode(texts[part], progress=True) for part in bounds}
    return Split(texts, y, emb, len(keys), question.type)


def tfidf_lr(C: float, split: Split) -> Callable[[str], np.ndarray]:
    model = make_pipeline(
        TfidfVectorizer(ngram_range=(1, 2), sublinear_tf=True),
        LogisticRegression(C=C, max_iter=5000),
    ).fit(split.texts["train"], split.y["train"])
    return lambda part: model.predict(split.texts[part])


def encoder_head(C: float, split: Split) -> Callable[[str], np.ndarray]:
    one_hot = np.eye(split.n_classes)[split.y["train"]]
    head = SoftmaxHead(C=C, max_iter=5000).fit(split.emb["train"], one_hot)
    return lambda part: head.predict(split.emb[part])


def encoder_ngrams(C: float, split: Split) -> Callable[[str], np.ndarray]:
    """The embedding beside tf-idf-scaled hashed word 1-2 grams: both blocks are unit-norm rows."""
    hashing = HashingVectorizer(ngram_range=(1, 2), n_features=2**18, alternate_sign=False, norm=None)
    tfidf = TfidfTransformer(sublinear_tf=True).fit(hashing.transform(split.texts["train"]))

    def features(part: str) -> sp.csr_matrix:
        grams = tfidf.transform(hashing.transform(split.texts[part]))
        return sp.hstack([sp.csr_matrix(split.emb[part]), grams], format="csr")

    model = LogisticRegression(C=C, max_iter=5000).fit(features("train"), split.y["train"])
    return lambda part: model.predict(features(part))


def accuracy(predicted: np.ndarray, truth: np.ndarray) -> float:
    return float(np.mean(predicted == truth))


def pick_c(fit: Fit, split: Split, grid: tuple[float, ...]) -> tuple[float, np.ndarray]:
    """(C with the best calibration accuracy, smallest on ties; its predictions on evaluation)."""
    scored = []
    for C in grid:
        predict = fit(C, split)
        scored.append((accuracy(predict("cal"), split.y["cal"]), C, predict("eval")))
    _, C, predicted = max(scored, key=lambda scores: scores[0])
    return C, predicted


def evaluate(split: Split, grid: tuple[float, ...]) -> dict[str, tuple[float, np.ndarray]]:
    """Model name -> (C used, predicted class indices on the evaluation part)."""
    majority = np.bincount(split.y["train"], minlength=split.n_classes).argmax()
    results = {"majority": (math.nan, np.full_like(split.y["eval"], majority))}
    for name, fit in (("tfidf", tfidf_lr), ("head", encoder_head)):
        results[f"{name} C=1"] = (1.0, fit(1.0, split)("eval"))
        results[f"{name} C*"] = pick_c(fit, split, grid)
    results["enc+ngrams C*"] = pick_c(encoder_ngrams, split, grid)
    return results


def paired_difference(a: np.ndarray, b: np.ndarray, truth: np.ndarray) -> str:
    """Accuracy of ``a`` minus ``b`` on the same items, with a 95% half-width for the pairing."""
    per_item = (a == truth).astype(float) - (b == truth)
    half_width = 1.96 * per_item.std(ddof=1) / math.sqrt(len(per_item))
    return f"{per_item.mean():+.1%} +-{half_width:.1%}"


COLUMNS = ("majority", "tfidf C=1", "tfidf C*", "head C=1", "head C*", "enc+ngrams C*")
TUNED = [column for column in COLUMNS if column.endswith("C*")]
Row = tuple[str, Split, dict[str, tuple[float, np.ndarray]]]


def print_tables(rows: list[Row]) -> None:
    print(f"\n{'dataset':<9} {'n_train':>7} {'n_eval':>6} " + " ".join(f"{c:>13}" for c in COLUMNS))
    for name, split, results in rows:
        cells = " ".join(f"{accuracy(results[c][1], split.y['eval']):>13.1%}" for c in COLUMNS)
        print(f"{name:<9} {len(split.y['train']):>7} {len(split.y['eval']):>6} {cells}")
    print("\nC picked on the calibration part (grid " + ", ".join(f"{c:g}" for c in C_GRID) + "):")
    print(f"{'dataset':<9} " + " ".join(f"{c:>13}" for c in TUNED))
    for name, _, results in rows:
        print(f"{name:<9} " + " ".join(f"{results[c][0]:>13g}" for c in TUNED))
    print("\npaired accuracy difference against tfidf C* on the same evaluation items (95%):")
    print(f"{'dataset':<9} {'head C=1':>15} {'head C*':>15} {'enc+ngrams C*':>15}")
    for name, split, results in rows:
        ref = results["tfidf C*"][1]
        others = ("head C=1", "head C*", "enc+ngrams C*")
        diffs = [paired_difference(results[c][1], ref, split.y["eval"]) for c in others]
        print(f"{name:<9} " + " ".join(f"{diff:>15}" for diff in diffs))
    print_level_errors(rows)


def print_level_errors(rows: list[Row]) -> None:
    """For score questions a near miss is not a wrong topic: mean distance in levels."""
    for name, split, results in rows:
        if split.kind == "score":
            errors = (f"{c} {np.abs(results[c][1] - split.y['eval']).mean():.2f}" for c in COLUMNS)
            print(f"\n{name} mean |predicted level - gold level|: " + ", ".join(errors))


def main() -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("--items", type=int, default=4000, help="items sampled per dataset")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print("gold labels imported as the teacher: the teacher agrees with the truth by construction")
    encoder = Encoder()
    cache = EmbeddingCache(CACHE_DIR, encoder)
    print(f"encoder {encoder.name} (max_length {encoder.max_length}), mean pooled; cache {cache.path}")
    rows = []
    for task in TASKS:
        split = load_split(task, args.items, args.seed, cache)
        rows.append((task.name, split, evaluate(split, C_GRID)))
    print(f"agreement with the teacher (= accuracy vs gold) on the evaluation part; {cache.misses} "
          "texts embedded this run, the rest from the cache")
    print_tables(rows)


if __name__ == "__main__":
    main()
