"""Certifying on served traffic: which estimator keeps most while its certificate stays valid.

AG News is replayed as traffic in the export order (``--labels``: the committed 1.5B labels of all
7,600 items; the teacher's answer to every item is known, so every certificate can be checked).
On each of ``--resplits`` re-splits (each item's part, 50/25/25, by a hash of its id and the
re-split's salt):

1. The first ``--census`` items are collected traffic: every one is labelled. The fast tier v0 is
   trained on their train part and certified on their calibration part at ``--target``.
2. The rest is served by v0: what it escalates is labelled by the teacher (probability 1), what it
   keeps is audited with probability ``--audit-shares`` (a seeded draw per item, nested: an item
   audited at 2% is audited at 10%), the rest is never labelled.
3. v1 is trained on every labelled train-part item (census, escalations, audits) and certified on
   the calibration part's labelled items by each method of ``distill.calibration.traffic``:
   ``uniform`` (census and audits only), ``stratified`` (every labelled item, the exact test of the
   Horvitz-Thompson count), ``betting`` (the same weights, a betting test) and ``pooled`` (every
   labelled item as if uniform: not valid, measured to show what it does).
4. Each certified threshold is measured on every evaluation-part item (census and served, all
   labelled in the replay): the share kept and the realised agreement. A certificate "fails" on a
   re-split where the realised agreement is below the target: a valid method fails on at most
   delta of re-splits, up to the sampling noise of the evaluation part itself.

    PYTHONPATH=. .venv/bin/python -m bench.traffic_evidence \\
        --labels bench/labels/ag_news.qwen2.5-coder-1.5b.jsonl \\
                 bench/labels/ag_news.qwen2.5-coder-1.5b.items-4001-7600.jsonl \\
        --resplits 20 --census 2000 --audit-shares 0.02 0.1 0.3
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench.common import (
    CACHE_DIR,
    DELTA,
    TEACHER,
    Items,
    Parts,
    argument_parser,
    cell,
    certified,
    head_probabilities,
    load_items,
    markdown,
    placed,
    task_named,
)
from cascade.encoder.onnx_encoder import EmbeddingCache, Encoder
from cascade.thresholds import CERTIFIED_SCORE, threshold_score
from distill.calibration.traffic import METHODS, Window, traffic_threshold

SOURCE = "teacher, soft"


@dataclass(frozen=True)
class Outcome:
    """One method on one re-split at one audit share, on the evaluation part."""

    kept: float
    agreement: float
    labelled: float  # share of the served items the teacher labelled


def served_by_v0(items: Items, part: np.ndarray, census: int, target: float) -> np.ndarray:
    """Which items v0 keeps: trained and certified on the census, applied to every item."""
    index = np.arange(len(items.ids))
    parts = Parts(index[(index < census) & (part == 0)], index[(index < census) & (part == 1)], index)
    cal, every = head_probabilities(items, items.emb, SOURCE, parts)
    threshold = certified(cal, items.truth[SOURCE][parts.calibration], target, DELTA, CERTIFIED_SCORE)
    return threshold_score(every, CERTIFIED_SCORE) >= threshold


def replay(items: Items, part: np.ndarray, census: int, kept0: np.ndarray, audited: np.ndarray,
           share: float, target: float) -> dict[str, Outcome]:
    """v1 retrained on what the teacher labelled, certified by every method, measured."""
    truth, index = items.truth[SOURCE], np.arange(len(items.ids))
    in_census = index < census
    always = in_census | ~kept0
    labelled = always | audited
    cal = index[labelled & (part == 1)]
    parts = Parts(index[labelled & (part == 0)], cal, index[part == 2])
    cal_probs, held = head_probabilities(items, items.emb, SOURCE, parts)
    window = Window(census=int((in_census & (part == 1)).sum()), served=int((~in_census & (part == 1)).sum()),
                    audit_share=share)
    score = threshold_score(cal_probs, CERTIFIED_SCORE)
    correct = cal_probs.argmax(axis=1) == truth[cal]
    uniform = in_census[cal] | audited[cal]
    held_score = threshold_score(held, CERTIFIED_SCORE)
    wrong = held.argmax(axis=1) != truth[parts.evaluation]
    outcomes: dict[str, Outcome] = {}
    for method in METHODS:
        result = traffic_threshold(score, correct, always[cal], uniform, window, target, DELTA, method)
        keep = held_score >= (np.inf if result.threshold is None else result.threshold)
        outcomes[method] = Outcome(float(keep.mean()), 1 - float((keep & wrong).sum()) / len(keep),
                                   float(labelled[~in_census].mean()))
    return outcomes


def main() -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("--labels", type=Path, nargs="+", required=True, metavar="TEACHER.jsonl")
    parser.add_argument("--resplits", type=int, default=20)
    parser.add_argument("--census", type=int, default=2000,
                        help="items of collected traffic first (default 2000)")
    parser.add_argument("--audit-shares", type=float, nargs="+", default=[0.02, 0.1, 0.3])
    parser.add_argument("--target", type=float, default=0.98)
    args = parser.parse_args()
    items = load_items(args.labels, task_named("ag_news"), EmbeddingCache(CACHE_DIR, Encoder()))
    print(f"{len(items.ids)} AG News items labelled by {TEACHER}; the first {args.census} collected, the "
          f"rest served by v0; target {args.target}, delta {DELTA}; {args.resplits} re-splits", flush=True)
    runs: dict[tuple[float, str], list[Outcome]] = {}
    v0: list[float] = []
    for number in range(args.resplits):
        part = placed(items.ids, f"traffic-{number}")
        kept0 = served_by_v0(items, part, args.census, args.target)
        v0.append(float(kept0[args.census:].mean()))
        draw = np.random.default_rng(number).random(len(items.ids))
        for share in args.audit_shares:
            audited = (np.arange(len(items.ids)) >= args.census) & (draw < share)
            for method, outcome in replay(items, part, args.census, kept0, audited, share,
                                          args.target).items():
                runs.setdefault((share, method), []).append(outcome)
        print(f"re-split {number + 1}/{args.resplits}: v0 keeps {v0[-1]:.1%} of the served items", flush=True)
    print(f"\nv0 (trained and certified on the {args.census} collected items) keeps {cell(v0, '.1%')} of "
          "the served items")
    rows = []
    for (share, method), outcomes in runs.items():
        agreement = [o.agreement for o in outcomes]
        rows.append([f"{share:.0%}", method, f"{statistics.mean(o.labelled for o in outcomes):.1%}",
                     cell([o.kept for o in outcomes], ".1%"), cell(agreement, ".4f"),
                     f"{sum(a < args.target for a in agreement)}/{len(outcomes)}"])
    print(markdown(["audit share", "method", "served items labelled", "v1 keeps: mean (worst)",
                    "realised agreement: mean (worst)", "certificate failed"], rows))


if __name__ == "__main__":
    main()
