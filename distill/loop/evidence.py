"""Everything a label store holds that a teacher labelled, as evidence to retrain on: each state
once, with where it came from.

A deployed cascade's store fills from several places: the corpus it was first trained on (its
states in that corpus, its labels in the store), audits (a seeded uniform share of traffic, each
with its state), collected traffic (every request a pass-through forwarded to the teacher,
``cascade serve --teacher URL --collect S``, labelled by ``cascade collected --out``: its states in
the store's ``traffic`` table) and escalations (what a serving cascade sent up, the hard items,
kept by ``cascade serve --escalation-share``: the store's ``escalations`` table). Each is told
apart by the prefix of its item id (``ORIGINS``).

The same state may arrive twice (an item audited in two runs, a corpus item seen again as
traffic): it is one observation, so it is kept once, under the first id met (corpus items first,
then audits and collected traffic, census escalations, the other escalations last, each in the
store's order, so that a state both escalated and drawn uniformly keeps the origin that may
certify), and every later copy is counted as a duplicate.

Which origins may certify a threshold: uniform draws only (``CERTIFYING``); escalations train
(distill.calibration.traffic says why, and what would let them certify), except a census
escalation: one whose every question routing sent up whatever the item (a question no cheap tier
held a threshold for, as while the cascade had certified nothing: ``cascade.collect.escalation``).
Such a record was kept because the request came, not because the cascade doubted it, so it is a
uniform draw of the traffic of its time, as an audit is; it is placed in a part by its id's hash
like one, and certifies there.

Each draw of traffic keeps the probability it was drawn with (``inclusion``: the share asked for
times its survival of the queues that dropped at random under load, ``cascade.deferral``). A
certificate counts every item alike, which is exact only where they were drawn alike, so
``Evidence.unequal`` says which certifying items were drawn with less probability than others of
their origin, for ``cascade retrain`` to say so.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from cascade.errors import CascadeError
from cascade.private import private_text
from cascade.questions import Question, State
from distill.loop.escalations import escalations
from distill.options import CorpusInput
from distill.store import LabelStore
from distill.store.first_reading import read_recorded

Origin = Literal["corpus", "audit", "collected", "escalation", "census escalation"]
ORIGINS: dict[str, Origin] = {"audit:": "audit", "traffic:": "collected", "escalation:": "escalation"}
"""A stored item id's prefix -> its origin (``distill.loop.collected.item_id`` names collected states;
an audit record of no known prefix is an audit)."""
CERTIFYING: dict[str, frozenset[Origin]] = {
    "all": frozenset({"corpus", "audit", "collected", "census escalation"}),
    "traffic": frozenset({"audit", "collected", "census escalation"}),
    "corpus": frozenset({"corpus"}),
}
"""Which origins certify, by the name ``cascade retrain --calibrate-on`` gives them: uniform draws
of the corpus or of traffic. Escalations the serving cascade chose, never."""


class EvidenceError(CascadeError, ValueError):
    """The store's evidence cannot be gathered: states missing, nothing labelled."""


@dataclass(frozen=True)
class EvidenceItem:
    """One labelled state: the id its labels are stored under, the state, where it came from, and
    the probability it was drawn with (None where unknown: a corpus item, a record written before
    it was kept)."""

    id: str
    state: State
    origin: Origin
    inclusion: float | None = None

    @property
    def content(self) -> str:
        return state_sha256(self.state)


@dataclass(frozen=True)
class Evidence:
    """The labelled states, each once, in the order met; and the copies left out."""

    items: list[EvidenceItem]
    duplicates: int = 0
    origins: Counter[str] = field(default_factory=Counter)

    def ids(self, origins: Iterable[Origin] | None = None) -> set[str]:
        wanted = set(origins) if origins is not None else None
        return {item.id for item in self.items if wanted is None or item.origin in wanted}

    def unequal(self, ids: Iterable[str]) -> dict[str, dict[str, float]]:
        """Per origin, those of ``ids`` drawn with less probability than the most any of them had:
        how many (``items``), the least probability (``lowest``) and the most (``highest``). A
        queue that dropped under load, or a share changed between runs, draws so; none where all
        were drawn alike."""
        wanted = set(ids)
        drawn: dict[str, list[float]] = {}
        for item in self.items:
            if item.id in wanted and item.inclusion is not None:
                drawn.setdefault(item.origin, []).append(item.inclusion)
        spread = {origin: (min(ps), max(ps)) for origin, ps in drawn.items()}
        return {origin: {"items": sum(p < top for p in drawn[origin]), "lowest": low, "highest": top}
                for origin, (low, top) in spread.items() if low < top}

    def write(self, path: Path) -> Path:
        """The states as a JSONL corpus (``{"id", "text"}``), which training and calibration read:
        customer text, so readable by its owner alone (0600, whatever the umask)."""
        with private_text(path) as handle:
            for item in self.items:
                handle.write(json.dumps({"id": item.id, "text": item.state}, ensure_ascii=False) + "\n")
        return path


def state_sha256(state: State) -> str:
    """A state's content hash, as the drift watch counts audits (``AuditRecord.state_sha256``)."""
    return hashlib.sha256(json.dumps(state, sort_keys=True).encode()).hexdigest()


def origin_of(item_id: str, otherwise: Origin = "audit") -> Origin:
    """An item's origin by its id's prefix (a corpus ``cascade collected`` wrote holds collected
    states); ``otherwise`` where it has none of ``ORIGINS``."""
    return next((origin for prefix, origin in ORIGINS.items() if item_id.startswith(prefix)), otherwise)


def gather(store: LabelStore, questions: Mapping[str, Question], corpus: CorpusInput | None,
           trained_field: str | None = None) -> Evidence:
    """Every item the store labelled for any of ``questions`` whose state is known here: the
    corpus's (``trained_field``: the field read unless the corpus names one) and the store's
    records'. Labelled corpus items without ``corpus`` are refused: a retrain must count them."""
    labelled = set().union(*(store.labels(qid) for qid in questions))
    if not labelled:
        raise EvidenceError(f"label store {store.path} holds no teacher label for the questions "
                            f"{sorted(questions)}; label a corpus or audit traffic first")
    met: list[EvidenceItem] = []
    if corpus is not None:
        rows = read_recorded(store, corpus.read(trained_field), corpus.path)
        met += [EvidenceItem(row.id, row.state, origin_of(row.id, "corpus"))
                for row in rows if row.id in labelled]
    met += [EvidenceItem(r.item_id, r.state, origin_of(r.item_id), r.inclusion) for r in store.each_audit()
            if r.item_id in labelled]
    met += [EvidenceItem(ident, state, "collected", inclusion)
            for ident, (state, inclusion) in _collected(store) if ident in labelled]
    escalated = [r for r in escalations(store) if r.item_id in labelled]  # census first: they may certify
    met += [EvidenceItem(r.item_id, r.state, "census escalation", r.inclusion)
            for r in escalated if r.is_census]
    met += [EvidenceItem(r.item_id, r.state, "escalation", r.inclusion)
            for r in escalated if not r.is_census]
    stateless = labelled - {item.id for item in met}
    if stateless:
        where = ("in --corpus" if corpus is not None else
                 "here: give the corpus they were labelled from (--corpus)")
        raise EvidenceError(f"{len(stateless)} items labelled in {store.path} have no state {where} (for "
                            f"example {min(stateless)!r}); every labelled item is counted once")
    return _once(met)


def _collected(store: LabelStore) -> list[tuple[str, tuple[State, float | None]]]:
    """Each collected state under the id its labels are stored under, with the probability it was
    collected with, first copy first."""
    from distill.loop.collected import item_id

    out: dict[str, tuple[State, float | None]] = {}
    position = 0
    while page := store.traffic_after(position):
        position = page[-1][0]
        for _, item in page:
            out.setdefault(item_id(item.state_sha256), (item.state, item.inclusion))
    return list(out.items())


def _once(met: list[EvidenceItem]) -> Evidence:
    """The first copy of each state; later ones counted as duplicates."""
    seen: set[str] = set()
    kept: list[EvidenceItem] = []
    for item in met:
        if item.content not in seen:
            seen.add(item.content)
            kept.append(item)
    return Evidence(kept, len(met) - len(kept), Counter(item.origin for item in kept))
