"""The promotion gate on synthetic bundles with known population shares: the old rule ("candidate's
certified share >= serving's", both certified at delta on the same items) against the new one
(``distill.loop.gate``: paired plug-in bootstrap bound > 0, each certificate at delta/2 of the
first attempt's spend).

A bundle is a score s ~ U(0, 1) per item and a disagreement curve P(wrong | s) = a (1 - s)^2, so
the cascade keeping s >= t agrees on 1 - a (1 - t)^3 / 3 of the population and keeps 1 - t: at a
target the population share is q = (3 (1 - target) / a)^(1/3), and a is solved from the share
asked for. The two bundles are scored on the same items: their scores are tied by a Gaussian
copula (correlation RHO) and their disagreements by one uniform per item (a hard item is hard for
both), as two encoders trained on the same labels are. Each run draws n items, applies both
rules, and for the promoted bundle checks its certified threshold against the population curve.
The certificates are the library's (``maths.threshold_for_agreement``), the rule is the gate's.
With ``--evaluation K``, each run draws K more items, an evaluation part that certifies nothing,
and a third row ("new + evaluation") applies the new rule to all n + K items, as
``distill.loop.promote`` weighs a retrained bundle's evaluation part beside its certifying items,
with the certificates of the new rule on the n items, and a fourth ("coverage", ``served_more``:
measured, not the library's) promotes where the candidate's certificate keeps more of the K
items than the serving bundle's.

    .venv/bin/python -m bench.promotion_gate --runs 1000
    .venv/bin/python -m bench.promotion_gate --runs 1000 --sizes 1000 --evaluation 1000
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from scipy.stats import norm

from distill.calibration.maths import threshold_for_agreement
from distill.loop.gate import ALPHA, Question, certificate_delta, compare

SERVING_SHARE = 0.60
RHO = 0.9
SIZES = (300, 1000, 2000)
SCENARIOS = {"5 points better": 0.05, "equal": 0.0, "5 points worse": -0.05}


def slope(share: float, target: float) -> float:
    """The a of P(wrong | s) = a (1 - s)^2 that keeps ``share`` of the population at ``target``."""
    return 3 * (1 - target) / share ** 3


def population_agreement(a: float, threshold: float | None) -> float:
    """The cascade's agreement on the population when the bundle keeps s >= threshold."""
    return 1.0 if threshold is None else 1 - a * (1 - threshold) ** 3 / 3


def draw(rng: np.random.Generator, n: int, slopes: tuple[float, float], rho: float
         ) -> list[tuple[np.ndarray, np.ndarray]]:
    """Scores and agreement of both bundles on the same n items."""
    z = rng.standard_normal((2, n))
    scores = norm.cdf(np.stack([z[0], rho * z[0] + np.sqrt(1 - rho ** 2) * z[1]]))
    hard = rng.random(n)
    return [(s, hard >= a * (1 - s) ** 2) for s, a in zip(scores, slopes, strict=True)]


def one_run(rng: np.random.Generator, n: int, slopes: tuple[float, float], args: argparse.Namespace,
            resamples: int) -> dict[str, tuple[bool, bool]]:
    """Per rule: promoted, and whether the bundle serving after the gate fails its certificate."""
    everything = draw(rng, n + args.evaluation, slopes, args.rho)
    data = [(s[:n], c[:n]) for s, c in everything]
    out = {}
    old = [threshold_for_agreement(s, c, args.target, args.delta) for s, c in data]
    promoted = old[1].kept_share >= old[0].kept_share
    chosen = int(promoted)
    out["old"] = promoted, population_agreement(slopes[chosen], old[chosen].threshold) < args.target
    level = certificate_delta(args.delta, 1)
    new = [threshold_for_agreement(s, c, args.target, level) for s, c in data]
    rows = {"new": data, "new + evaluation": everything} if args.evaluation else {"new": data}
    for rule, weighed in rows.items():
        items = np.arange(len(weighed[0][0]))
        serving, candidate = ([Question(items, s, c)] for s, c in weighed)
        promoted = compare(serving, candidate, len(items), args.target, resamples=resamples,
                           seed=int(rng.integers(2 ** 31))).promotes
        chosen = int(promoted)
        out[rule] = promoted, population_agreement(slopes[chosen], new[chosen].threshold) < args.target
    if args.evaluation:
        promoted = served_more([(s[n:], t.threshold) for (s, _), t in zip(everything, new, strict=True)])
        chosen = int(promoted)
        out["coverage"] = promoted, population_agreement(slopes[chosen], new[chosen].threshold) < args.target
    return out


def served_more(bundles: list[tuple[np.ndarray, float | None]], alpha: float = ALPHA) -> bool:
    """The rule measured beside the library's (not the library's): whether the candidate's
    certified threshold keeps more of the evaluation items than the serving bundle's, paired, by a
    one-sided ``1 - alpha`` normal bound on the mean difference of the kept indicators above 0.
    It compares what each bundle would serve; the evaluation items certified neither threshold."""
    kept = [np.zeros(len(s)) if t is None else (s >= t).astype(float) for s, t in bundles]
    difference = kept[1] - kept[0]
    spread = difference.std(ddof=1) / np.sqrt(len(difference)) if len(difference) > 1 else 0.0
    return bool(difference.mean() - norm.ppf(1 - alpha) * spread > 0)


def failing(runs: list[tuple[bool, bool]]) -> str:
    """P(the promoted bundle's certificate fails | promoted), and of how many promoted."""
    promoted = [fails for p, fails in runs if p]
    return f"{np.mean(promoted):.1%} of {len(promoted)}" if promoted else "- of 0"


def cell(runs: list[tuple[bool, bool]]) -> str:
    """P(promote) in one scenario, with the failure rate of its promoted certificates."""
    return f"{np.mean([p for p, _ in runs]):.1%} (fails {failing(runs)})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=1000)
    parser.add_argument("--target", type=float, default=0.98)
    parser.add_argument("--delta", type=float, default=0.05)
    parser.add_argument("--resamples", type=int, default=200,
                        help="bootstrap resamples per gate (the library's default is larger; fewer "
                        "make the bound's quantile noisier, not biased; kept small to bound the run)")
    parser.add_argument("--sizes", type=int, nargs="+", default=list(SIZES))
    parser.add_argument("--rho", type=float, default=RHO,
                        help="correlation of the two bundles' scores on an item (Gaussian copula)")
    parser.add_argument("--evaluation", type=int, default=0,
                        help="items of an evaluation part per run, weighed by a third rule beside the n "
                        "certifying items (0: no such row)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    started = time.perf_counter()
    print(f"target {args.target}, delta {args.delta}, serving share {SERVING_SHARE:.0%} on the population, "
          f"score correlation {args.rho}, {args.runs} runs per cell, {args.resamples} resamples, rule level "
          f"{ALPHA}, certificates at "
          f"{args.delta} (old) and {certificate_delta(args.delta, 1):.4f} (new)")
    print("| n | rule | 5 points better | equal | 5 points worse | P(cert fails \\| promoted), all | "
          "P(promoted and fails), all |")
    print("|---|---|---|---|---|---|---|")
    for n in args.sizes:
        rules = ["old", "new", *(["new + evaluation", "coverage"] if args.evaluation else [])]
        cells: dict[str, dict[str, list[tuple[bool, bool]]]] = {rule: {} for rule in rules}
        for name, gap in SCENARIOS.items():
            slopes = (slope(SERVING_SHARE, args.target), slope(SERVING_SHARE + gap, args.target))
            runs = [one_run(rng, n, slopes, args, args.resamples) for _ in range(args.runs)]
            for rule in cells:
                cells[rule][name] = [run[rule] for run in runs]
        for rule, by_scenario in cells.items():
            row = [cell(by_scenario[name]) for name in SCENARIOS]
            pooled = [pair for rows in by_scenario.values() for pair in rows]
            print(f"| {n} | {rule} | {' | '.join(row)} | {failing(pooled)} | "
                  f"{np.mean([p and fails for p, fails in pooled]):.1%} |")
    print(f"({time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
