"""One certificate for the chain against the split budget: encoder -> middle tier -> teacher.

The split budget (``cascade calibrate`` before issue 34) certifies each of the m cheap tiers on
all calibration items at agreement 1 - (1 - target) / m and level delta / m; the joint certificate
(``distill.calibration.joint``) certifies the thresholds of all of them together against the
system's agreement at the full target and delta: a Learn-then-Test fixed-sequence test along a
path of threshold vectors built on the calibration items' temperature part (30%, by a hash of
the id) and tested on the rest. The encoder alone in front of the teacher is shown beside them
(one cheap tier: nothing to split).

The middle tier is, with ``--middle``, a cheaper GGUF's readout from its committed export (the
0.5B on the first 4,000 items), or with ``--mid-layer L`` the teacher's own layer-L state read by
the library's head (``cascade train --mid-layer``) on ``--items`` items of the export, the states
computed by bench/mid_layer.py's reader and cached under ~/.cache/cascade-bench/mid_layer.

On each of ``--resplits`` random 50/25/25 re-splits (as bench/goals.py) the heads are fitted on
the train part, thresholds certified on the calibration part at ``--target`` / delta 0.05, and
everything is measured on the evaluation part: the shares kept, the realised agreement (a
certificate "fails" on a re-split whose agreement is below the target) and the cost. Costs are
measured CPU seconds per item of each model on ``--cost-items`` items, one thread each,
interleaved (bench/goals.py, bench/mid_layer.py); a cascade's cost is encoder + share reaching
the middle x middle + share escalated x teacher, over the teacher alone. The last column is the
cost where calibration's payoff rule takes the middle tier out (the encoder keeps its certified
threshold, everything else goes to the teacher: the certificate still holds).

    PYTHONPATH=. .venv/bin/python -m bench.joint_chain \\
        --labels bench/labels/ag_news.qwen2.5-coder-1.5b.jsonl \\
        --middle bench/labels/ag_news.qwen2.5-coder-0.5b.jsonl --resplits 10
    OPENBLAS_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python -m bench.joint_chain \\
        --labels bench/labels/ag_news.qwen2.5-coder-1.5b.jsonl --mid-layer 19 --items 1200 --resplits 10
"""

from __future__ import annotations

import argparse
import hashlib
from pathlib import Path

import numpy as np

from bench.common import (
    CACHE_DIR,
    DELTA,
    TARGET,
    TEACHER,
    CascadeOutcome,
    Items,
    Parts,
    argument_parser,
    cascade_outcome,
    cell,
    head_probabilities,
    load_items,
    markdown,
    measured_seconds,
    parts_of,
    task_named,
)
from cascade.encoder.onnx_encoder import EmbeddingCache, Encoder
from cascade.thresholds import CERTIFIED_SCORE, threshold_score
from distill.calibration.fits import in_temperature_part
from distill.calibration.joint import chain_thresholds

SOURCE = "teacher, soft"
Pair = tuple[np.ndarray, np.ndarray]
"""A tier's probabilities on the calibration and evaluation parts."""


def joint_outcome(tiers: list[Pair], truth: np.ndarray, parts: Parts, ids: list[str], target: float
                  ) -> CascadeOutcome:
    """The chain certified jointly on the calibration part, measured on the evaluation part."""
    cal_truth, ev_truth = truth[parts.calibration], truth[parts.evaluation]
    path = np.asarray([in_temperature_part(ids[i]) for i in parts.calibration])
    result = chain_thresholds([threshold_score(cal, CERTIFIED_SCORE) for cal, _ in tiers],
                              [cal.argmax(axis=1) == cal_truth for cal, _ in tiers], path, target, DELTA)
    reaching = np.ones(len(ev_truth), dtype=bool)
    kept, wrong = [], 0
    for (_, ev), threshold in zip(tiers, result.thresholds, strict=True):
        bar = np.inf if threshold is None else threshold
        keep = reaching & (threshold_score(ev, CERTIFIED_SCORE) >= bar)
        kept.append(float(keep.mean()))
        wrong += int((keep & (ev.argmax(axis=1) != ev_truth)).sum())
        reaching &= ~keep
    return CascadeOutcome(kept[0], kept[1], 1 - wrong / len(ev_truth), 1 - kept[0], 0.0)


def middle_export(path: Path, items: Items) -> tuple[Items, np.ndarray]:
    """The items the middle GGUF's export labels too (in the teacher's order) and its probabilities."""
    from bench.common import read_export

    ids, probs = read_export(path, task_named("ag_news"))
    row = {item: i for i, item in enumerate(ids)}
    keep = np.asarray([i for i, item in enumerate(items.ids) if item in row])
    subset = Items([items.ids[i] for i in keep], [items.texts[i] for i in keep], items.emb[keep],
                   {k: v[keep] for k, v in items.targets.items()},
                   {k: v[keep] for k, v in items.truth.items()})
    return subset, probs[[row[item] for item in subset.ids]]


def mid_layer_states(items: Items, layer: int, count: int, threads: int, labels: Path
                     ) -> tuple[Items, np.ndarray]:
    """``count`` items of the export (bench/mid_layer.py's seeded sample) and their layer-L states."""
    from bench.mid_layer import STATES_DIR, collect, sample

    subset = sample(items, count, 0)
    digest = hashlib.sha256(labels.read_bytes()).hexdigest()[:12]
    cache = STATES_DIR / f"ag_news-{digest}-{layer}.npz"
    states = collect(subset, task_named("ag_news"), [layer], threads, cache)
    return subset, states[layer]


def main() -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("--labels", type=Path, nargs="+", required=True, metavar="TEACHER.jsonl")
    middle = parser.add_mutually_exclusive_group(required=True)
    middle.add_argument("--middle", type=Path, metavar="MIDDLE.jsonl",
                        help="the 0.5B's export on the same items")
    middle.add_argument("--mid-layer", type=int, metavar="L",
                        help="the teacher's layer-L state as the middle tier")
    parser.add_argument("--items", type=int, default=1200, help="items for --mid-layer (default 1200)")
    parser.add_argument("--resplits", type=int, default=10)
    parser.add_argument("--target", type=float, default=TARGET)
    parser.add_argument("--threads", type=int, default=2, help="llama.cpp threads while reading states")
    parser.add_argument("--cost-items", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    every = load_items(args.labels, task_named("ag_news"), EmbeddingCache(CACHE_DIR, Encoder()))
    if args.middle is not None:
        items, middle_probs = middle_export(args.middle, every)
        name = "0.5B"
    else:
        items, states = mid_layer_states(every, args.mid_layer, args.items, args.threads, args.labels[0])
        name = f"L{args.mid_layer}"
    print(f"{len(items.ids)} AG News items labelled by {TEACHER}; middle tier {name}; target {args.target}, "
          f"delta {DELTA}; {args.resplits} random 50/25/25 re-splits (seed {args.seed})", flush=True)
    truth = items.truth[SOURCE]
    rng = np.random.default_rng(args.seed)
    runs: dict[str, list[CascadeOutcome]] = {}
    for number in range(1, args.resplits + 1):
        parts = parts_of(rng.permutation(len(items.ids)))
        encoder = head_probabilities(items, items.emb, SOURCE, parts)
        if args.middle is not None:
            mid = (middle_probs[parts.calibration], middle_probs[parts.evaluation])
        else:
            from bench.mid_layer import head_split

            mid = head_split(states, items, parts)
        runs.setdefault("encoder -> teacher", []).append(
            cascade_outcome(encoder, None, truth, parts, CERTIFIED_SCORE, args.target))
        runs.setdefault(f"encoder -> {name} -> teacher, split budget", []).append(
            cascade_outcome(encoder, mid, truth, parts, CERTIFIED_SCORE, args.target))
        runs.setdefault(f"encoder -> {name} -> teacher, joint", []).append(
            joint_outcome([encoder, mid], truth, parts, items.ids, args.target))
        print(f"split {number}/{args.resplits} done", flush=True)
    seconds = _seconds(items, args)
    _report(runs, seconds, args.target)


def _seconds(items: Items, args: argparse.Namespace) -> dict[str, float]:
    """CPU seconds per item: teacher, middle tier, frozen encoder."""
    if args.cost_items < 1:
        raise SystemExit("--cost-items must be at least 1: costs are measured")
    if args.middle is not None:
        spent = measured_seconds(items, task_named("ag_news"), args.cost_items, True, None)
        return {"teacher": spent["teacher"], "middle": spent["middle"],
                "encoder": spent["encoder (frozen, shipped)"]}
    from bench.mid_layer import measured_seconds as layer_seconds

    spent = layer_seconds(items, task_named("ag_news"), [args.mid_layer], args.cost_items, None)
    return {"teacher": spent["teacher"], "middle": spent[str(args.mid_layer)], "encoder": spent["frozen"]}


def _report(runs: dict[str, list[CascadeOutcome]], seconds: dict[str, float], target: float) -> None:
    teacher = seconds["teacher"]
    print("\nmeasured CPU seconds per item, one thread each: "
          + ", ".join(f"{name} {value:.4f}" for name, value in seconds.items()))
    rows = []
    for name, outcomes in runs.items():
        costs = [(seconds["encoder"] + o.reach_middle * seconds["middle"]) / teacher + 1 - o.cheap
                 for o in outcomes]
        alone = [seconds["encoder"] / teacher + 1 - o.encoder for o in outcomes]
        agreement = [o.agreement for o in outcomes]
        rows.append([name, cell([o.encoder for o in outcomes], ".1%"),
                     cell([o.middle for o in outcomes], ".1%"),
                     cell([o.cheap for o in outcomes], ".1%"), cell(agreement, ".4f"),
                     f"{sum(a < target for a in agreement)}/{len(outcomes)}", cell(costs, ".3f", max(costs)),
                     cell(alone, ".3f", max(alone))])
    print(markdown(["cascade, certificate", "encoder keeps: mean (worst)", "middle keeps: mean (worst)",
                    "cheap tiers keep: mean (worst)", "realised agreement: mean (worst)", "below target",
                    "cost / teacher alone: mean (worst)", "cost with the middle taken out: mean (worst)"],
                   rows))


if __name__ == "__main__":
    main()
