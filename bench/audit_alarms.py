"""Drift alarms on an audit stream: the betting alarm against a Clopper-Pearson test re-run at
every look, for false alarms at the target and for how soon a real drop is caught.

Simulated streams of audited outcomes (True: the cascade agreed with the teacher), seeded. Each
alarm watches "agreement >= target" at level alpha:

- ``betting``: ``cascade.audit.alarms.AgreementMonitor`` (anytime-valid by Ville's inequality),
  with its online-Newton stakes and with the plug-in ones;
- ``Clopper-Pearson, all so far``: the one-sided exact upper bound on all items audited so far,
  tested every ``--every`` items, alarming once it falls below the target;
- ``Clopper-Pearson, window``: the same on the last ``--window`` items (as peers re-test a fixed
  window).

Printed: the share of streams that raised a (false) alarm when agreement is exactly the target,
and, for streams whose agreement dropped, the share caught and the median items to the alarm.
The alarms are bench.common's, which bench.drift_streams runs on real traffic.

    PYTHONPATH=. .venv/bin/python -m bench.audit_alarms --streams 200 --items 3000
"""

from __future__ import annotations

import argparse
import statistics

import numpy as np

from bench.common import Alarm, argument_parser, betting, clopper_pearson


def main() -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("--streams", type=int, default=200)
    parser.add_argument("--items", type=int, default=3000)
    parser.add_argument("--target", type=float, default=0.95)
    parser.add_argument("--alpha", type=float, default=0.05)
    parser.add_argument("--every", type=int, default=50, help="items between Clopper-Pearson looks")
    parser.add_argument("--window", type=int, default=500)
    parser.add_argument("--drops", type=float, nargs="+", default=[0.93, 0.90])
    args = parser.parse_args()
    alarms = {
        "betting, ONS stakes (anytime-valid)": betting(args.target, args.alpha),
        "betting, plug-in stakes (anytime-valid)": betting(args.target, args.alpha, "plug-in"),
        "Clopper-Pearson, all so far": clopper_pearson(args.target, args.alpha, args.every, None),
        f"Clopper-Pearson, last {args.window}": clopper_pearson(args.target, args.alpha, args.every,
                                                                args.window),
    }
    print(f"{args.streams} streams of {args.items} audited items, target {args.target}, alpha "
          f"{args.alpha}; Clopper-Pearson looked at every {args.every} items")
    header = f"{'alarm':40} {'false alarms at target':>23}"
    header += "".join(f" {f'caught at {drop}':>14} {'median items':>13}" for drop in args.drops)
    print(header)
    for name, alarm in alarms.items():
        row = f"{name:40} {_share(alarm, args.target, args):>23.1%}"
        for drop in args.drops:
            fired = _fired(alarm, drop, args)
            caught = [at for at in fired if at is not None]
            median = statistics.median(caught) if caught else float("nan")
            row += f" {len(caught) / len(fired):>14.1%} {median:>13.0f}"
        print(row)


def _fired(alarm: Alarm, agreement: float, args: argparse.Namespace) -> list[int | None]:
    rng = np.random.default_rng(int(agreement * 1000))
    return [alarm(rng.random(args.items) < agreement) for _ in range(args.streams)]


def _share(alarm: Alarm, agreement: float, args: argparse.Namespace) -> float:
    return sum(at is not None for at in _fired(alarm, agreement, args)) / args.streams


if __name__ == "__main__":
    main()
