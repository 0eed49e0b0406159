"""The store's audit rows read back as records, each checked: a row damaged by hand or by a disk
(its JSON cut, a probability that is not a number) is named in one line, not a traceback from
the middle of ``cascade audit`` or a server's drift watch."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from cascade.audit.record import AuditRecord, SystemAnswer
from distill.store.records import StoreError

LabelRows = Mapping[str, list[tuple[str, str, str | None]]]
"""Per item, its label rows: (question id, probabilities JSON, prompt hash)."""


def audit_records(rows: Sequence[Sequence[Any]], labels: LabelRows, store: object) -> list[AuditRecord]:
    """Rows (item, state, version, system, time, inclusion, routed) as records, with their labels."""
    return [_record(row, labels, store) for row in rows]


def _record(row: Sequence[Any], labels: LabelRows, store: object) -> AuditRecord:
    item_id, state, version, system, created, inclusion, routed = row
    mine = labels.get(item_id, [])
    try:
        return AuditRecord(
            item_id=item_id, state=json.loads(state), calibration_version=version, at=created,
            teacher={q: json.loads(p) for q, p, _ in mine},
            prompt_hashes={q: h for q, _, h in mine if h},
            system={q: SystemAnswer.model_validate(a) for q, a in json.loads(system).items()},
            inclusion=inclusion, routed=json.loads(routed) if routed else {})
    except (ValueError, TypeError, AttributeError) as exc:  # JSONDecodeError, ValidationError among them
        why = " ".join(str(exc).split())[:200]
        raise StoreError(f"the audit {item_id!r} in {store} is damaged ({type(exc).__name__}: {why}); "
                         "restore the store from a copy, or delete that audit's row") from None
