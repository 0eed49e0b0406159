"""The promotion gate on AG News: real heads, the real teacher's answers, known population gaps.

``bench.promotion_gate`` measures the gate on synthetic curves; this measures it on replays of
real data. A bundle here is the library's head (MiniLM vectors with hashed word n-grams beside
them, as ``cascade train`` fits it) fitted to the committed Qwen2.5-Coder-1.5B answers of a
training set drawn from a pool (the first ``--pool`` items of the exports): more training items
make a better bundle. Its population is every item outside the pool; the share it keeps there at
the target (``common.hindsight``: the most one threshold on the margin keeps with agreement at
least the target, chosen on the whole population) is the truth the gate should find.

Pairs (serving, candidate), by their training sets: the candidate trained on more items (better),
on as many other items (about equal), or on fewer (worse); each pair's population gap is printed.
Each run draws ``--certifying`` + ``--evaluation`` items from the population without replacement,
certifies both bundles on the certifying ones at half the first attempt's delta, and applies
``gate.compare`` to all of them, as ``distill.loop.promote`` does (``--evaluation 0``: the gate as
it was, on the certifying items alone). A promoted certificate fails where the cascade at its
threshold agrees with the teacher on less than the target of the whole population (the items it
keeps disagreeing, those it sends up answered by the teacher).

    PYTHONPATH=. .venv/bin/python -m bench.gate_replay --runs 500
    PYTHONPATH=. .venv/bin/python -m bench.gate_replay --runs 500 --evaluation 0
    PYTHONPATH=. .venv/bin/python -m bench.gate_replay --runs 500 --certifying 300 --evaluation 300
"""

from __future__ import annotations

import numpy as np

from bench.common import (
    CACHE_DIR,
    DELTA,
    FIRST,
    SECOND,
    TARGET,
    Items,
    Parts,
    argument_parser,
    head_probabilities,
    hindsight,
    load_items,
    markdown,
    task_named,
)
from cascade.encoder.onnx_encoder import EmbeddingCache, Encoder
from cascade.thresholds import CERTIFIED_SCORE, threshold_score
from distill.calibration.maths import threshold_for_agreement
from distill.loop.gate import Question, certificate_delta, compare

SOURCE = "teacher, soft"
PAIRS = {"better (500 -> 1,000 items)": ((0, 500), (0, 1000)),
         "better (700 -> 2,000 items)": ((0, 700), (0, 2000)),
         "about equal (1,000 other items)": ((0, 1000), (1000, 2000)),
         "worse (1,000 -> 500 items)": ((0, 1000), (0, 500))}
"""Scenario -> the (start, end) of the serving and the candidate bundle's training sets in the pool:
a retrain on more of the same traffic, on as much other traffic, or on less. With the default
seed their population shares differ by about +6, +5, -2 and -6 points."""


class Bundle:
    """One head's margin and agreement with the teacher on every population item."""

    def __init__(self, items: Items, train: np.ndarray, population: np.ndarray) -> None:
        parts = Parts(train, population, population[:1])
        probabilities, _ = head_probabilities(items, items.emb, SOURCE, parts)
        self.score = threshold_score(probabilities, CERTIFIED_SCORE)
        self.correct = probabilities.argmax(axis=1) == items.truth[SOURCE][population]
        self.share = hindsight(self.score, self.correct, TARGET)

    def fails(self, threshold: float | None) -> bool:
        """Whether the cascade keeping the margin >= ``threshold`` (and sending the rest to the
        teacher) agrees with the teacher on less than the target of the whole population."""
        if threshold is None:
            return False
        return bool(np.mean((self.score >= threshold) & ~self.correct) > 1 - TARGET)


def one_run(rng: np.random.Generator, pair: tuple[Bundle, Bundle], certifying: int, evaluation: int,
            resamples: int) -> tuple[bool, bool]:
    """Promoted, and whether the bundle serving after the gate fails its certificate."""
    drawn = rng.choice(len(pair[0].score), certifying + evaluation, replace=False)
    level = certificate_delta(DELTA, 1)
    thresholds = [threshold_for_agreement(b.score[drawn[:certifying]], b.correct[drawn[:certifying]],
                                          TARGET, level).threshold for b in pair]
    items = np.arange(len(drawn))
    serving, candidate = ([Question(items, b.score[drawn], b.correct[drawn])] for b in pair)
    promoted = compare(serving, candidate, len(drawn), TARGET, resamples=resamples,
                       seed=int(rng.integers(2 ** 31))).promotes
    return promoted, pair[int(promoted)].fails(thresholds[int(promoted)])


def main() -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("--runs", type=int, default=500)
    parser.add_argument("--pool", type=int, default=3000, help="items the training sets are drawn from")
    parser.add_argument("--certifying", type=int, default=1000)
    parser.add_argument("--evaluation", type=int, default=1000)
    parser.add_argument("--resamples", type=int, default=200,
                        help="bootstrap resamples per gate (the library's default is 1,000)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    items = load_items([FIRST, SECOND], task_named("ag_news"), EmbeddingCache(CACHE_DIR, Encoder()))
    order = np.random.default_rng(args.seed).permutation(len(items.ids))
    pool, population = order[:args.pool], order[args.pool:]
    rng = np.random.default_rng(args.seed + 1)
    rows = []
    for name, spans in PAIRS.items():
        pair = tuple(Bundle(items, pool[start:end], population) for start, end in spans)
        runs = [one_run(rng, pair, args.certifying, args.evaluation, args.resamples)  # type: ignore[arg-type]
                for _ in range(args.runs)]
        promoted = [fails for p, fails in runs if p]
        rows.append([name, f"{pair[0].share:.1%} / {pair[1].share:.1%}",
                     f"{pair[1].share - pair[0].share:+.1%}",
                     f"{np.mean([p for p, _ in runs]):.1%}",
                     f"{np.mean(promoted):.1%} of {len(promoted)}" if promoted else "-",
                     f"{np.mean([fails for _, fails in runs]):.1%}"])
        print(f"{name}: done", flush=True)
    print(f"AG News, {len(population)} population items, target {TARGET}, delta {DELTA} (each certificate at "
          f"{certificate_delta(DELTA, 1):.4f}), {args.certifying} certifying + {args.evaluation} evaluation "
          f"items a run, {args.runs} runs, {args.resamples} resamples")
    print(markdown(["candidate", "population share kept (serving / candidate)", "gap",
                    "promoted", "cert fails given promoted", "serving after the gate fails"], rows))


if __name__ == "__main__":
    main()
