"""Recorded teacher answers in place of a top tier: replaying a cascade on labelled items."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from cascade.cost.pricing import TEACHER_PARAMS, TierCost, TierPricing, estimate_tokens, gguf_flops_per_token
from cascade.errors import CascadeError
from cascade.questions import Question
from cascade.tiers.base import Answers, Asked, Item, Tier


class LabelsTier(Tier):
    """Teacher answers recorded in a label store, for replaying a cascade on labelled items.

    ``labels`` maps question id -> item id -> probabilities keyed like the answers (the shape of
    a label store's labels). A missing label is an error, never a silent gap. The tier is priced
    as the teacher whose answers these are: the GGUF ``model`` read with ``permutations`` option
    orders, or, for an external teacher (None), a model of TEACHER_PARAMS weights.
    """

    def __init__(self, name: str, labels: Mapping[str, Mapping[str, Mapping[str, float]]],
                 model: Path | None = None, permutations: int = 1) -> None:
        self.name = name
        self.labels = labels
        self.model = model
        self.permutations = permutations

    def flops_per_token(self) -> float:
        return 2.0 * TEACHER_PARAMS if self.model is None else gguf_flops_per_token(self.model)

    def pricing(self, cost: TierCost) -> TierPricing:
        """As a readout, with tokens estimated from the characters: no tokenizer is loaded."""
        return TierPricing(cost, estimate_tokens, fanout=True, permutations=self.permutations)

    def answer(self, items: Sequence[Item], asked: Asked, questions: Mapping[str, Question]) -> Answers:
        out: Answers = [{} for _ in items]
        for i, (item, qids) in enumerate(zip(items, asked, strict=True)):
            for qid in qids:
                row = self.labels.get(qid, {}).get(item.id)
                if row is None:
                    raise CascadeError(
                        f"tier {self.name!r} has no teacher label for item {item.id!r}, question "
                        f"{qid!r}; label it first (cascade label) or give a GGUF teacher"
                    )
                out[i][qid] = np.asarray([row[key] for key in questions[qid].option_keys()])
        return out
