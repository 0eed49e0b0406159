"""The drift alarm on streams of real traffic: the committed 1.5B labels of AG News, re-mixed.

Per split (a seeded 50/25/25 permutation of the 4,000 labelled items, as bench/goals.py makes
them), the library's head on the shipped MiniLM (with hashed n-grams) is fitted on the train
part with the teacher's probabilities, its threshold certified on the calibration part as
``cascade calibrate`` certifies it (target ``--target``, delta ``--delta``, raw margin), and the
gate for unfamiliar inputs fitted on the train part's vectors as ``cascade train`` fits it. On
each evaluation item (new items of the calibration distribution) the system's answer is then
known: the encoder's where it clears the threshold and the gate lets it through, else the
teacher's. So is whether it agrees with the teacher.

Streams are routed items drawn from the evaluation items, each audited with probability
``--share`` (chosen before the answer, as the audit sampler does):

- **no shift**: ``--streams`` streams (spread over ``--splits`` splits, so the certificate's own
  draw is in the figure) of ``--audited`` audited items each, items drawn uniformly. Every alarm
  is false where the evaluation items' agreement is at least the target; and the same items
  re-weighted so that agreement is exactly the target (agreeing and disagreeing items drawn at
  target : 1 - target), where every alarm is false too. Side by side on the same streams: the
  library's betting alarm with its online-Newton stakes and with the plug-in ones, and the
  one-sided Clopper-Pearson upper bound on the last ``--window`` audited items, re-tested every
  ``--every`` audited items, as peers re-test a fixed window.
- **shifted**: the same mix for ``--before`` routed items, then a drift: only items of the class
  on which the system agrees least (by gold topic: the traffic's mix of topics moves), or only
  items the teacher itself finds ambiguous (its top probability below 0.6). Measured: the share
  of streams whose alarm rose after the drift within ``--audited`` audited items, the audited and
  routed items it took, and the disagreements the system served after the drift until the alarm,
  with the gate and without it (the same streams, the same audit draws).
- ``--restart-every N ...``: also the library's alarm started afresh every N audited items, as the
  server's watch starts afresh on every new calibration version (a promotion, or a refresh of the
  serving bundle's certificate by a gate that kept its candidate aside): how a loop that swaps
  versions often delays or misses a drift, and what restarts do to false alarms.

    PYTHONPATH=. .venv/bin/python -m bench.drift_streams --splits 10 --streams 200
    PYTHONPATH=. .venv/bin/python -m bench.drift_streams --splits 10 --streams 200 \
        --shifted-streams 100 --restart-every 50 100 200 400
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench.common import (
    CACHE_DIR,
    Alarm,
    Items,
    argument_parser,
    betting,
    certified,
    clopper_pearson,
    head_probabilities,
    load_items,
    parts_of,
    task_named,
)
from cascade.encoder.familiar import FamiliarityGate
from cascade.encoder.onnx_encoder import EmbeddingCache, Encoder
from cascade.thresholds import CERTIFIED_SCORE, threshold_score

LABELS = "bench/labels/ag_news.qwen2.5-coder-1.5b.jsonl"
SOURCE = "teacher, soft"
AMBIGUOUS = 0.6
"""An item the teacher finds ambiguous: its top probability is below this."""


@dataclass(frozen=True)
class System:
    """One split's system on its evaluation items: agreement with the teacher, with and without
    the gate, and what a shift may select by."""

    agreed: np.ndarray  # (n,) bool: with the gate
    agreed_ungated: np.ndarray  # (n,) bool: the encoder's threshold alone
    gold: np.ndarray  # (n,) gold topic index
    teacher_top: np.ndarray  # (n,) the teacher's top probability
    kept: float  # share the encoder keeps, with the gate
    gated: float  # share the gate sends up that the threshold would have kept


def system_of(items: Items, order: np.ndarray, target: float, delta: float) -> System:
    parts = parts_of(order)
    cal, ev = head_probabilities(items, items.emb, SOURCE, parts)
    truth = items.truth[SOURCE]
    threshold = certified(cal, truth[parts.calibration], target, delta, CERTIFIED_SCORE)
    gate = FamiliarityGate.fit(items.emb[parts.train])
    confident = threshold_score(ev, CERTIFIED_SCORE) >= threshold
    familiar = gate.distances(items.emb[parts.evaluation]) <= gate.radius
    right = ev.argmax(axis=1) == truth[parts.evaluation]
    keep = confident & familiar
    return System(agreed=~keep | right, agreed_ungated=~confident | right,
                  gold=items.truth["gold"][parts.evaluation],
                  teacher_top=items.targets[SOURCE][parts.evaluation].max(axis=1),
                  kept=float(keep.mean()), gated=float((confident & ~familiar).mean()))


def alarms(args: argparse.Namespace) -> dict[str, Alarm]:
    return {
        "betting, ONS stakes": betting(args.target, args.delta),
        "betting, plug-in stakes": betting(args.target, args.delta, "plug-in"),
        f"Clopper-Pearson, last {args.window}, every {args.every}": clopper_pearson(
            args.target, args.delta, args.every, args.window),
        **{f"betting, ONS stakes, restarted every {every}": restarted(betting(args.target, args.delta), every)
           for every in args.restart_every},
    }


def restarted(alarm: Alarm, every: int) -> Alarm:
    """``alarm`` started afresh every ``every`` audited items, as the server's watch starts afresh
    on each new calibration version (a promotion, a refresh): the first alarm in any stretch."""
    def run(outcomes: np.ndarray) -> int | None:
        for start in range(0, len(outcomes), every):
            at = alarm(outcomes[start:start + every])
            if at is not None:
                return start + at
        return None

    return run


def no_shift(systems: list[System], args: argparse.Namespace) -> None:
    per_split = args.streams // len(systems)
    print(f"\nno shift: {per_split * len(systems)} streams of {args.audited} audited items "
          f"({per_split} per split), items drawn from the evaluation part")
    print(f"  evaluation agreement per split: {', '.join(f'{s.agreed.mean():.4f}' for s in systems)} "
          f"(target {args.target})")
    print(f"  encoder keeps {statistics.mean(s.kept for s in systems):.1%} (gate sends up "
          f"{statistics.mean(s.gated for s in systems):.1%} more)")
    rng = np.random.default_rng(args.seed)
    streams = [(s, s.agreed[rng.integers(len(s.agreed), size=args.audited)])
               for s in systems for _ in range(per_split)]
    edge = [s.agreed[_at_target(s.agreed, args.target, args.audited, rng)] for s in systems
            for _ in range(per_split)]
    for name, alarm in alarms(args).items():
        fired = [alarm(outcomes) is not None for _, outcomes in streams]
        null = [f for (s, _), f in zip(streams, fired, strict=True) if s.agreed.mean() >= args.target]
        at_edge = np.mean([alarm(outcomes) is not None for outcomes in edge])
        print(f"  {name:<40} ever alarmed: {np.mean(fired):6.1%} of all streams, {np.mean(null):6.1%} "
              f"of the {len(null)} whose agreement is at least the target; re-weighted to exactly the "
              f"target: {at_edge:6.1%}")


def _at_target(agreed: np.ndarray, target: float, size: int, rng: np.random.Generator) -> np.ndarray:
    """``size`` draws of these items, the agreeing and disagreeing ones weighted so that the
    expected agreement is exactly ``target`` (the null's edge: every alarm is false)."""
    weights = np.where(agreed, target / agreed.sum(), (1 - target) / (~agreed).sum())
    return rng.choice(len(agreed), size=size, p=weights / weights.sum())


Selector = Callable[[System], np.ndarray]


def shifts(systems: list[System]) -> dict[str, Selector]:
    topics = ["world", "sports", "business", "scitech"]
    worst = min(range(4), key=lambda k: statistics.mean(s.agreed[s.gold == k].mean() for s in systems))
    return {
        f"topic {topics[worst]!r} only": lambda s: s.gold == worst,
        f"ambiguous only (teacher top < {AMBIGUOUS})": lambda s: s.teacher_top < AMBIGUOUS,
    }


def shifted(systems: list[System], args: argparse.Namespace) -> None:
    per_split = max(1, args.shifted_streams // len(systems))
    print(f"\nshifted: {per_split * len(systems)} streams per shift; {args.before} routed items "
          f"unshifted, then the shift for up to {args.audited} audited items; audit share {args.share}")
    for shift, select in shifts(systems).items():
        agreement = statistics.mean(s.agreed[select(s)].mean() for s in systems)
        ungated = statistics.mean(s.agreed_ungated[select(s)].mean() for s in systems)
        print(f"  {shift}: agreement after the shift {agreement:.4f} with the gate, {ungated:.4f} without")
        for gated in (True, False):
            runs = [_run(s, select(s), gated, args, np.random.default_rng([args.seed, i, k]))
                    for i, s in enumerate(systems) for k in range(per_split)]
            for name in alarms(args):
                _print_runs(f"{name}, {'with' if gated else 'without'} the gate", [r[name] for r in runs])


@dataclass(frozen=True)
class Run:
    early: bool  # alarmed before the shift
    audited: int | None  # audited items after the shift until the alarm (None: never)
    routed: int | None
    served_wrong: int  # disagreements served after the shift until the alarm (or the stream's end)


def _run(system: System, selected: np.ndarray, gated: bool, args: argparse.Namespace,
         rng: np.random.Generator) -> dict[str, Run]:
    """One stream, every alarm on it: routed items, the audit's draws, then each alarm's time."""
    agreed = system.agreed if gated else system.agreed_ungated
    after = int(args.audited / args.share * 1.5)
    picks = np.concatenate([rng.integers(len(agreed), size=args.before),
                            rng.choice(np.flatnonzero(selected), size=after)])
    audited_at = np.flatnonzero(rng.random(len(picks)) < args.share)
    outcomes = agreed[picks]
    first_after = int(np.searchsorted(audited_at, args.before))
    stream = outcomes[audited_at][:first_after + args.audited]
    runs = {}
    for name, alarm in alarms(args).items():
        at = alarm(stream)
        if at is not None and at <= first_after:
            runs[name] = Run(True, None, None, 0)
            continue
        end = len(picks) if at is None else int(audited_at[at - 1]) + 1
        wrong = int((~outcomes[args.before:end]).sum())
        runs[name] = Run(False, None if at is None else at - first_after,
                         None if at is None else end - args.before, wrong)
    return runs


def _print_runs(name: str, runs: list[Run]) -> None:
    caught = [r for r in runs if r.audited is not None]
    early = sum(r.early for r in runs)
    if not caught:
        print(f"    {name:<58} caught 0/{len(runs)} (alarmed before the shift: {early})")
        return
    audited = statistics.median(r.audited or 0 for r in caught)
    routed = statistics.median(r.routed or 0 for r in caught)
    print(f"    {name:<58} caught {len(caught)}/{len(runs)}, median {audited:.0f} audited = {routed:.0f} "
          f"routed items, disagreements served before it: median "
          f"{statistics.median(r.served_wrong for r in caught):.0f} (alarmed before the shift: {early})")


def main() -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("--splits", type=int, default=10)
    parser.add_argument("--streams", type=int, default=200, help="no-shift streams in all")
    parser.add_argument("--shifted-streams", type=int, default=100, help="shifted streams per shift")
    parser.add_argument("--audited", type=int, default=5000, help="audited items per stream")
    parser.add_argument("--before", type=int, default=20000, help="routed items before a shift")
    parser.add_argument("--share", type=float, default=0.02, help="the audit share")
    parser.add_argument("--target", type=float, default=0.98)
    parser.add_argument("--delta", type=float, default=0.05)
    parser.add_argument("--window", type=int, default=500)
    parser.add_argument("--every", type=int, default=50)
    parser.add_argument("--restart-every", type=int, nargs="*", default=[], metavar="N",
                        help="also the betting alarm started afresh every N audited items (one row each)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    items = load_items(Path(LABELS), task_named("ag_news"), EmbeddingCache(CACHE_DIR, Encoder()))
    rng = np.random.default_rng(args.seed)
    systems = [system_of(items, rng.permutation(len(items.ids)), args.target, args.delta)
               for _ in range(args.splits)]
    print(f"{len(items.ids)} AG News items with Qwen2.5-Coder-1.5B labels; {args.splits} splits; target "
          f"{args.target}, delta {args.delta} (the alarm's level)")
    no_shift(systems, args)
    shifted(systems, args)


if __name__ == "__main__":
    main()
