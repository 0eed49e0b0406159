"""The promotion gate on AG News: real heads, the real teacher's answers, known population gaps.

``bench.promotion_gate`` measures the gate on synthetic curves; this measures it on replays of
real data. A bundle here is the library's head (MiniLM vectors with hashed word n-grams beside
them, as ``cascade train`` fits it) fitted to the committed Qwen2.5-Coder-1.5B answers of a
training set drawn from a pool (the first ``--pool`` items of the exports): more training items
make a better bundle. Its population is every item outside the pool; the share it keeps there at
the target (``common.hindsight``: the most one threshold on the margin keeps with agreement at
least the target, chosen on the whole population) is the truth the gate should find.

Pairs (serving, candidate), by their training sets: the candidate trained on more items (better),
on as many other items (about equal), or on fewer (worse); each pair's population gap is printed.
Each run draws ``--certifying`` + ``--evaluation`` items from the population without replacement
and applies three gates to the same draw. The library's ("band", as ``distill.loop.promote`` runs
it): both bundles certified on all the drawn items at half the first attempt's delta, and
``gate.compare`` over ``gate.band``'s targets on the same items. The one before it ("band,
certifying part"): certified on the certifying items alone, the rule weighing all. The one before
that ("plug-in, certifying part"): the same at the target alone. ``--evaluation 0``: every gate
on the certifying items alone. A promoted certificate fails where the cascade at its threshold
agrees with the teacher on less than the target of the whole population (the items it keeps
disagreeing, those it sends up answered by the teacher); the population share served after the
gate is what the certified threshold of the bundle serving then keeps of the population.

``--chain``: two gates in a row on one growing holdout, as ``cascade loop`` runs them. Bundles A, B
and C (CHAINS); gate 1 weighs B against A on the first draw; gate 2 weighs C against whichever
serves then, on the same items and ``--fresh`` new ones of each part (the audits that arrived
between); each gate certifies on every item it weighs, as the library does. Gate 2's attempt is
counted as ``distill.loop.promote`` counts it, restarting at a promotion ("reset": attempt 1 after
a promotion, 2 after a refusal), or never restarting ("global": always 2, every gate on the holdout
budgeted together). Reported: how often the certificate serving after gate 2 fails, and how often
either of the two served after the gates does: a promotion chose its bundle on items the next gate
certifies on again.

``--chain --refresh``: the same chains, with A serving a certificate a gate made (at half the first
attempt's delta, on items of its own drawn apart, as its promotion would have), and each gate that
keeps the candidate aside then refreshing the bundle kept serving as ``distill.loop.promote`` does:
the gate's certificate of it replaces its own where it keeps more of the items the gate weighed
("keeps more"), against serving its own on ("never"). Reported: how often any certificate served
along the chain fails (A's own, after gate 1, after gate 2), and the population share served after
each gate.

    PYTHONPATH=. .venv/bin/python -m bench.gate_replay --runs 500
    PYTHONPATH=. .venv/bin/python -m bench.gate_replay --runs 500 --evaluation 0
    PYTHONPATH=. .venv/bin/python -m bench.gate_replay --runs 500 --certifying 300 --evaluation 300
    PYTHONPATH=. .venv/bin/python -m bench.gate_replay --runs 1000 --chain --certifying 400 \
        --evaluation 400 --fresh 25
    PYTHONPATH=. .venv/bin/python -m bench.gate_replay --runs 1000 --chain --refresh
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import numpy as np

from bench.common import (
    CACHE_DIR,
    DELTA,
    FIRST,
    SECOND,
    TARGET,
    Items,
    Parts,
    argument_parser,
    head_probabilities,
    hindsight,
    load_items,
    markdown,
    task_named,
)
from cascade.encoder.onnx_encoder import EmbeddingCache, Encoder
from cascade.thresholds import CERTIFIED_SCORE, threshold_score
from distill.calibration.maths import threshold_for_agreement
from distill.loop.gate import Question, band, certificate_delta, compare

SOURCE = "teacher, soft"
PAIRS = {"better (500 -> 1,000 items)": ((0, 500), (0, 1000)),
         "better (700 -> 2,000 items)": ((0, 700), (0, 2000)),
         "about equal (1,000 other items)": ((0, 1000), (1000, 2000)),
         "worse (1,000 -> 500 items)": ((0, 1000), (0, 500))}
"""Scenario -> the (start, end) of the serving and the candidate bundle's training sets in the pool:
a retrain on more of the same traffic, on as much other traffic, or on less. With the default
seed their population shares differ by about +6, +5, -2 and -6 points."""
CHAINS = {"growing (500 -> 1,000 -> 2,000 items)": ((0, 500), (0, 1000), (0, 2000)),
          "about equal (three other 1,000 items)": ((0, 1000), (1000, 2000), (2000, 3000))}
"""Chain -> the training sets of bundles A, B and C: each retrain on more traffic, or on as much
other traffic (a promotion then chosen on noise, the case where reusing its items matters most)."""


class Bundle:
    """One head's margin and agreement with the teacher on every population item."""

    def __init__(self, items: Items, train: np.ndarray, population: np.ndarray) -> None:
        parts = Parts(train, population, population[:1])
        probabilities, _ = head_probabilities(items, items.emb, SOURCE, parts)
        self.score = threshold_score(probabilities, CERTIFIED_SCORE)
        self.correct = probabilities.argmax(axis=1) == items.truth[SOURCE][population]
        self.share = hindsight(self.score, self.correct, TARGET)

    def fails(self, threshold: float | None) -> bool:
        """Whether the cascade keeping the margin >= ``threshold`` (and sending the rest to the
        teacher) agrees with the teacher on less than the target of the whole population."""
        if threshold is None:
            return False
        return bool(np.mean((self.score >= threshold) & ~self.correct) > 1 - TARGET)


@dataclass(frozen=True)
class Gated:
    """One gate: promoted, and the thresholds it certified for (serving, candidate)."""

    promoted: bool
    thresholds: tuple[float | None, float | None]


RULES = ("band", "band, certifying part", "plug-in, certifying part")
"""The library's rule (plug-in shares over ``gate.band``, both bundles certified on every item
weighed), the one before it (certified on the certifying part alone) and the one before that (at
the target alone)."""


def gate(rng: np.random.Generator, pair: tuple[Bundle, Bundle], certifying: np.ndarray, weighed: np.ndarray,
         attempt: int, resamples: int, rule: str = "band") -> Gated:
    """``distill.loop.promote``'s gate on population items: both certified on ``certifying`` at
    half attempt ``attempt``'s delta, the rule applied to ``weighed``."""
    level = certificate_delta(DELTA, attempt)
    targets = band(TARGET, len(certifying), level) if rule == "band" else (TARGET,)
    thresholds = tuple(threshold_for_agreement(b.score[certifying], b.correct[certifying], TARGET, level)
                       .threshold for b in pair)
    items = np.arange(len(weighed))
    serving, candidate = ([Question(items, b.score[weighed], b.correct[weighed])] for b in pair)
    promoted = compare(serving, candidate, len(weighed), targets, resamples=resamples,
                       seed=int(rng.integers(2 ** 31))).promotes
    return Gated(promoted, (thresholds[0], thresholds[1]))


def one_run(rng: np.random.Generator, pair: tuple[Bundle, Bundle], certifying: int, evaluation: int,
            resamples: int) -> dict[str, tuple[bool, bool, float]]:
    """Per rule: promoted, whether the bundle serving after the gate fails its certificate, and the
    population share its certified threshold keeps."""
    drawn = rng.choice(len(pair[0].score), certifying + evaluation, replace=False)
    out = {}
    for rule in RULES:
        certified_on = drawn[:certifying] if rule.endswith("certifying part") else drawn
        one = gate(rng, pair, certified_on, drawn, 1, resamples, rule.split(",")[0])
        chosen = pair[int(one.promoted)]
        threshold = one.thresholds[int(one.promoted)]
        out[rule] = (one.promoted, chosen.fails(threshold),
                     0.0 if threshold is None else float(np.mean(chosen.score >= threshold)))
    return out


def chain_run(rng: np.random.Generator, bundles: tuple[Bundle, Bundle, Bundle], certifying: int,
              evaluation: int, fresh: int, resamples: int) -> dict[str, tuple[bool, bool, bool]]:
    """Per counting scheme: (gate 2 promoted, the certificate serving after gate 2 fails, either
    served certificate fails)."""
    a, b, c = bundles
    drawn = rng.choice(len(a.score), certifying + evaluation + 2 * fresh, replace=False)
    first = drawn[:certifying + evaluation]
    one = gate(rng, (a, b), first, first, 1, resamples)
    serving, threshold = (b, one.thresholds[1]) if one.promoted else (a, one.thresholds[0])
    fails_one = serving.fails(threshold)
    out = {}
    for scheme in ("reset", "global"):
        attempt = 1 if scheme == "reset" and one.promoted else 2
        two = gate(rng, (serving, c), drawn, drawn, attempt, resamples)
        fails_two = c.fails(two.thresholds[1]) if two.promoted else fails_one
        out[scheme] = (two.promoted, fails_two, fails_one or fails_two)
    return out


Served = tuple[Bundle, float | None]
"""A bundle and the threshold it serves."""


def refresh_run(rng: np.random.Generator, bundles: tuple[Bundle, Bundle, Bundle], parts: tuple[int, int, int],
                fresh: int, resamples: int) -> dict[str, tuple[bool, float, float]]:
    """Per refresh rule ("never", "keeps more"): (any certificate served along the chain fails, the
    population share served after gate 1, after gate 2). ``parts``: the items A's own certificate
    rests on, and gate 1's certifying and evaluation items."""
    a, b, c = bundles
    own_size, size = parts[0], parts[1] + parts[2]
    drawn = rng.choice(len(a.score), own_size + size + 2 * fresh, replace=False)
    own, first, both = drawn[:own_size], drawn[own_size:own_size + size], drawn[own_size:]
    old = threshold_for_agreement(a.score[own], a.correct[own], TARGET, certificate_delta(DELTA, 1)).threshold
    one = gate(rng, (a, b), first, first, 1, resamples)
    kept_serving = b if one.promoted else a  # whichever refresh rule: the same bundle, the same gate 2
    two = gate(rng, (kept_serving, c), both, both, 1 if one.promoted else 2, resamples)
    out = {}
    for rule in ("never", "keeps more"):
        after_one = (b, one.thresholds[1]) if one.promoted else kept((a, old), one.thresholds[0], first, rule)
        after_two = (c, two.thresholds[1]) if two.promoted else kept(after_one, two.thresholds[0], both, rule)
        served = [(a, old), after_one, after_two]
        out[rule] = (any(bundle.fails(t) for bundle, t in served), share(after_one), share(after_two))
    return out


def kept(serving: Served, fresh: float | None, weighed: np.ndarray, rule: str) -> Served:
    """The bundle kept serving after a gate: its own threshold, or under "keeps more" the gate's
    certificate of it where that keeps more of the items weighed."""
    bundle, own = serving
    if rule == "keeps more" and fresh is not None and \
            (own is None or np.mean(bundle.score[weighed] >= fresh) > np.mean(bundle.score[weighed] >= own)):
        return bundle, fresh
    return serving


def share(served: Served) -> float:
    """The population share a served threshold keeps."""
    bundle, threshold = served
    return 0.0 if threshold is None else float(np.mean(bundle.score >= threshold))


def refreshes(args: argparse.Namespace, items: Items, pool: np.ndarray, population: np.ndarray) -> None:
    """The table of ``--chain --refresh``."""
    rng = np.random.default_rng(args.seed + 3)
    rows = []
    for name, spans in CHAINS.items():
        bundles = tuple(Bundle(items, pool[start:end], population) for start, end in spans)
        parts = (args.own or args.certifying + args.evaluation, args.certifying, args.evaluation)
        runs = [refresh_run(rng, bundles, parts, args.fresh, args.resamples)  # type: ignore[arg-type]
                for _ in range(args.runs)]
        for rule in ("never", "keeps more"):
            fails, one, two = (np.mean([run[rule][k] for run in runs]) for k in range(3))
            rows.append([name, " / ".join(f"{b.share:.1%}" for b in bundles), rule, f"{fails:.1%}",
                         f"{one:.1%}", f"{two:.1%}"])
        print(f"{name}: done", flush=True)
    print(f"AG News, {len(population)} population items, target {TARGET}, delta {DELTA}, A certified on "
          f"{parts[0]} items of its own, gate 1 on {args.certifying} certifying + {args.evaluation} "
          f"evaluation items, gate 2 on those and {args.fresh} new of each, {args.runs} runs, "
          f"{args.resamples} resamples")
    print(markdown(["chain", "population share kept (A / B / C)", "refresh", "any served certificate fails",
                    "population share served after gate 1", "after gate 2"], rows))


def chains(args: argparse.Namespace, items: Items, pool: np.ndarray, population: np.ndarray) -> None:
    """The table of ``--chain``."""
    rng = np.random.default_rng(args.seed + 2)
    rows = []
    for name, spans in CHAINS.items():
        a, b, c = (Bundle(items, pool[start:end], population) for start, end in spans)
        bundles = (a, b, c)
        runs = [chain_run(rng, bundles, args.certifying, args.evaluation, args.fresh, args.resamples)
                for _ in range(args.runs)]
        shares = " / ".join(f"{b.share:.1%}" for b in bundles)
        for scheme in ("reset", "global"):
            promoted, after, either = (np.mean([run[scheme][k] for run in runs]) for k in range(3))
            rows.append([name, shares, scheme, f"{promoted:.1%}", f"{after:.1%}", f"{either:.1%}"])
        print(f"{name}: done", flush=True)
    print(f"AG News, {len(population)} population items, target {TARGET}, delta {DELTA}, gate 1 on "
          f"{args.certifying} certifying + {args.evaluation} evaluation items, gate 2 on those and "
          f"{args.fresh} new of each, {args.runs} runs, {args.resamples} resamples")
    print(markdown(["chain", "population share kept (A / B / C)", "gate 2's attempt", "gate 2 promoted",
                    "serving after gate 2 fails", "either served certificate fails"], rows))


def main() -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("--runs", type=int, default=500)
    parser.add_argument("--pool", type=int, default=3000, help="items the training sets are drawn from")
    parser.add_argument("--certifying", type=int, default=1000)
    parser.add_argument("--evaluation", type=int, default=1000)
    parser.add_argument("--resamples", type=int, default=200,
                        help="bootstrap resamples per gate (the library's default is 1,000)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--chain", action="store_true", help="two gates in a row on one holdout (CHAINS)")
    parser.add_argument("--refresh", action="store_true",
                        help="with --chain: the refresh of a gate-made certificate, against none")
    parser.add_argument("--own", type=int, default=0,
                        help="with --refresh: items A's own certificate rests on (0: as many as gate 1's)")
    parser.add_argument("--fresh", type=int, default=25,
                        help="with --chain: new certifying and evaluation items each before gate 2")
    args = parser.parse_args()
    items = load_items([FIRST, SECOND], task_named("ag_news"), EmbeddingCache(CACHE_DIR, Encoder()))
    order = np.random.default_rng(args.seed).permutation(len(items.ids))
    pool, population = order[:args.pool], order[args.pool:]
    if args.chain:
        (refreshes if args.refresh else chains)(args, items, pool, population)
        return
    rng = np.random.default_rng(args.seed + 1)
    rows = []
    for name, spans in PAIRS.items():
        pair = tuple(Bundle(items, pool[start:end], population) for start, end in spans)
        runs = [one_run(rng, pair, args.certifying, args.evaluation, args.resamples)  # type: ignore[arg-type]
                for _ in range(args.runs)]
        for rule in RULES:
            outcomes = [run[rule] for run in runs]
            promoted = [fails for p, fails, _ in outcomes if p]
            rows.append([name, f"{pair[0].share:.1%} / {pair[1].share:.1%}",
                         f"{pair[1].share - pair[0].share:+.1%}", rule,
                         f"{np.mean([p for p, _, _ in outcomes]):.1%}",
                         f"{np.mean(promoted):.1%} of {len(promoted)}" if promoted else "-",
                         f"{np.mean([fails for _, fails, _ in outcomes]):.1%}",
                         f"{np.mean([served for _, _, served in outcomes]):.1%}"])
        print(f"{name}: done", flush=True)
    print(f"AG News, {len(population)} population items, target {TARGET}, delta {DELTA} (each certificate at "
          f"{certificate_delta(DELTA, 1):.4f}), {args.certifying} certifying + {args.evaluation} evaluation "
          f"items a run, {args.runs} runs, {args.resamples} resamples")
    print(markdown(["candidate", "population share kept (serving / candidate)", "gap", "rule",
                    "promoted", "cert fails given promoted", "serving after the gate fails",
                    "population share served after the gate"], rows))


if __name__ == "__main__":
    main()
