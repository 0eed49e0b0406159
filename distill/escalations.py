"""Escalations kept in the bundle's label store: the sink ``cascade serve --escalation-share``
writes through, and the reader a retrain calls.

Each escalated request the server keeps (``cascade.collect.escalation``) goes into the store of
the bundle's teacher, labels and row in one transaction (``distill.store.escalations``); a store of
another teacher is refused when it opens, before anything is served. ``distill.evidence`` reads
them back as training evidence, never as certifying evidence.
"""

from __future__ import annotations

from collections.abc import Iterator

from cascade.collect.escalation import EscalationRecord
from distill.store import LabelStore, StoreLocation, Teacher
from distill.store.shared import SharedStore


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
