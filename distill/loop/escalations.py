"""Escalations kept in the bundle's label store: the sink ``cascade serve --escalation-share``
writes through (on its collector's thread), what ``cascade decide --escalation-share`` keeps (as
each batch is decided), and the reader a retrain calls.

Each escalated request the server keeps (``cascade.collect.escalation``) goes into the store of
the bundle's teacher, labels and row in one transaction (``distill.store.escalations``); a store of
another teacher is refused when it opens, before anything is served. ``distill.loop.evidence`` reads
them back as training evidence, never as certifying evidence.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

from cascade.audit.sample import AuditSampler
from cascade.collect.escalation import EscalationRecord
from cascade.routing.budget import Run
from cascade.routing.escalations import escalation_of
from cascade.routing.router import Cascade
from distill.store import LabelStore, StoreLocation, Teacher
from distill.store.shared import SharedStore


@dataclass
class KeptEscalations:
    """What an offline run keeps: the teacher's answers about a seeded ``share`` of the items it
    escalated, chosen by item id (a rerun chooses the same ones), into ``sink``. Only while the
    cascade is certified (its teacher is the one the store holds)."""

    sink: StoreEscalations
    share: float = 1.0
    seed: str = "escalations"
    kept: int = 0

    def keep(self, cascade: Cascade, run: Run) -> None:
        """Store the chosen escalations of a finished ``run``; a store that fails raises."""
        if not cascade.certified:
            return
        chosen, at = AuditSampler(self.share, self.seed).chosen, time.time()
        for i, item in enumerate(run.items):
            if chosen(item.id) and (record := escalation_of(cascade, run, i, item.id, at,
                                                             inclusion=self.share)) is not None:
                self.sink.append(record)
                self.kept += 1


class StoreEscalations:
    """A ``cascade.collect.collector.Sink`` of escalations on the label store at ``path``, bound
    to ``teacher`` (the bundle's)."""

    def __init__(self, path: StoreLocation | str, teacher: Teacher) -> None:
        self.shared = SharedStore(path, teacher)

    def append(self, item: EscalationRecord) -> None:
        with self.shared.use() as store:
            store.put_escalation(item)

    def count(self) -> int:
        if not self.shared.made():
            return 0
        with self.shared.use() as store:
            return store.escalation_count()

    def close(self) -> None:
        self.shared.close()


def escalations(store: LabelStore) -> Iterator[EscalationRecord]:
    """Every escalation in ``store``, in the store's order."""
    position = 0
    while page := store.escalations_after(position):
        position = page[-1][0]
        yield from (record for _, record in page)
