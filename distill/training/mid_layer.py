"""Training the mid-layer tier: the teacher's layer-L states of the train items, one head per
question on them, and L chosen by measurement (``cascade.readout.layer_scorer``).

Collecting a train item's states costs about L/N of a teacher pass (its decodes stop at L). With
``layer="auto"`` the states of every candidate layer come from one pass stopped at the deepest,
a fifth of the train items is held out, and each candidate is scored by what a cascade through it
would cost per item, as a share of the teacher: ``L / N`` for reading every item, plus the share
it cannot keep at the target agreement (those go on to the whole teacher, which reuses nothing of
the tier's work). The cheapest wins; the heads are then refitted on every train item at it.
This is an estimate on the train part only: the thresholds are certified by ``cascade calibrate``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
from tqdm import tqdm

from cascade.bundle.manifest import BundleFile
from cascade.bundle.sections import LayerCandidate
from cascade.cost.roofline import ModelShape
from cascade.errors import CascadeError, InputTooLongError
from cascade.hashing import seeded_bits
from cascade.heads import SoftmaxHead, save_heads
from cascade.pins import ModelFile
from cascade.questions import OPTION_LETTERS, DecisionRequest, Question, State
from cascade.readout.layer_scorer import LayerScorer, LetterLens, Reader, normalized
from cascade.readout.placement import Placement, say_once
from cascade.readout.scorer import branch_slots
from cascade.thresholds import CERTIFIED_SCORE, threshold_score
from cascade.tiers.base import HeadInfo
from cascade.tiers.mid_layer import MidLayerSpec
from distill.training.head_rule import MIN_TRAIN_LABELS, why_no_head

MID_HEADS_NAME = "mid_layer_heads.npz"
AUTO_TARGET = 0.98
"""The agreement ``layer="auto"`` scores candidates at: calibrate's default target."""
HELD_OUT = 0.2
"""Share of the train items ``layer="auto"`` holds out to score the candidates on."""
MIN_ITEMS = MIN_TRAIN_LABELS  # fewer train items could train no head

Labels = Mapping[str, Mapping[str, Mapping[str, float]]]
States = dict[int, dict[str, np.ndarray]]
"""layer -> question id -> (items, n_embd) states at the question's answer position."""


class MidLayerError(CascadeError, ValueError):
    """A mid-layer tier cannot be trained as asked."""


@dataclass(frozen=True)
class MidLayerConfig:
    """What ``cascade train --mid-layer`` asks: the blocks to run (or ``"auto"``), the reader,
    at most ``max_items`` train items (None: all), and where the teacher runs while collecting."""

    layer: int | Literal["auto"] = "auto"
    reader: Reader = "head"
    max_items: int | None = None
    placement: Placement = field(default_factory=Placement)
    n_ctx: int = 4096
    name: str = "mid-layer"

    def check(self) -> None:
        if self.layer != "auto" and not (isinstance(self.layer, int) and self.layer >= 1):
            raise MidLayerError(f"--mid-layer must be a number of blocks >= 1 or 'auto'; got {self.layer!r}")
        if self.reader not in ("head", "lens"):
            raise MidLayerError(f"the mid-layer reader must be 'head' or 'lens'; got {self.reader!r}")
        if self.max_items is not None and self.max_items < MIN_ITEMS:
            raise MidLayerError(f"--mid-layer-items must be at least {MIN_ITEMS}; got {self.max_items}")


def candidate_layers(n_layer: int) -> list[int]:
    """Layers ``auto`` tries: from a quarter of the blocks to the last but one, about 8 of them."""
    step = max(1, n_layer // 8)
    layers = list(range(max(1, n_layer // 4), n_layer, step))
    return layers if layers[-1] == n_layer - 1 else [*layers, n_layer - 1]


def train_mid_layer(config: MidLayerConfig, model: Path, questions: Mapping[str, Question],
                    labels: Labels, states: Mapping[str, State], train: Sequence[str],
                    stage: Path, C: float, progress: bool = True
                    ) -> tuple[MidLayerSpec, list[LayerCandidate]]:
    """The tier's spec (its heads saved into ``stage``) and, with ``auto``, every candidate's score
    (the manifest's ``training.mid_layer``)."""
    ids = _sampled(train, config.max_items)
    if len(ids) < MIN_ITEMS:
        raise MidLayerError(f"a mid-layer tier needs at least {MIN_ITEMS} labelled train items; "
                            f"the train part has {len(ids)}")
    layers, n_layer = layers_of(config, model)
    asked, skipped = _askable(questions, labels, ids, config.reader)

    def spec(layer: int, heads_file: BundleFile | None = None, heads: dict[str, HeadInfo] | None = None
             ) -> MidLayerSpec:
        return MidLayerSpec(name=config.name, model=ModelFile.of(model), layer=layer, n_layer=n_layer,
                            reader=config.reader, n_ctx=config.n_ctx, placement=config.placement,
                            heads_file=heads_file, heads=heads or {})

    if config.reader == "lens" and config.layer != "auto":
        return spec(layers[0]), []  # nothing to learn, nothing to choose
    place = config.placement.over(Placement(n_ctx=config.n_ctx))
    scorer = LayerScorer.placed_at(model, layers, place, branch_slots(len(questions)))
    try:
        lens = LetterLens(model, scorer.letter_ids) if config.reader == "lens" else None
        collected, ids = collect_states(scorer, asked, states, ids, layers, progress)
    finally:
        scorer.close()
    sweep: list[LayerCandidate] = []
    layer = layers[0]
    if config.layer == "auto":
        sweep = score_layers(collected, asked, labels, ids, n_layer, lens, C)
        layer = min(sweep, key=lambda c: (c.cost, c.layer)).layer
    if config.reader == "lens":
        return spec(layer), sweep
    heads, infos = fit_heads(collected[layer], asked, labels, ids, C)
    save_heads(stage / MID_HEADS_NAME, heads)
    return spec(layer, heads_file=BundleFile.of(stage, MID_HEADS_NAME), heads=infos | skipped), sweep


def _askable(questions: Mapping[str, Question], labels: Labels, ids: Sequence[str], reader: Reader
             ) -> tuple[dict[str, Question], dict[str, HeadInfo]]:
    """The questions the tier will answer, known from the labels before any state is read (so
    that training reads them in the fan-out routing will: the batch moves the states), and why
    each other one has no head."""
    asked, skipped = {}, {}
    for qid, question in questions.items():
        keys = question.option_keys()
        Y = _label_rows(labels[qid], [i for i in ids if i in labels[qid]], keys)
        if len(keys) > len(OPTION_LETTERS):
            why: str | None = f"{len(keys)} options; one prompt letters {len(OPTION_LETTERS)} at most"
        else:
            why = why_no_head(Y, keys) if reader == "head" else None
        if why is None:
            asked[qid] = question
        else:
            skipped[qid] = HeadInfo(option_keys=keys, train_items=len(Y), skipped=why)
    if not asked:
        raise MidLayerError("no question can be answered by a mid-layer tier: "
                            + "; ".join(f"{q}: {info.skipped}" for q, info in skipped.items()))
    return asked, skipped


def layers_of(config: MidLayerConfig, model: Path) -> tuple[list[int], int]:
    """The layers ``config`` reads on ``model`` (all the candidates with ``auto``) and its block
    count, from the file's header: checked before any model runs."""
    config.check()
    n_layer = ModelShape.from_gguf(model).n_layers
    layers = candidate_layers(n_layer) if config.layer == "auto" else [int(config.layer)]
    if layers[-1] >= n_layer:
        raise MidLayerError(f"{model.name} has {n_layer} blocks; --mid-layer runs fewer than all, "
                            f"at most {n_layer - 1}")
    return layers, n_layer


def _sampled(train: Sequence[str], max_items: int | None) -> list[str]:
    """At most ``max_items`` of the train ids, the same ones on every run (by a hash of the id)."""
    ids = sorted(train)
    if max_items is None or len(ids) <= max_items:
        return ids
    return sorted(sorted(ids, key=lambda i: seeded_bits("", i, ""))[:max_items])


def _held_out(item_id: str) -> bool:
    """Whether an item is in the held-out fifth: by the first byte of its draw (a byte below
    256 x HELD_OUT), the same on every run."""
    return seeded_bits("held", item_id, "\0") >> 56 < 256 * HELD_OUT


def collect_states(scorer: LayerScorer, questions: Mapping[str, Question], states: Mapping[str, State],
                   ids: Sequence[str], layers: Sequence[int], progress: bool = True
                   ) -> tuple[States, list[str]]:
    """Every item's states at ``layers`` (each item decoded once, to the deepest), and the items
    read: one whose prompt the tier's context cannot hold is left out, and said, as routing
    sends it past the tier unread."""
    rows: dict[int, dict[str, list[np.ndarray]]] = {layer: {q: [] for q in questions} for layer in layers}
    read_ids, too_long = [], []
    for item in tqdm(ids, unit="item", desc="mid-layer states", disable=not progress):
        try:
            read = scorer.states(DecisionRequest(state=states[item], questions=dict(questions)))
        except InputTooLongError:
            too_long.append(item)
            continue
        read_ids.append(item)
        for qid in questions:
            for layer in layers:
                rows[layer][qid].append(read.vectors[qid][layer])
    if too_long:
        say_once(f"mid-layer tier: {len(too_long)} of {len(ids)} train states do not fit its context "
                 f"(n_ctx {scorer.ctx.config.n_ctx}; first: {too_long[0]!r}); trained without them")
    if len(read_ids) < MIN_ITEMS:
        raise MidLayerError(f"only {len(read_ids)} of {len(ids)} train states fit the mid-layer tier's "
                            f"context (n_ctx {scorer.ctx.config.n_ctx}); a tier needs {MIN_ITEMS}: give it a "
                            "longer one (MidLayerConfig(n_ctx=...))")
    stacked = {layer: {qid: np.stack(got) for qid, got in by_q.items()} for layer, by_q in rows.items()}
    return stacked, read_ids


def fit_heads(states: Mapping[str, np.ndarray], questions: Mapping[str, Question], labels: Labels,
              ids: Sequence[str], C: float) -> tuple[dict[str, SoftmaxHead], dict[str, HeadInfo]]:
    """One head per question on its normalized states of the labelled ``ids``."""
    heads, infos = {}, {}
    for qid, question in questions.items():
        keys = question.option_keys()
        rows = [i for i, item in enumerate(ids) if item in labels[qid]]
        Y = _label_rows(labels[qid], [ids[i] for i in rows], keys)
        info = HeadInfo(option_keys=keys, train_items=len(rows))
        why = why_no_head(Y, keys)
        if why is not None:  # the states read fewer items than _askable counted
            infos[qid] = info.model_copy(update={"skipped": why})
            continue
        heads[qid] = fit_head(states[qid][rows], Y, C)
        infos[qid] = info
    return heads, infos


def _label_rows(labels: Mapping[str, Mapping[str, float]], ids: Sequence[str], keys: list[str]
                ) -> np.ndarray:
    """(len(ids), len(keys)) teacher probabilities, columns in the question's option order."""
    rows = np.array([[labels[i][k] for k in keys] for i in ids], dtype=np.float64)
    return rows.reshape(len(ids), len(keys))


def fit_head(states: np.ndarray, Y: np.ndarray, C: float) -> SoftmaxHead:
    """A head on the normalized states, fitted on them standardized per dimension and folded
    back, so that it reads ``normalized(state)`` as the tier gives it.

    A residual stream has a few dimensions far from the others (on the 1.5B's layer 16, one whose
    mean magnitude is 54x the median's, and a spread up to 8x the median's): standardized, the
    penalty weighs every dimension on one scale, and a fit converges in fewer steps.
    """
    X = normalized(states)
    mean, scale = X.mean(axis=0), X.std(axis=0)
    scale[scale == 0] = 1.0
    fitted = SoftmaxHead(C=C, max_iter=2000).fit((X - mean) / scale, Y)
    coef = fitted.coef_ / scale
    return SoftmaxHead.from_arrays({"coef": coef, "intercept": fitted.intercept_ - coef @ mean,
                                    "C": np.asarray(C), "max_iter": np.asarray(fitted.max_iter)})


def score_layers(states: States, questions: Mapping[str, Question], labels: Labels,
                 ids: Sequence[str], n_layer: int, lens: LetterLens | None, C: float,
                 target: float = AUTO_TARGET) -> list[LayerCandidate]:
    """Each candidate layer's agreement, kept share and estimated cost on the held-out fifth."""
    held = np.array([_held_out(i) for i in ids])
    fit_ids = [i for i, h in zip(ids, held, strict=True) if not h]
    scores = []
    for layer, by_q in states.items():
        agreement, kept = [], []
        for qid, question in questions.items():
            rows = [r for r, item in enumerate(ids) if held[r] and item in labels[qid]]
            if not rows:
                continue
            teacher = np.array([np.argmax([labels[qid][ids[r]][k] for k in question.option_keys()])
                                for r in rows])
            probs = _held_out_probabilities(by_q[qid], rows, question, qid, labels, fit_ids, ids, lens, C)
            agreement.append(float((probs.argmax(axis=1) == teacher).mean()))
            kept.append(kept_share(probs, teacher, target))
        if agreement:
            share = float(np.mean(kept))
            scores.append(LayerCandidate(layer=layer, agreement=float(np.mean(agreement)), kept=share,
                                         cost=layer / n_layer + 1 - share))
    if not scores:
        raise MidLayerError("no held-out train item has a teacher label: too few items to choose a layer")
    return scores


def _held_out_probabilities(states: np.ndarray, rows: list[int], question: Question, qid: str,
                            labels: Labels, fit_ids: list[str], ids: Sequence[str],
                            lens: LetterLens | None, C: float) -> np.ndarray:
    n = len(question.option_keys())
    if lens is not None:
        return np.stack([lens.probabilities(states[r], n) for r in rows])
    position = {item: r for r, item in enumerate(ids)}
    heads, _ = fit_heads({qid: states[[position[i] for i in fit_ids]]}, {qid: question}, labels, fit_ids, C)
    if qid not in heads:
        return np.full((len(rows), n), 1.0 / n)
    return heads[qid].predict_proba(normalized(states[rows]))


def kept_share(probs: np.ndarray, teacher: np.ndarray, target: float) -> float:
    """The largest share of items, taken by margin from the most sure, whose argmax agrees with
    the teacher's on at least ``target`` of them (empirical: no finite-sample guarantee)."""
    order = np.argsort(-threshold_score(probs, CERTIFIED_SCORE), kind="stable")
    agree = (probs.argmax(axis=1) == teacher)[order]
    running = np.cumsum(agree) / np.arange(1, len(agree) + 1)
    ok = np.nonzero(running >= target)[0]
    return float((ok[-1] + 1) / len(agree)) if len(ok) else 0.0
