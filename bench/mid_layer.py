"""The mid-layer tier on the real teacher: at which layer L, if any, it pays on a labelled set.

The teacher is Qwen2.5-Coder-1.5B (28 blocks); its labels are the committed export. For ``--items``
items of the export (a seeded sample), the layer-L state at the answer position is read for every
``--layers`` L in ONE pass per item, stopped after the deepest (``cascade.readout.layer_scorer``); the
states are cached under ~/.cache/cascade-bench/mid_layer, so an interrupted run resumes.

Then, on each of ``--resplits`` random 50/25/25 splits (as bench/goals.py):
- the head (the library's soft-label softmax on the normalized state, trained on the train part's
  teacher probabilities) and the logit lens (no training): argmax agreement with the teacher on
  the evaluation part;
- the mid-layer tier alone: the share it keeps under a threshold certified on the calibration part
  at ``--target`` / delta 0.05, as ``cascade calibrate`` certifies;
- the cascade frozen encoder -> mid-layer -> teacher against encoder -> teacher, thresholds
  certified as the library does for two cheap tiers (bench.common's ``cascade_outcome``, as
  bench/goals.py runs it); with ``--finetune``, the same two cascades again with MiniLM fine-tuned
  on each split's train part in front (bench.common's ``finetuned``, cached per split: minutes
  each).

Run it with ``OPENBLAS_NUM_THREADS=1`` beside other jobs: numpy's BLAS threads fighting them for
the cores made each head's fit 20x slower here.

Costs are measured, not priced: CPU seconds per item of the teacher, of the tier at each L and of
the encoder on ``--cost-items`` items, one thread each, interleaved item by item in this process.
A cascade's cost per item is encoder + share reaching the tier x tier(L) + share escalated x
teacher (an escalation reruns the whole teacher: the tier's work is not reused), over the teacher.

    PYTHONPATH=. .venv/bin/python -m bench.mid_layer --task ag_news \\
        --labels bench/labels/ag_news.qwen2.5-coder-1.5b.jsonl --items 800
"""

from __future__ import annotations

import hashlib
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
from tqdm import tqdm

from bench.common import (
    CACHE_DIR,
    DELTA,
    FINETUNED_DIR,
    TASK_NAMES,
    TEACHER,
    CascadeOutcome,
    Items,
    Parts,
    Task,
    argument_parser,
    cascade_outcome,
    cell,
    finetuned,
    head_probabilities,
    interleaved,
    labels_digest,
    load_items,
    markdown,
    parts_of,
    task_named,
)
from cascade.encoder.onnx_encoder import EmbeddingCache, Encoder, EncoderFiles, default_encoder_files
from cascade.questions import DecisionRequest, parse_request
from cascade.readout.layer_scorer import LayerScorer, LetterLens, normalized
from cascade.readout.scorer import Scorer
from cascade.thresholds import CERTIFIED_SCORE
from distill.labelling.teachers import teacher_path
from distill.training.finetune import FinetuneConfig
from distill.training.mid_layer import candidate_layers, fit_head

STATES_DIR = CACHE_DIR / "mid_layer"
SOURCE = "teacher, soft"
brief = partial(cell, word="")
"""``mean (worst)``, the word left out: the table's header says it."""


@dataclass(frozen=True)
class LayerRun:
    """One layer on one split."""

    head_agreement: float
    lens_agreement: float
    alone: CascadeOutcome  # the tier alone, certified (its ``encoder`` field: the share it keeps)
    cascades: dict[str, CascadeOutcome]  # encoder name -> encoder -> tier -> teacher


@dataclass(frozen=True)
class Split:
    """One split: per encoder, encoder -> teacher; per layer, the tier's outcomes."""

    baselines: dict[str, CascadeOutcome]
    layers: dict[int, LayerRun]


def sample(items: Items, count: int, seed: int) -> Items:
    """``count`` items of the export, a seeded sample in a fixed order."""
    rows = np.sort(np.random.default_rng(seed).permutation(len(items.ids))[:count])
    return Items([items.ids[i] for i in rows], [items.texts[i] for i in rows], items.emb[rows],
                 {k: v[rows] for k, v in items.targets.items()}, {k: v[rows] for k, v in items.truth.items()})


def request_of(task: Task, text: str) -> DecisionRequest:
    return parse_request({"state": text, "questions": task.questions})


def collect(items: Items, task: Task, layers: list[int], threads: int, cache: Path) -> dict[int, np.ndarray]:
    """Per layer, (items, n_embd) states at the answer position. Every state file of this task and
    labels file is read back, so a run with more items or fewer layers reads only what is missing
    (into ``cache``); an interrupted run resumes."""
    done: dict[str, np.ndarray] = {}
    for path in sorted(cache.parent.glob(cache.name.rsplit("-", 1)[0] + "-*.npz")):
        if ".partial" not in path.name:
            done.update(_load(path))
    mine = _load(cache)
    todo = [(i, text) for i, text in zip(items.ids, items.texts, strict=True)
            if any(f"{i}/{layer}" not in done for layer in layers)]
    if todo:
        scorer = LayerScorer(teacher_path(TEACHER), layers, n_ctx=2048, max_branches=1, n_threads=threads)
        (qid,) = task.questions
        try:
            for n, (item, text) in enumerate(tqdm(todo, unit="item", desc=f"{task.name} states"), 1):
                vectors = scorer.states(request_of(task, text)).vectors[qid]
                mine.update({f"{item}/{layer}": vectors[layer] for layer in layers})
                if n % 50 == 0 or n == len(todo):
                    _save(cache, mine)
        finally:
            scorer.close()
        done.update(mine)
    return {layer: np.stack([done[f"{i}/{layer}"] for i in items.ids]) for layer in layers}


def _load(path: Path) -> dict[str, np.ndarray]:
    if not path.exists():
        return {}
    with np.load(path) as saved:
        return dict(zip(saved["keys"].tolist(), saved["values"], strict=True))


def _save(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """``item/layer`` -> state, written whole and swapped in (an interrupted save loses nothing)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial.npz")
    np.savez(partial, keys=np.array(list(arrays)), values=np.stack(list(arrays.values())))
    partial.replace(path)


def lens_probabilities(states: dict[int, np.ndarray], n_options: int) -> dict[int, np.ndarray]:
    scorer_ids = _letter_ids()
    lens = LetterLens(teacher_path(TEACHER), scorer_ids)
    return {layer: np.stack([lens.probabilities(state, n_options) for state in rows])
            for layer, rows in states.items()}


def _letter_ids() -> np.ndarray:
    scorer = Scorer(teacher_path(TEACHER), n_ctx=256, max_branches=1, n_threads=1)
    try:
        return scorer.letter_ids
    finally:
        scorer.close()


def head_split(states: np.ndarray, items: Items, parts: Parts) -> tuple[np.ndarray, np.ndarray]:
    """The library's head (``cascade train --mid-layer``'s) on this layer's states, fitted on the
    train part: calibration and evaluation rows."""
    head = fit_head(states[parts.train], items.targets[SOURCE][parts.train], C=1.0)
    features = normalized(states)
    return head.predict_proba(features[parts.calibration]), head.predict_proba(features[parts.evaluation])


def one_split(items: Items, states: dict[int, np.ndarray], lens: dict[int, np.ndarray], parts: Parts,
              target: float, embeddings: dict[str, np.ndarray]) -> Split:
    """Every cascade on one split, for each encoder's ``embeddings`` of the items."""
    truth = items.truth[SOURCE]
    encoders = {name: head_probabilities(items, emb, SOURCE, parts) for name, emb in embeddings.items()}
    baselines = {name: cascade_outcome(probs, None, truth, parts, CERTIFIED_SCORE, target)
                 for name, probs in encoders.items()}
    runs = {}
    expected = truth[parts.evaluation]
    for layer in states:
        mid = head_split(states[layer], items, parts)
        runs[layer] = LayerRun(
            head_agreement=float((mid[1].argmax(axis=1) == expected).mean()),
            lens_agreement=float((lens[layer][parts.evaluation].argmax(axis=1) == expected).mean()),
            alone=cascade_outcome(mid, None, truth, parts, CERTIFIED_SCORE, target),
            cascades={name: cascade_outcome(probs, mid, truth, parts, CERTIFIED_SCORE, target)
                      for name, probs in encoders.items()})
    return Split(baselines, runs)


def measured_seconds(items: Items, task: Task, layers: list[int], count: int, tuned: Path | None
                     ) -> dict[str, float]:
    """CPU seconds per item of the teacher, the tier at each layer and each encoder (``tuned``:
    the last fine-tuned one's file), one thread each, interleaved item by item."""
    path = teacher_path(TEACHER)
    scorers: dict[str, Scorer] = {"teacher": Scorer(path, n_ctx=2048, max_branches=1, n_threads=1)}
    scorers |= {str(layer): LayerScorer(path, [layer], n_ctx=2048, max_branches=1, n_threads=1)
                for layer in layers}
    encoders = {"frozen": Encoder(threads=1)}
    if tuned is not None:
        files = EncoderFiles(model=tuned, tokenizer=default_encoder_files().tokenizer)
        encoders["fine-tuned"] = Encoder(files, threads=1)
    contenders: dict[str, Callable[[tuple[str, DecisionRequest]], object]] = {
        **{name: partial(_read, scorer) for name, scorer in scorers.items()},
        **{name: partial(_encode, encoder) for name, encoder in encoders.items()}}
    pairs = [(text, request_of(task, text)) for text in items.texts[:count]]
    try:
        spent = interleaved(contenders, tqdm(pairs, unit="item", desc="timing"))
    finally:
        for scorer in scorers.values():
            scorer.close()
    return {name: statistics.mean(values["cpu"]) for name, values in spent.items()}


def _read(scorer: Scorer | LayerScorer, pair: tuple[str, DecisionRequest]) -> object:
    return scorer.states(pair[1]) if isinstance(scorer, LayerScorer) else scorer.score(pair[1])


def _encode(encoder: Encoder, pair: tuple[str, DecisionRequest]) -> object:
    return encoder.encode([pair[0]])


def cost(outcome: CascadeOutcome, seconds: dict[str, float], encoder: str, layer: int | None) -> float:
    tier = seconds[str(layer)] * outcome.reach_middle if layer is not None else 0.0
    return (seconds[encoder] + tier) / seconds["teacher"] + 1 - outcome.cheap


def report(splits: list[Split], seconds: dict[str, float], n_layer: int, target: float) -> str:
    rows = []
    for encoder in splits[0].baselines:
        baseline = [split.baselines[encoder] for split in splits]
        base_costs = [cost(o, seconds, encoder, None) for o in baseline]
        rows.append([f"{encoder} encoder -> teacher", "-", "-", "-", "-", "-",
                     brief([o.cheap for o in baseline], ".1%"),
                     brief([o.agreement for o in baseline], ".4f"),
                     brief(base_costs, ".3f", max(base_costs))])
        for layer in splits[0].layers:
            layer_runs = [split.layers[layer] for split in splits]
            outcomes = [run.cascades[encoder] for run in layer_runs]
            costs = [cost(o, seconds, encoder, layer) for o in outcomes]
            kept = [r.alone.encoder for r in layer_runs]
            cheap = [o.cheap for o in outcomes]
            agreement = [o.agreement for o in outcomes]
            rows.append([f"{encoder} encoder -> L{layer} -> teacher",
                         f"{layer}/{n_layer} = {layer / n_layer:.2f}",
                         f"{seconds[str(layer)] / seconds['teacher']:.2f}",
                         f"{statistics.mean(r.head_agreement for r in layer_runs):.3f}",
                         f"{statistics.mean(r.lens_agreement for r in layer_runs):.3f}",
                         brief(kept, ".1%"), brief(cheap, ".1%"),
                         brief(agreement, ".4f"), brief(costs, ".3f", max(costs))])
    header = ["cascade", "blocks run", "tier seconds / teacher (measured)", "head agrees with teacher",
              "lens agrees with teacher", f"tier alone keeps at {target}: mean (worst)",
              "cheap tiers keep: mean (worst)", "realised agreement: mean (worst)",
              "cost / teacher alone: mean (worst)"]
    return markdown(header, rows)


def main() -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("--task", choices=TASK_NAMES, required=True)
    parser.add_argument("--labels", type=Path, required=True, metavar="TEACHER.jsonl")
    parser.add_argument("--items", type=int, default=800)
    parser.add_argument("--layers", type=int, nargs="+", default=candidate_layers(28))
    parser.add_argument("--resplits", type=int, default=10)
    parser.add_argument("--target", type=float, default=0.98)
    parser.add_argument("--cost-items", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2,
                        help="llama.cpp threads while collecting states, torch threads while fine-tuning")
    parser.add_argument("--finetune", action="store_true",
                        help="also put MiniLM fine-tuned on each split's train part in front "
                             "(cached; minutes each)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    task = task_named(args.task)
    layers = sorted(args.layers)
    items = sample(load_items(args.labels, task, EmbeddingCache(CACHE_DIR, Encoder())), args.items, args.seed)
    digest = hashlib.sha256(args.labels.read_bytes()).hexdigest()[:12]
    cache = STATES_DIR / f"{task.name}-{digest}-{max(layers)}.npz"
    states = collect(items, task, layers, args.threads, cache)
    (question,) = request_of(task, "-").questions.values()
    lens = lens_probabilities(states, len(question.option_keys()))
    rng = np.random.default_rng(args.seed)
    config = FinetuneConfig(seed=args.seed, threads=args.threads)
    sample_digest = f"{labels_digest([args.labels])} mid-layer sample {len(items.ids)}"
    splits: list[Split] = []
    for number in range(1, args.resplits + 1):
        parts = parts_of(rng.permutation(len(items.ids)))
        embeddings = {"frozen": items.emb}
        if args.finetune:
            tuned_emb = finetuned(items, sample_digest, SOURCE, args.seed, number, parts, config)
            embeddings["fine-tuned"] = tuned_emb
        splits.append(one_split(items, states, lens, parts, args.target, embeddings))
        print(f"split {number}/{args.resplits} done", flush=True)
    tuned = FINETUNED_DIR / "last.onnx" if args.finetune else None
    seconds = measured_seconds(items, task, layers, args.cost_items, tuned)
    print(f"\n{len(items.ids)} {task.name} items, teacher {TEACHER} (28 blocks); target {args.target}, delta "
          f"{DELTA}; {args.resplits} random 50/25/25 re-splits (seed {args.seed}); CPU seconds per item on "
          f"{args.cost_items} items, one thread each: "
          + ", ".join(f"{name} {value:.3f}" for name, value in seconds.items()))
    print(report(splits, seconds, 28, args.target))


if __name__ == "__main__":
    main()
