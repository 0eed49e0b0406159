"""Which corpus items a labelling run takes: all of them, the first N, or a seeded sample.

A corpus sorted by label gives one class with "the first N", so ``sample`` draws N items at
random with a seed (the same N items on every resume), stratified by a gold field where the
corpus has one: each gold value keeps its share of the sample.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from cascade.corpus import read_corpus
from cascade.errors import CorpusError


class Selection(BaseModel):
    """``limit``: the first N valid items; ``sample``: N items drawn with ``seed``, stratified by
    ``gold_field`` where given. At most one of the two."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    limit: int | None = Field(default=None, ge=1)
    sample: int | None = Field(default=None, ge=1)
    seed: int = 0
    gold_field: str | None = None

    @model_validator(mode="after")
    def _one_way(self) -> Selection:
        if self.limit is not None and self.sample is not None:
            raise ValueError("give limit (the first N items) or sample (N drawn at random), not both")
        return self

    @property
    def everything(self) -> bool:
        return self.limit is None and self.sample is None

    def describe(self) -> str:
        if self.limit is not None:
            return f"the first {self.limit} items"
        if self.sample is not None:
            strata = f", stratified by {self.gold_field!r}" if self.gold_field else ""
            return f"a sample of {self.sample} items (seed {self.seed}{strata})"
        return "every item"


def select_ids(corpus: Path, text_field: str, selection: Selection) -> list[str] | None:
    """The ids ``selection`` takes, in corpus order; None for every item. Bad lines are never taken
    (reading them here is silent: the labelling run reports them)."""
    if selection.everything:
        return None
    ids = [item.id for item in read_corpus(corpus, text_field, "skip", lambda _: None)]
    if selection.limit is not None:
        return ids[:selection.limit]
    assert selection.sample is not None
    if selection.sample >= len(ids):
        return ids
    groups = _strata(corpus, ids, selection.gold_field)
    chosen = _stratified(groups, selection.sample, np.random.default_rng(selection.seed))
    return [item for item in ids if item in chosen]


def _strata(corpus: Path, ids: list[str], gold_field: str | None) -> dict[str, list[str]]:
    if gold_field is None:
        return {"": ids}
    gold: dict[str, str] = {}
    with Path(corpus).open(encoding="utf-8") as lines:
        for line in lines:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(row, dict) and gold_field in row:
                gold[str(row.get("id"))] = json.dumps(row[gold_field], sort_keys=True)
    if not gold:
        raise CorpusError(f"no row of {corpus} has the gold field {gold_field!r}; check --gold-field")
    groups: dict[str, list[str]] = defaultdict(list)
    for item in ids:
        groups[gold.get(item, "(none)")].append(item)
    return dict(groups)


def _stratified(groups: dict[str, list[str]], n: int, rng: np.random.Generator) -> set[str]:
    """``n`` ids, each group's share by the largest-remainder rule, drawn within each group."""
    total = sum(len(members) for members in groups.values())
    exact = {key: n * len(members) / total for key, members in groups.items()}
    counts = {key: int(share) for key, share in exact.items()}
    left = n - sum(counts.values())
    for key in sorted(exact, key=lambda k: (counts[k] - exact[k], k))[:left]:
        counts[key] += 1
    chosen: set[str] = set()
    for key in sorted(groups):
        members = groups[key]
        picks = rng.choice(len(members), size=counts[key], replace=False)
        chosen.update(members[i] for i in picks)
    return chosen
