"""Audit where the answer is not already known: at the same number of teacher calls, uniform audits
over all routed items against audits of the locally answered items only, by simulation.

A bundle is a score s ~ U(0, 1) per item and a disagreement curve P(wrong | s) = a (1 - s)^2 (as
bench/promotion_gate.py), with a set so that the population share kept at the target is
``--population-share``: keeping s >= t agrees on 1 - a (1 - t)^3 / 3 of the population and keeps
1 - t. The serving cascade escalates s < e (e: the escalation share), and with
``--escalation-share 1`` every escalation carries the teacher's answer. Each run routes
N = calls / ``--audit-share`` items, and the local ones are audited with probability
p = q / (1 - e) (q = ``--audit-share``), so both designs make ``calls`` teacher calls in
expectation. The server audits an item the teacher answered on every question with no teacher
call (``cascade.audit.auditor``: it records the answers the request already got), so at the same
calls its uniform audits draw every routed item with probability p too, on the same draws:

- ``uniform`` (what ships): each item audited with probability p, escalated ones at no call; the
  certificate is ``maths.threshold_for_agreement`` on the audited items alone. With
  ``--charge-escalated``, as this bench first measured it: audited with probability q, each audit a
  call, so that it audits p / q times fewer local items than the designs beside it at the
  same calls (which the server does not).
- ``uniform over N``: the same audits, certified as ``union`` below certifies its local stratum
  (the disagreements counted over all N routed items, r(t) <= CP_upper(d(t), N, delta) / its
  audit share): so that the table tells what the estimator gains from what the design gains.
- ``local only``: each locally answered item (s >= e) audited with probability
  p = q / (1 - e); the escalated ones are all labelled already. Two certificates of a threshold t,
  scanned strict to lax (fixed-sequence, as Learn then Test), each certifying where its upper
  bound on the disagreement rate is <= 1 - target (and, with ``--exact``, a third):

  - ``plug-in strata`` (the design as first proposed): D_esc(t) / N + (N_local / N) x
    CP_upper(d(t), m, delta), with D_esc(t) the escalated disagreements at s >= t counted exactly,
    d(t) those among the m audited local items. The local rate's bound is exact; the escalated
    count and the stratum weight N_local / N are taken as known, which they are for the N routed
    items but not for new traffic.
  - ``union``: each routed item is independently an escalated disagreement kept at t (probability
    r_e) or an audited local one (probability p r_l), so r_e <= CP_upper(D_esc, N, delta/2) and
    r_l <= CP_upper(d, N, delta/2) / p, and the risk r_e + r_l is bounded by their sum with
    probability >= 1 - delta (a union bound). For t >= e no escalation is kept (r_e = 0 by
    design, known before any draw), so there the whole delta goes to the local bound. The bound
    only grows as t falls, which is what the fixed-sequence argument needs.
  - ``exact``: ``distill.calibration.traffic``'s ``stratified`` method, the exact law of the
    Horvitz-Thompson count D_esc + d / p at the least favourable split of the risk between the
    two strata: valid with no split of delta, but 0.3-4 s a run.

Per cell, per design: the population share kept at the certified threshold (mean over runs) and
the failure rate (runs whose certified threshold agrees on less than the target of the
population: valid designs stay <= delta, up to the runs' noise, ±1.4 points at 1,000 runs).

    .venv/bin/python -m bench.audit_design --runs 1000
    .venv/bin/python -m bench.audit_design --runs 1000 --population-share 0.8
    .venv/bin/python -m bench.audit_design --runs 1000 --population-share 0.8 --audit-share 0.3 \\
        --escalated 0.5 --calls 1000 3000
    .venv/bin/python -m bench.audit_design --runs 200 --population-share 0.8 --calls 150 300 --exact
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
from scipy.stats import beta

from bench.common import argument_parser, markdown
from distill.calibration.maths import threshold_for_agreement
from distill.calibration.traffic import Window, traffic_threshold

ESCALATED = (0.1, 0.3, 0.5)
CALLS = (150, 300, 1000)
DESIGNS = ("uniform", "uniform over N", "plug-in strata", "union")


def slope(share: float, target: float) -> float:
    """The a of P(wrong | s) = a (1 - s)^2 that keeps ``share`` of the population at ``target``."""
    return 3 * (1 - target) / share ** 3


def population(a: float, threshold: float | None) -> tuple[float, float]:
    """(share kept, cascade agreement) on the population when the tier keeps s >= threshold."""
    if threshold is None:
        return 0.0, 1.0
    return 1 - threshold, 1 - a * (1 - threshold) ** 3 / 3


def cp_upper(count: np.ndarray, n: int, level: float) -> np.ndarray:
    """The exact one-sided (Clopper-Pearson) upper bound on a binomial rate from ``count`` of n,
    per element; computed once per distinct count, since the scans below ask for thousands of
    thresholds but only a few dozen counts."""
    values, inverse = np.unique(count, return_inverse=True)
    bound = np.where(values < n, beta.ppf(1 - level, values + 1, np.maximum(n - values, 1)), 1.0)
    return np.asarray(bound)[inverse]


def first_failure(bound: np.ndarray, thresholds: np.ndarray, alpha: float) -> float | None:
    """Fixed-sequence scan strict to lax: the last threshold before the first bound over alpha."""
    passed = np.logical_and.accumulate(bound <= alpha)
    return float(thresholds[int(passed.sum()) - 1]) if passed.any() else None


def stratified(score: np.ndarray, wrong: np.ndarray, escalated: np.ndarray, audited: np.ndarray,
               rate: float, args: Any) -> dict[str, float | None]:
    """Both local-only certificates from the escalated items (all labelled) and the audited
    local ones (each with probability ``rate``)."""
    n, n_local, m = len(score), int((~escalated).sum()), int(audited.sum())
    labelled = escalated | audited
    order = np.argsort(-score[labelled], kind="stable")
    thresholds = score[labelled][order]
    d_esc = np.cumsum((wrong & escalated)[labelled][order])
    d_local = np.cumsum((wrong & audited)[labelled][order])
    alpha = 1 - args.target
    local_rate = cp_upper(d_local, m, args.delta) if m else np.ones(len(thresholds))
    plug_in = d_esc / n + n_local / n * local_rate
    below = thresholds < args.serving
    escalated_rate = np.where(below, cp_upper(d_esc, n, args.delta / 2), 0.0)
    local = np.where(below, cp_upper(d_local, n, args.delta / 2), cp_upper(d_local, n, args.delta))
    union = escalated_rate + local / rate
    return {"plug-in strata": first_failure(plug_in, thresholds, alpha),
            "union": first_failure(union, thresholds, alpha)}


def over_routed(score: np.ndarray, wrong: np.ndarray, n: int, share: float, args: Any) -> float | None:
    """Uniform audits certified as the union design certifies its local stratum: each of the n
    routed items is an audited disagreement kept at t with probability q r(t) (q: ``share``, the
    uniform audit share), so r(t) <= CP_upper(d(t), n, delta) / q. It does not condition on how
    many were audited."""
    order = np.argsort(-score, kind="stable")
    bound = cp_upper(np.cumsum(wrong[order]), n, args.delta) / share
    return first_failure(bound, score[order], 1 - args.target)


def one_run(rng: np.random.Generator, calls: int, args: Any) -> dict[str, float | None]:
    """The certified threshold of each design on one draw of N routed items."""
    n = round(calls / args.audit_share)
    score = rng.random(n)
    wrong = rng.random(n) < args.a * (1 - score) ** 2
    draw = rng.random(n)
    rate = min(1.0, args.audit_share / (1 - args.serving))
    share = args.audit_share if args.charge_escalated else rate
    uniform = draw < share
    out = {"uniform": threshold_for_agreement(score[uniform], ~wrong[uniform], args.target,
                                              args.delta).threshold,
           "uniform over N": over_routed(score[uniform], wrong[uniform], n, share, args)}
    escalated = score < args.serving
    local = ~escalated & (draw < rate)
    out.update(stratified(score, wrong, escalated, local, rate, args))
    if args.exact:
        labelled = escalated | local
        out["exact"] = traffic_threshold(score[labelled], ~wrong[labelled], escalated[labelled],
                                         local[labelled], Window(0, n, rate), args.target,
                                         args.delta).threshold
    return out


def summary(thresholds: list[float | None], a: float, target: float) -> tuple[str, str]:
    """Mean population share kept, and the share of runs whose certificate fails."""
    truth = [population(a, t) for t in thresholds]
    return (f"{np.mean([kept for kept, _ in truth]):.1%}",
            f"{np.mean([agreement < target for _, agreement in truth]):.1%}")


def main() -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("--runs", type=int, default=1000)
    parser.add_argument("--target", type=float, default=0.98)
    parser.add_argument("--delta", type=float, default=0.05)
    parser.add_argument("--audit-share", type=float, default=0.05,
                        help="q: N = calls / q items are routed, and each design audits the local ones "
                        "at q / (1 - e); the uniform design audits every item at q / (1 - e) (at q "
                        "with --charge-escalated)")
    parser.add_argument("--population-share", type=float, default=0.6,
                        help="the share the population keeps at the target (the best any "
                        "certificate can approach)")
    parser.add_argument("--calls", type=int, nargs="+", default=list(CALLS))
    parser.add_argument("--escalated", type=float, nargs="+", default=list(ESCALATED))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--charge-escalated", action="store_true",
                        help="audit uniformly at --audit-share, an escalated item's audit counted as a "
                        "teacher call (the comparison as first measured; the server makes none)")
    parser.add_argument("--exact", action="store_true",
                        help="add the exact multinomial test of distill.calibration.traffic (0.3-4 s "
                        "a run: use with fewer runs)")
    args = parser.parse_args()
    designs = (*DESIGNS, "exact") if args.exact else DESIGNS
    args.a = slope(args.population_share, args.target)
    rng = np.random.default_rng(args.seed)
    started = time.perf_counter()
    rows = []
    for escalated in args.escalated:
        args.serving = escalated
        for calls in args.calls:
            runs = [one_run(rng, calls, args) for _ in range(args.runs)]
            row = [f"{escalated:.0%}", f"{calls:,}", f"{round(calls / args.audit_share):,}"]
            for design in designs:
                row.extend(summary([run[design] for run in runs], args.a, args.target))
            rows.append(row)
    print(f"target {args.target}, delta {args.delta}, population share at the target "
          f"{args.population_share:.0%}, uniform audit share {args.audit_share}, {args.runs} runs per cell")
    header = ["escalated", "teacher calls", "routed N"]
    for design in designs:
        header.extend([f"{design}: kept", f"{design}: fails"])
    print(markdown(header, rows))
    print(f"({time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
