"""The promotion gate's level (``gate.ALPHA``): can one level meet both of issue 41's goals in the
simulation, a candidate 5 points better promoted in at least 90% of runs and one 5 points worse in
at most 5%?

The library's gate as ``bench.promotion_gate`` simulates it ("band, all certify": both bundles on
n certifying + n evaluation items, the band read up to what a certificate at the first attempt's
half level asks of them, ``RESAMPLES`` paired resamples), each run's bootstrap distribution read at
several levels at once: promoted where its ``alpha`` quantile is above 0 ("point > 0": the
difference on the items as they are). Scenarios and curves are ``bench.promotion_gate``'s (rho 0.9).

    .venv/bin/python -m bench.gate_level --runs 300 --sizes 1000 300
"""

from __future__ import annotations

import argparse

import numpy as np

from bench.promotion_gate import RHO, SCENARIOS, SERVING, curve, draw
from distill.loop.gate import RESAMPLES, band, certificate_delta, weighted_shares

ALPHAS = (0.2, 0.3, 0.4, 0.5)
SHOWN = ("5 points better", "equal", "5 points worse", "equal, worse at the top")


def differences(everything: list[tuple[np.ndarray, np.ndarray]], targets: tuple[float, ...],
                rng: np.random.Generator) -> np.ndarray:
    """Candidate minus serving band share: row 0 on the items as they are, then per resample."""
    n = len(everything[0][0])
    items = np.arange(n)
    draws = rng.integers(0, n, size=(RESAMPLES, n)) + n * np.arange(1, RESAMPLES + 1)[:, None]
    weights = np.bincount(draws.ravel(), minlength=(RESAMPLES + 1) * n).reshape(RESAMPLES + 1, n)
    weights = weights.astype(np.int32)
    weights[0] = 1
    means = [np.mean([weighted_shares(weights, s, c, items, t) for t in targets], axis=0)
             for s, c in everything]
    return means[1] - means[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=300)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1000, 300])
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    level = certificate_delta(0.05, 1)
    print("| certifying + evaluation items | candidate | " + " | ".join(f"alpha {a}" for a in ALPHAS)
          + " | point > 0 |")
    print("|---|---|" + "---|" * (len(ALPHAS) + 1))
    for n in args.sizes:
        targets = band(0.98, 2 * n, level)
        for name in SHOWN:
            curves = (curve(*SERVING, 0.98), curve(*SCENARIOS[name], 0.98))
            rows = []
            for _ in range(args.runs):
                d = differences(draw(rng, 2 * n, curves, RHO), targets, rng)
                rows.append([np.quantile(d[1:], a) > 0 for a in ALPHAS] + [d[0] > 0])
            rates = np.mean(rows, axis=0)
            print(f"| {n:,} + {n:,} | {name} | " + " | ".join(f"{r:.1%}" for r in rates) + " |", flush=True)


if __name__ == "__main__":
    main()
