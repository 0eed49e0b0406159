"""The promotion gate after a drift alarm, on AG News: why it weighs only items labelled after it.

A drift alarm on the serving bundle's calibration says live traffic refuted its certificate, and
the question is demoted (answered by the teacher) until a calibration certifies it again. A
promotion is such a calibration, and the held-out items a gate weighs then are mostly of the
traffic before the drift. ``distill.loop.promote`` therefore weighs and certifies both bundles only
on the items labelled after the alarm (``gate.evidence_after``). This replays the choice on real
data, beside the gate before it, which weighed every held-out item.

Bundles as in ``bench.gate_replay``: the library's head fitted to the committed 1.5B answers of a
training set drawn from a pool, the serving bundle on pool items 0-1,000 and the candidate on
0-2,000 (better before the drift). The traffic before the drift is the population (every item
outside the pool); after it, the items the teacher itself finds ambiguous, alone or as half of the
traffic (SHIFTS; a certificate of the traffic before fails on both, so an alarm would rise; the
topic the serving bundle agrees least on does not fail one at the gate's level). Each run draws
``--before`` held-out items of the traffic before and, per ``--after`` size, that many of the
traffic after (drawn as traffic comes: an item may come twice), and gates as the library does
(both bundles certified at half the first attempt's delta, the rule over the band): on all of them
("every held-out item", the gate before) and on the items after alone ("after the alarm", the gate
now). A refused candidate leaves the question
demoted (teacher answers: nothing kept, nothing fails). Reported, on the traffic after the drift:
how often the gate promotes, how often the certificate the question is then served under fails
there (the cascade at its threshold agrees with the teacher on less than the target of the
drifted population), and the share of that traffic it keeps.

    PYTHONPATH=. .venv/bin/python -m bench.gate_after_alarm --runs 1000
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
    argument_parser,
    load_items,
    markdown,
    task_named,
)
from bench.gate_replay import SOURCE, Bundle, gate
from cascade.encoder.onnx_encoder import EmbeddingCache, Encoder
from distill.calibration.maths import threshold_for_agreement
from distill.loop.gate import certificate_delta

AMBIGUOUS = 0.6
"""An item the teacher finds ambiguous: its top probability is below this (as bench.drift_streams)."""
SHIFTS = {"ambiguous only": 1.0, "half ambiguous": 0.5}
"""The traffic after the drift: this share of it drawn from the items the teacher finds ambiguous
(its top probability under AMBIGUOUS), the rest from the whole population."""


def drift(items: Items, population: np.ndarray, share: float) -> np.ndarray:
    """The traffic after the drift as a distribution over the population's items."""
    odd = items.targets[SOURCE][population].max(axis=1) < AMBIGUOUS
    return share * odd / odd.sum() + (1 - share) / len(population)


def served(bundle: Bundle, threshold: float | None, traffic: np.ndarray) -> tuple[bool, float]:
    """Whether the cascade at ``threshold`` fails the target on ``traffic`` (a distribution over the
    population), and the share of it it keeps."""
    if threshold is None:
        return False, 0.0
    kept = bundle.score >= threshold
    return bool(traffic @ (kept & ~bundle.correct) > 1 - TARGET), float(traffic @ kept)


def one_run(rng: np.random.Generator, pair: tuple[Bundle, Bundle], before: int, after: int,
            traffic: np.ndarray, resamples: int) -> dict[str, tuple[bool, bool, float]]:
    """Per gate: promoted, whether the certificate then served fails on the traffic after the
    drift, and the share of it kept (a refusal leaves the question demoted: nothing kept). Items
    are drawn as traffic comes, independently (an item may come twice)."""
    old = rng.choice(len(traffic), before)
    new = rng.choice(len(traffic), after, p=traffic)
    out = {}
    for name, weighed in (("every held-out item", np.concatenate([old, new])), ("after the alarm", new)):
        one = gate(rng, pair, weighed, weighed, 1, resamples)
        fails, kept = served(pair[1], one.thresholds[1], traffic) if one.promoted else (False, 0.0)
        out[name] = (one.promoted, fails, kept)
    return out


def certified_before(bundle: Bundle, rng: np.random.Generator) -> float | None:
    """A certificate of the traffic before the drift: 1,000 population items at half the delta."""
    drawn = rng.choice(len(bundle.score), 1000, replace=False)
    return threshold_for_agreement(bundle.score[drawn], bundle.correct[drawn], TARGET,
                                   certificate_delta(DELTA, 1)).threshold


def main() -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("--runs", type=int, default=1000)
    parser.add_argument("--pool", type=int, default=3000, help="items the training sets are drawn from")
    parser.add_argument("--before", type=int, default=1600, help="held-out items from before the drift")
    parser.add_argument("--after", type=int, nargs="+", default=[150, 400, 1000],
                        help="held-out items from after the alarm, one row each")
    parser.add_argument("--resamples", type=int, default=200,
                        help="bootstrap resamples per gate (the library's default is 1,000)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    items = load_items([FIRST, SECOND], task_named("ag_news"), EmbeddingCache(CACHE_DIR, Encoder()))
    order = np.random.default_rng(args.seed).permutation(len(items.ids))
    pool, population = order[:args.pool], order[args.pool:]
    pair = (Bundle(items, pool[:1000], population), Bundle(items, pool[:2000], population))
    rng = np.random.default_rng(args.seed + 1)
    rows = []
    for shift, share in SHIFTS.items():
        traffic = drift(items, population, share)
        for bundle, role in zip(pair, ("serving", "candidate"), strict=True):
            fails, kept = served(bundle, certified_before(bundle, rng), traffic)
            print(f"{shift}: the {role} bundle's certificate of the traffic before keeps {kept:.1%} of the "
                  f"traffic after, {'failing' if fails else 'holding'} there", flush=True)
        for after in args.after:
            runs = [one_run(rng, pair, args.before, after, traffic, args.resamples) for _ in range(args.runs)]
            for name in runs[0]:
                outcomes = [run[name] for run in runs]
                rows.append([shift, f"{args.before} + {after}", name,
                             f"{np.mean([p for p, _, _ in outcomes]):.1%}",
                             f"{np.mean([f for _, f, _ in outcomes]):.1%}",
                             f"{np.mean([k for _, _, k in outcomes]):.1%}"])
    print(f"AG News, {len(population)} population items, target {TARGET}, delta {DELTA} (each certificate at "
          f"{certificate_delta(DELTA, 1):.4f}), {args.runs} runs, {args.resamples} resamples; the serving "
          f"bundle keeps {pair[0].share:.1%} of the population and the candidate {pair[1].share:.1%}")
    print(markdown(["traffic after the drift", "held-out items: before + after the alarm", "gate weighs",
                    "promoted", "served certificate fails after the drift", "share of it kept"], rows))


if __name__ == "__main__":
    main()
