"""How often judging a middle tier on a sample takes out one that would have paid
(``distill.calibration.early_payoff``), by simulation.

A tier reads N states that reach it (one question each, the teacher's seconds per state 1). Its
margin s is uniform on [0, 1] and it agrees with the teacher with probability
``floor + (1 - floor) * s**2``, so that ``floor`` sets its quality; a "flat" tier agrees with
probability ``floor`` whatever its margin (a margin that says nothing, as gemma-3-270m's does
on the demo's questions). Scored on every state, calibration
certifies its threshold at the target (``maths.threshold_for_agreement``, the real code) and keeps it
where what it keeps saves more than it costs (c seconds a state). Judged early, it reads a seeded
sample of ``SAMPLE_STATES`` and is taken out where its cost exceeds ``MARGIN`` times what an ideal
threshold on the sample keeps (the real ``judged_early``). For each (quality, cost): P(taken out
early | full scoring keeps it), the error that costs money, and P(kept for full scoring | full
scoring takes it out), which only costs the time the sample would have saved.

    .venv/bin/python -m bench.early_payoff --runs 400
"""

from __future__ import annotations

import numpy as np

from bench.common import argument_parser, markdown
from cascade.cost.pricing import TierCost as PriceCost
from cascade.cost.pricing import TierPricing, estimate_tokens
from cascade.questions import NoulQuestion
from cascade.tiers.base import Item
from distill.calibration.early_payoff import MARGIN, SAMPLE_STATES, judged_early
from distill.calibration.maths import threshold_for_agreement
from distill.calibration.results import TierCost

QUESTION = {"q": NoulQuestion(type="noul", instructions="Urgent?")}
TOP = TierPricing(PriceCost(1.0, 0.0), estimate_tokens, fanout=True)
"""The teacher: 1 s a state, nothing a token, so a state kept saves it 1 s."""


def one_run(rng: np.random.Generator, n: int, tier: tuple[float, bool], cost: float, target: float
            ) -> tuple[bool, bool]:
    """(full scoring keeps the tier, the sample takes it out) for one draw of n states; ``tier``:
    its quality floor, and whether its margin is flat (says nothing)."""
    floor, flat = tier
    margin = rng.uniform(0, 1, n)
    agree = rng.uniform(0, 1, n) < (floor if flat else floor + (1 - floor) * margin**2)
    chosen = threshold_for_agreement(margin, agree, target, 0.05)
    kept = 0 if chosen.threshold is None else int(np.sum(margin >= chosen.threshold))
    pays = kept * 1.0 > n * cost
    ids = [f"i{k}" for k in range(n)]
    sample = rng.choice(n, SAMPLE_STATES, replace=False)
    probs = {"q": {ids[k]: np.array([0.5 + margin[k] / 2, 0.5 - margin[k] / 2]) for k in sample}}
    labels = {"q": {ids[k]: 0 if agree[k] else 1 for k in sample}}
    spent = TierCost(tier="middle", kind="gguf", states=SAMPLE_STATES, tokens=SAMPLE_STATES,
                     seconds=cost * SAMPLE_STATES, batches=SAMPLE_STATES, seconds_per_state=cost,
                     seconds_per_token=0.0)
    out = judged_early([Item(ids[k], "x") for k in sample], n, probs, spent, ({}, []), labels, target,
                       TOP, QUESTION)
    return pays, out is not None


def main() -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("--runs", type=int, default=400)
    parser.add_argument("--states", type=int, default=240)
    parser.add_argument("--target", type=float, default=0.95)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    rows = []
    for floor, flat in ((0.5, False), (0.7, False), (0.85, False), (0.5, True), (0.8, True)):
        for cost in (0.02, 0.1, 0.3, 0.6):
            runs = [one_run(rng, args.states, (floor, flat), cost, args.target) for _ in range(args.runs)]
            pays = [out for keep, out in runs if keep]
            wasted = [not out for keep, out in runs if not keep]
            rows.append([f"{'flat ' if flat else ''}{floor:g}", f"{cost:g}", f"{len(pays) / args.runs:.0%}",
                         f"{np.mean(pays):.1%}" if pays else "-",
                         f"{np.mean(wasted):.1%}" if wasted else "-"])
    print(f"{args.runs} runs each, {args.states} states reach the tier, a sample of {SAMPLE_STATES}, "
          f"margin {MARGIN:g}, target {args.target:g}, delta 0.05")
    print(markdown(["tier's quality", "cost / teacher's", "full scoring keeps it",
                    "taken out early | full keeps", "scored in full | full takes out"], rows))


if __name__ == "__main__":
    main()
