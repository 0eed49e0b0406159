"""Which routed items the teacher audits: a seeded, uniform share, chosen before any tier runs.

An item is audited when a hash of (seed, key) falls below ``share``: the choice depends on the
key alone, never on the state or the answer, so the audited items are a uniform sample of the
traffic and their agreement estimates the system's. ``cascade decide`` keys on the corpus id (the
same corpus and seed audit the same items, a resumed run included); the server keys on its own
count of requests, since a client-chosen request id must not pick what is audited.
"""

from __future__ import annotations

from cascade.checks import is_real
from cascade.hashing import seeded_unit

DEFAULT_SHARE = 0.02


class AuditSampler:
    """``chosen(key)``: whether the item keyed ``key`` is audited; ``share`` 0 audits none."""

    def __init__(self, share: float = DEFAULT_SHARE, seed: str = "audit") -> None:
        if not (is_real(share) and 0 <= share <= 1):
            raise ValueError(f"the audit share must be a number in [0, 1]; got {share!r}")
        self.share = float(share)
        self.seed = seed

    def chosen(self, key: str) -> bool:
        if self.share == 0:
            return False
        return seeded_unit(self.seed, key) < self.share
