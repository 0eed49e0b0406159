"""An engine's running totals, kept apart from the engine so that the server's metrics go on
adding up an engine a swap retired (its last audits still running) without keeping the engine."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

DROP_REASONS = ("queue_full", "store_behind", "stopped")


@dataclass
class Totals:
    """An engine's running totals: ``audits`` by outcome (audited, dropped, failed, unreadable),
    ``dropped`` audits by reason (queue_full: dropped at random from a full queue; store_behind:
    likewise from the queue of audits waiting for the store; stopped: left waiting when the
    engine stopped), the answered requests the audit sample looked at
    (``eligible``) and chose (``chosen``), the times an upstream asked audits to wait
    (``paused``: each such audit is put back and retried), the audited items whose answers the
    escalation already held (``answered_above``: no teacher call), ``routed``
    (``Auditor.route``'s counts) and ``abandoned`` jobs (dropped uncomputed: their client had
    gone). An object of their own, so that the server's metrics go on adding up an engine a swap
    retired (its last audits still running) without keeping the engine itself."""

    audits: dict[str, int] = field(default_factory=lambda: dict.fromkeys(
        ("audited", "dropped", "failed", "unreadable"), 0))
    dropped: dict[str, int] = field(default_factory=lambda: dict.fromkeys(DROP_REASONS, 0))
    eligible: int = 0
    chosen: int = 0
    paused: int = 0
    answered_above: int = 0
    routed: dict[str, int] = field(default_factory=dict)
    abandoned: int = 0

    def drop(self, reason: str, n: int = 1) -> None:
        self.audits["dropped"] += n
        self.dropped[reason] += n

    def plus(self, other: Totals) -> Totals:
        """A new total of both (a retired engine's folded into those before it)."""
        return replace(self, audits=_added(self.audits, other.audits),
                       dropped=_added(self.dropped, other.dropped), routed=_added(self.routed, other.routed),
                       eligible=self.eligible + other.eligible, chosen=self.chosen + other.chosen,
                       paused=self.paused + other.paused, abandoned=self.abandoned + other.abandoned,
                       answered_above=self.answered_above + other.answered_above)


def _added(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    return {key: a.get(key, 0) + b.get(key, 0) for key in a.keys() | b.keys()}
