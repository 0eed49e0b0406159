"""The promotion gate on synthetic bundles with known population curves: the old rule ("candidate's
certified share >= serving's", both certified at delta on the same items), the paired plug-in
bootstrap at the user's target alone ("plug-in", the rule before the band), and the library's
(``distill.loop.gate``: the same bound averaged over the band of targets up to the certificate's
effective one, "band"), each certificate of the last two at delta/2 of the first attempt's spend.

A bundle is a score s ~ U(0, 1) per item and a disagreement curve P(wrong | s) = a (1 - s)^k, so
the cascade keeping s >= t agrees on 1 - a (1 - t)^(k+1) / (k+1) of the population and keeps
1 - t: at a target the population share is q = ((k+1) (1 - target) / a)^(1/(k+1)), and a is solved
from the share asked for. The serving bundle keeps 60% at the target with k = 2; a candidate keeps
5 points more or less with the same k, or as much with k = 4 (its disagreements sit lower down:
it keeps about 5 points more at 0.99, as a fine-tuned encoder did) or k = 1 (about 5 points less
at 0.99). The two bundles are scored on the same items: their scores are tied by a Gaussian
copula (correlation RHO) and their disagreements by one uniform per item (a hard item is hard for
both), as two encoders trained on the same labels are. Each run draws n items and applies the
rules; for the bundle serving after each gate it checks the certified threshold against the
population curve (fails: agreement under the target) and records the population share that
threshold keeps (served: 1 - threshold), the share users get. The certificates are the library's
(``maths.threshold_for_agreement``), the rules the gate's. With ``--evaluation K``, each run draws
K more items, an evaluation part, and the rules marked "+ evaluation" weigh all n + K items with
the certificates on the n items (as ``distill.loop.promote`` did before 2026-12-07); "band, all
certify" is the library's gate now: both bundles certified on all n + K items (neither trained on
either part), the band read up to what that certificate asks, the rule weighing the same items;
"coverage" (``served_more``: measured, not the library's) promotes where the candidate's
certificate keeps more of the K items than the serving bundle's.

    .venv/bin/python -m bench.promotion_gate --runs 1000
    .venv/bin/python -m bench.promotion_gate --runs 1000 --sizes 300 1000 --evaluation 1000
    .venv/bin/python -m bench.promotion_gate --runs 1000 --sizes 1000 --evaluation 1000 --own 600

``--drift F --after N ...``: a drift that multiplies both bundles' disagreements at every score by F
(``distill.loop.promote`` after a drift alarm). Each run draws n items of the traffic before and N
of the traffic after, and runs the library's gate on all of them ("every held-out item", the gate
before) and on the N alone ("after the alarm", the gate now). Reported, against the curves after
the drift: promoted, how often the certificate then served fails (a refused candidate leaves the
question demoted: nothing kept, nothing fails), and the share it keeps.

    .venv/bin/python -m bench.promotion_gate --runs 300 --sizes 1600 --drift 1.5 2.5 \
        --after 150 400 1000

``--own N``: the serving bundle serves a certificate a gate made on N items of its own; only the
library's gate is run, and where it keeps the candidate aside the serving bundle keeps its own
("never") or takes the gate's certificate of it where that keeps more of the items weighed ("keeps
more", ``distill.loop.promote``'s refresh). Reported: how often either certificate served (its own,
the one after the gate) fails, and the population share served after the gate.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from scipy.stats import norm

from distill.calibration.maths import threshold_for_agreement
from distill.loop.gate import ALPHA, Question, band, certificate_delta, compare

SERVING = (0.60, 2)
"""The serving bundle's population share at the target and the exponent k of its curve."""
RHO = 0.9
SIZES = (300, 1000, 2000)
SCENARIOS = {"5 points better": (0.65, 2), "equal": (0.60, 2), "5 points worse": (0.55, 2),
             "equal, better at the top": (0.60, 4), "equal, worse at the top": (0.60, 1)}
"""Scenario -> the candidate's (population share at the target, exponent k)."""

Curve = tuple[float, int]
"""(a, k) of P(wrong | s) = a (1 - s)^k."""


def curve(share: float, exponent: int, target: float) -> Curve:
    """The curve with exponent k that keeps ``share`` of the population at ``target``."""
    return (exponent + 1) * (1 - target) / share ** (exponent + 1), exponent


def population_agreement(line: Curve, threshold: float | None) -> float:
    """The cascade's agreement on the population when the bundle keeps s >= threshold."""
    a, k = line
    return 1.0 if threshold is None else 1 - a * (1 - threshold) ** (k + 1) / (k + 1)


def draw(rng: np.random.Generator, n: int, curves: tuple[Curve, Curve], rho: float
         ) -> list[tuple[np.ndarray, np.ndarray]]:
    """Scores and agreement of both bundles on the same n items."""
    z = rng.standard_normal((2, n))
    scores = norm.cdf(np.stack([z[0], rho * z[0] + np.sqrt(1 - rho ** 2) * z[1]]))
    hard = rng.random(n)
    return [(s, hard >= a * (1 - s) ** k) for s, (a, k) in zip(scores, curves, strict=True)]


Outcome = tuple[bool, bool, float]
"""One gate: promoted, the certificate serving after it fails, the population share it keeps."""


def after(curves: tuple[Curve, Curve], promoted: bool, thresholds: list[float | None], target: float
          ) -> Outcome:
    """The outcome of a gate that promoted or not, the bundles certified at ``thresholds``."""
    chosen = int(promoted)
    threshold = thresholds[chosen]
    return (promoted, population_agreement(curves[chosen], threshold) < target,
            0.0 if threshold is None else 1 - threshold)


def one_run(rng: np.random.Generator, n: int, curves: tuple[Curve, Curve], args: argparse.Namespace,
            resamples: int) -> dict[str, Outcome]:
    """Per rule, the gate's outcome."""
    everything = draw(rng, n + args.evaluation, curves, args.rho)
    data = [(s[:n], c[:n]) for s, c in everything]
    old = [threshold_for_agreement(s, c, args.target, args.delta) for s, c in data]
    promoted = old[1].kept_share >= old[0].kept_share
    out = {"old": after(curves, promoted, [t.threshold for t in old], args.target)}
    level = certificate_delta(args.delta, 1)
    new = [threshold_for_agreement(s, c, args.target, level).threshold for s, c in data]
    rows = {"": data, " + evaluation": everything} if args.evaluation else {"": data}
    rules = {"plug-in": (args.target,), "band": band(args.target, n, level)}
    for suffix, weighed in rows.items():
        items = np.arange(len(weighed[0][0]))
        serving, candidate = ([Question(items, s, c)] for s, c in weighed)
        seed = int(rng.integers(2 ** 31))
        for rule, targets in rules.items():
            promoted = compare(serving, candidate, len(items), targets, resamples=resamples,
                               seed=seed).promotes
            out[rule + suffix] = after(curves, promoted, new, args.target)
    if args.evaluation:
        evaluation = [(s[n:], t) for (s, _), t in zip(everything, new, strict=True)]
        out["coverage"] = after(curves, served_more(evaluation), new, args.target)
        out["band, all certify"] = certified_on_all(rng, everything, curves, args, resamples)
    return out


def certified_on_all(rng: np.random.Generator, everything: list[tuple[np.ndarray, np.ndarray]],
                     curves: tuple[Curve, Curve], args: argparse.Namespace, resamples: int) -> Outcome:
    """The library's gate (``library_gate``) as one outcome."""
    promoted, thresholds = library_gate(rng, everything, args, resamples)
    return after(curves, promoted, thresholds, args.target)


def library_gate(rng: np.random.Generator, everything: list[tuple[np.ndarray, np.ndarray]],
                 args: argparse.Namespace, resamples: int) -> tuple[bool, list[float | None]]:
    """The library's gate: both bundles certified at the half level on all n + K items (the
    certifying and the evaluation part, neither of which either bundle trained on), the band read
    up to what that certificate asks of them, and the rule weighing the same items. Whether it
    promotes, and both certified thresholds."""
    level = certificate_delta(args.delta, 1)
    thresholds = [threshold_for_agreement(s, c, args.target, level).threshold for s, c in everything]
    items = np.arange(len(everything[0][0]))
    serving, candidate = ([Question(items, s, c)] for s, c in everything)
    promoted = compare(serving, candidate, len(items), band(args.target, len(items), level),
                       resamples=resamples, seed=int(rng.integers(2 ** 31))).promotes
    return promoted, thresholds


def refresh_run(rng: np.random.Generator, n: int, curves: tuple[Curve, Curve], args: argparse.Namespace
                ) -> dict[str, tuple[bool, bool, float]]:
    """The library's gate with the serving bundle serving a gate's certificate on ``args.own`` items
    of its own (at the half level of a first attempt); per refresh rule ("never": it keeps its own
    when the candidate is kept aside; "keeps more": it takes the gate's certificate of it where that
    keeps more of the items weighed, ``distill.loop.promote``'s rule): promoted, whether either
    certificate served (its own before, the one after) fails, the population share served after."""
    own_s, own_c = draw(rng, args.own, curves, args.rho)[0]
    own = threshold_for_agreement(own_s, own_c, args.target, certificate_delta(args.delta, 1)).threshold
    everything = draw(rng, n + args.evaluation, curves, args.rho)
    promoted, thresholds = library_gate(rng, everything, args, args.resamples)
    weighed = everything[0][0]
    fresh = thresholds[0]
    more = fresh is not None and (own is None or np.mean(weighed >= fresh) > np.mean(weighed >= own))
    out = {}
    for rule, refreshes in (("never", False), ("keeps more", more)):
        served = [own, thresholds[1]] if promoted else [fresh if refreshes else own, None]
        outcome = after(curves, promoted, served, args.target)
        before_fails = population_agreement(curves[0], own) < args.target
        out[rule] = (promoted, outcome[1] or before_fails, outcome[2])
    return out


def refresh_table(rng: np.random.Generator, args: argparse.Namespace) -> None:
    """The table of ``--own``: per scenario, how often a certificate served fails and the share."""
    serving = curve(*SERVING, args.target)
    print(f"the serving bundle certified on {args.own} items of its own at "
          f"{certificate_delta(args.delta, 1):.4f}; cells: either certificate served fails (population "
          "share served after the gate)")
    print(f"| n + evaluation | refresh | {' | '.join(SCENARIOS)} |")
    print("|---|---|" + "---|" * len(SCENARIOS))
    for n in args.sizes:
        cells: dict[str, list[str]] = {"never": [], "keeps more": []}
        for share, exponent in SCENARIOS.values():
            curves = (serving, curve(share, exponent, args.target))
            runs = [refresh_run(rng, n, curves, args) for _ in range(args.runs)]
            for rule, row in cells.items():
                row.append(f"{np.mean([r[rule][1] for r in runs]):.1%} "
                           f"({np.mean([r[rule][2] for r in runs]):.1%})")
        for rule, row in cells.items():
            print(f"| {n} + {args.evaluation} | {rule} | {' | '.join(row)} |", flush=True)


def drift_run(rng: np.random.Generator, n: int, after_n: int, curves: tuple[Curve, Curve],
              drifted: tuple[Curve, Curve], args: argparse.Namespace) -> dict[str, Outcome]:
    """The library's gate on n items before a drift and ``after_n`` after, weighing all or only the
    ones after; each outcome judged on the curves after the drift (refused: nothing served)."""
    before, later = draw(rng, n, curves, args.rho), draw(rng, after_n, drifted, args.rho)
    every = [(np.concatenate([b[0], a[0]]), np.concatenate([b[1], a[1]])) for b, a in zip(before, later,
                                                                                        strict=True)]
    out = {}
    for name, weighed in (("every held-out item", every), ("after the alarm", later)):
        promoted, thresholds = library_gate(rng, weighed, args, args.resamples)
        out[name] = after(drifted, promoted, thresholds, args.target) if promoted else (False, False, 0.0)
    return out


def drift_table(rng: np.random.Generator, args: argparse.Namespace) -> None:
    """The table of ``--drift``: per drift, scenario and size, promoted, fails and share served."""
    serving = curve(*SERVING, args.target)
    level = certificate_delta(args.delta, 1)
    print(f"cells: promoted, the certificate served after the gate fails after the drift (population "
          f"share it keeps after the drift); {args.runs} runs, certificates at {level:.4f}")
    print(f"| drift | items: before + after | gate weighs | {' | '.join(SCENARIOS)} |")
    print("|---|---|---|" + "---|" * len(SCENARIOS))
    for factor in args.drift:
        for n in args.sizes:
            for after_n in args.after:
                cells: dict[str, list[str]] = {"every held-out item": [], "after the alarm": []}
                for share, exponent in SCENARIOS.values():
                    curves = (serving, curve(share, exponent, args.target))
                    drifted = ((curves[0][0] * factor, curves[0][1]), (curves[1][0] * factor, curves[1][1]))
                    runs = [drift_run(rng, n, after_n, curves, drifted, args) for _ in range(args.runs)]
                    for rule, row in cells.items():
                        row.append(f"{np.mean([r[rule][0] for r in runs]):.1%}, "
                                   f"{np.mean([r[rule][1] for r in runs]):.1%} "
                                   f"({np.mean([r[rule][2] for r in runs]):.1%})")
                for rule, row in cells.items():
                    print(f"| x{factor:g} | {n} + {after_n} | {rule} | {' | '.join(row)} |", flush=True)


def served_more(bundles: list[tuple[np.ndarray, float | None]], alpha: float = ALPHA) -> bool:
    """The rule measured beside the library's (not the library's): whether the candidate's
    certified threshold keeps more of the evaluation items than the serving bundle's, paired, by a
    one-sided ``1 - alpha`` normal bound on the mean difference of the kept indicators above 0.
    It compares what each bundle would serve; the evaluation items certified neither threshold."""
    kept = [np.zeros(len(s)) if t is None else (s >= t).astype(float) for s, t in bundles]
    difference = kept[1] - kept[0]
    spread = difference.std(ddof=1) / np.sqrt(len(difference)) if len(difference) > 1 else 0.0
    return bool(difference.mean() - norm.ppf(1 - alpha) * spread > 0)


def failing(runs: list[Outcome]) -> str:
    """P(the promoted bundle's certificate fails | promoted), and of how many promoted."""
    promoted = [fails for p, fails, _ in runs if p]
    return f"{np.mean(promoted):.1%} of {len(promoted)}" if promoted else "- of 0"


def cell(runs: list[Outcome]) -> str:
    """P(promote) in one scenario, and the mean population share served after the gate."""
    return f"{np.mean([p for p, _, _ in runs]):.1%} ({np.mean([served for _, _, served in runs]):.1%})"


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
                        help="items of an evaluation part per run, weighed by the rules marked "
                        "'+ evaluation' beside the n certifying items (0: no such rows)")
    parser.add_argument("--own", type=int, default=0,
                        help="items the serving bundle's own (gate-made) certificate rests on: with it, "
                        "only the library's gate, with and without the refresh of that certificate")
    parser.add_argument("--drift", type=float, nargs="*", default=[], metavar="F",
                        help="a drift multiplying both bundles' disagreements by F: the library's gate "
                        "after a drift alarm, weighing every held-out item or only those after it")
    parser.add_argument("--after", type=int, nargs="+", default=[150, 400, 1000], metavar="N",
                        help="with --drift: held-out items after the alarm, one row each")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    started = time.perf_counter()
    if args.drift:
        drift_table(rng, args)
        print(f"({time.perf_counter() - started:.0f} s)")
        return
    if args.own:
        refresh_table(rng, args)
        print(f"({time.perf_counter() - started:.0f} s)")
        return
    level = certificate_delta(args.delta, 1)
    print(f"target {args.target}, delta {args.delta}, serving share {SERVING[0]:.0%} on the population (k = "
          f"{SERVING[1]}), score correlation {args.rho}, {args.runs} runs per cell, {args.resamples} "
          "resamples, "
          f"rule level {ALPHA}, certificates at {args.delta} (old) and {level:.4f} (the others)")
    print("cells: promoted (mean population share served after the gate)")
    print(f"| n | rule | {' | '.join(SCENARIOS)} | P(cert fails \\| promoted), all | "
          "P(promoted and fails), all |")
    print("|---|---|" + "---|" * len(SCENARIOS) + "---|---|")
    serving = curve(*SERVING, args.target)
    for n in args.sizes:
        cells: dict[str, dict[str, list[Outcome]]] = {}
        for name, (share, exponent) in SCENARIOS.items():
            curves = (serving, curve(share, exponent, args.target))
            runs = [one_run(rng, n, curves, args, args.resamples) for _ in range(args.runs)]
            for rule in runs[0]:
                cells.setdefault(rule, {})[name] = [run[rule] for run in runs]
        for rule, by_scenario in cells.items():
            row = [cell(by_scenario[name]) for name in SCENARIOS]
            pooled = [outcome for rows in by_scenario.values() for outcome in rows]
            print(f"| {n} | {rule} | {' | '.join(row)} | {failing(pooled)} | "
                  f"{np.mean([p and fails for p, fails, _ in pooled]):.1%} |", flush=True)
        print(f"(band at n = {n}: {', '.join(f'{t:.4f}' for t in band(args.target, n, level))})")
    print(f"({time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
