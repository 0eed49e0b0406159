"""The certificate watched on audited traffic: one anytime-valid alarm per question.

Each bundle question gets an ``AgreementMonitor`` on the calibration's target, at level delta
(what calibration allowed the guarantee to fail with): fed every audited item in order, it alarms
at most delta of the time while agreement holds, however often it is read. When a question's
alarm rises, with ``on_drift="demote"`` (the default) its cheap tiers are taken out of its
route: every answer to it then comes from the teacher, marked ``demoted`` in ``x_routing``, until
a calibration certifies it again (a new calibration version starts the watch afresh); with
``"alarm"`` it is only reported. Records of another calibration version are not counted, nor a
state counted before (an item audited again, by a second run or a replay): each state is one
observation.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Literal

from cascade.audit.alarms import AgreementMonitor
from cascade.audit.record import AuditRecord

OnDrift = Literal["demote", "alarm"]


class DriftWatch:
    """Per-question alarms for one calibration; ``demoted`` is what routing must escalate."""

    def __init__(self, questions: Iterable[str], target: float, delta: float, calibration_version: str,
                 on_drift: OnDrift = "demote") -> None:
        self.calibration_version = calibration_version
        self.on_drift = on_drift
        self.monitors = {qid: AgreementMonitor(target, delta) for qid in questions}
        self.demoted: set[str] = set()
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    def observe(self, record: AuditRecord) -> list[str]:
        """Count one audited item; the questions whose alarm it raised (now demoted, where so set)."""
        if record.calibration_version != self.calibration_version:
            return []
        raised = []
        with self._lock:
            if record.state_sha256 in self._seen:
                return []
            self._seen.add(record.state_sha256)
            for qid, monitor in self.monitors.items():
                if qid not in record.system or qid not in record.teacher:
                    continue
                was = monitor.alarm
                monitor.update([record.agreed(qid)])
                if monitor.alarm and not was:
                    raised.append(qid)
            if self.on_drift == "demote":
                self.demoted.update(raised)
        return raised
