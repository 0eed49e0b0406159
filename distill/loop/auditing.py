"""Audits kept in the bundle's label store, and what ``cascade audit`` reports from them.

The runtime's auditor (``cascade.audit.auditor``) writes through a sink it is given; this module
gives it one that puts each record in a ``LabelStore`` of the bundle's teacher (so audits from
another teacher can never mix in) and reads every writer's records back in the store's order: the
audit stream (``cascade.audit.stream``) that every replica sharing the store follows, so that all
of them watch one alarm, and a restarted server or run replays it and keeps a demoted question
demoted. It also turns a store's audits into the per-question table and plot of ``cascade audit``.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from cascade.audit.alarms import AgreementMonitor
from cascade.audit.auditor import Auditor
from cascade.audit.record import AuditRecord
from cascade.audit.sample import AuditSampler
from cascade.audit.watch import DriftWatch, OnDrift
from cascade.bundle.manifest import Bundle, Manifest
from cascade.routing.router import Cascade
from distill.store import (
    LabelStore,
    StoreError,
    StoreLocation,
    StoreMismatchError,
    Teacher,
    is_url,
    store_exists,
    store_location,
)
from distill.store.shared import SharedStore

DEFAULT_POLL_S = 1.0
"""How often a server reads the audit stream for other replicas' audits: a demotion raised on one
replica holds on every other within this plus one read of the store (docs/stores.md)."""


def bundle_teacher(manifest: Manifest) -> Teacher:
    return Teacher.model_validate(manifest.teacher.model_dump())


class StoreSink:
    """Writes audit records into the label store at ``path`` and reads every writer's back, in
    the store's order (an ``AuditStream``). A SQLite file is made on the first write (no audit, no
    file); one call at a time whatever the thread (the server's top-tier worker writes, the stream
    follower reads, the command closes); a call that failed (a PostgreSQL server restarting, say)
    reconnects on the next (``distill.store.shared``)."""

    def __init__(self, path: StoreLocation | str, teacher: Teacher) -> None:
        self.shared = SharedStore(path, teacher)

    def __call__(self, record: AuditRecord) -> None:
        with self.shared.use() as store:
            store.put_audit(record)

    append = __call__

    def read_after(self, position: int) -> list[tuple[int, AuditRecord]]:
        """The stream's next records past ``position`` (none while there is no store yet)."""
        if not self.shared.made():
            return []
        with self.shared.use() as store:
            return store.audits_after(position)

    def close(self) -> None:
        self.shared.close()


def stored_audits(path: StoreLocation | str) -> list[AuditRecord]:
    """The audits in the store at ``path``, in the store's order (none where there is no store yet)."""
    location = store_location(path)
    if not store_exists(location):
        return []
    with LabelStore.open_existing(location) as store:
        return store.audits()


def auditor_for(cascade: Cascade, store: StoreLocation | str | None, share: float, seed: str,
                on_drift: OnDrift, poll: float | None = None) -> tuple[Auditor | None, StoreSink | None]:
    """The auditor a command runs with, and its sink; (None, None) when audits are off, said on
    stderr when only the store is missing. Its watch follows the store's audit stream (every
    writer's audits, in the store's order), read through now, and every ``poll`` seconds in a
    thread where given (a server: other replicas' audits); ``auditor.close()`` stops that and
    closes the sink's store."""
    if share == 0:
        return None, None
    if store is None:
        print(f"audits off: give --audit-store (the bundle's label store) to audit {share:.0%} of the "
              "items with the teacher and watch the certificate", file=sys.stderr)
        return None, None
    sink = StoreSink(store, bundle_teacher(cascade.manifest))
    auditor = Auditor(cascade, AuditSampler(share, seed), sink, on_drift, stream=sink, closing=sink.close)
    auditor.replay()
    if poll is not None and auditor.follower is not None:
        auditor.follower.follow(poll)
    if auditor.watch is not None and auditor.watch.demoted:
        print(f"questions demoted by earlier audits: {sorted(auditor.watch.demoted)} (their answers come "
              "from the teacher until a calibration certifies them again)", file=sys.stderr)
    return auditor, sink


class StoreAudits:
    """``auditor_for`` as the hook ``cascade.serve.lifecycle.serve`` calls with the cascade it
    loaded, its watch following the store every ``poll`` seconds (None: only when it audits);
    closing it (or leaving its ``with`` block) closes the auditors it made that are still open
    (``Auditor.close``: the watch and the store). It holds them weakly: a server retires a bundle,
    and closes its auditor, at every promotion, and a retired bundle (its models, its store
    connection) must not live on here until the server stops.

    Entering it with ``bundle`` given opens the store at once, before any model loads: a URL that
    cannot be reached, refused credentials, a store of another schema version or another teacher
    is one line before anything is served or routed."""

    def __init__(self, store: StoreLocation | str | None, share: float, seed: str, on_drift: OnDrift,
                 poll: float | None = None, bundle: Path | None = None) -> None:
        self.store = store_location(store) if store is not None else None
        self.share, self.seed, self.on_drift, self.poll, self.bundle = share, seed, on_drift, poll, bundle
        self._made: weakref.WeakSet[Auditor] = weakref.WeakSet()

    def __call__(self, cascade: Cascade) -> Auditor | None:
        auditor, _ = auditor_for(cascade, self.store, self.share, self.seed, self.on_drift, self.poll)
        if auditor is not None:
            self._made.add(auditor)
        return auditor

    def check(self) -> None:
        """Open the store of ``bundle``'s teacher now (a SQLite file only where it exists)."""
        if self.store is None or self.share == 0 or self.bundle is None:
            return
        if is_url(self.store) or store_exists(self.store):
            teacher = bundle_teacher(Bundle.load(self.bundle, verify=False).manifest)
            LabelStore(self.store, teacher).close()
        poll = f", read for every replica's audits every {self.poll:g} s" if self.poll else ""
        print(f"audits: {self.share:.0%} of routed items into {self.store}{poll}", file=sys.stderr)

    def close(self) -> None:
        for auditor in list(self._made):
            auditor.close()

    def __enter__(self) -> StoreAudits:
        self.check()
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


@dataclass(frozen=True)
class QuestionAudit:
    """One question's audit under the bundle's calibration, and its monitor replayed in order."""

    question: str
    monitor: AgreementMonitor
    lowers: list[float]
    agreements: list[float]


@dataclass(frozen=True)
class AuditReport:
    """Each question's audit, and what the store held besides: audits of other calibrations (set
    aside: the alarm watches one calibration), and states audited again (counted once)."""

    questions: list[QuestionAudit]
    stored: int
    other_calibrations: int
    repeated: int


def audit_report(manifest: Manifest, calibration_version: str, path: StoreLocation | str) -> AuditReport:
    """Each bundle question's audited items of this calibration, replayed through its alarm."""
    target, delta = manifest.calibration.certified_target, manifest.calibration.delta
    if manifest.calibration.mode == "budget":
        raise StoreError(f"bundle {manifest.name!r} is calibrated in budget mode (--escalation-fraction), "
                         "which certifies no agreement: there is no target for a drift alarm to watch; "
                         "measure its agreement with `cascade evaluate`")
    if target is None or delta is None:
        raise StoreError(f"bundle {manifest.name!r} has no calibration target to audit against; "
                         "run cascade calibrate first")
    records, seen, stored = [], set(), _bundle_audits(manifest, path)
    for record in stored:  # each state once, as the live watch counts it
        if record.calibration_version == calibration_version and record.state_sha256 not in seen:
            seen.add(record.state_sha256)
            records.append(record)
    other = sum(record.calibration_version != calibration_version for record in stored)
    out = []
    for qid in manifest.questions:
        monitor = AgreementMonitor(target, delta)
        lowers, agreements = [], []
        for record in records:
            if qid in record.system and qid in record.teacher:
                monitor.update([record.agreed(qid)])
                lowers.append(monitor.lower)
                agreements.append(monitor.agreement or 0.0)
        out.append(QuestionAudit(qid, monitor, lowers, agreements))
    return AuditReport(out, len(stored), other, len(stored) - other - len(records))


def _bundle_audits(manifest: Manifest, path: StoreLocation | str) -> list[AuditRecord]:
    """The audits of the store at ``path``, refused in one line where there is no store (a
    mistyped path read as "quiet" before) or its teacher is not the bundle's (its audits are not
    of this bundle: a server's sink refuses to write them there)."""
    location = store_location(path)
    if not store_exists(location):
        raise StoreError(f"no label store at {location}: give the --audit-store that `cascade serve` or "
                         "`cascade decide` wrote its audits to")
    with LabelStore.open_existing(location) as store:
        if store.teacher != bundle_teacher(manifest):
            raise StoreMismatchError(f"label store {location} holds labels of the teacher "
                                     f"{store.teacher.model}, not of bundle {manifest.name!r}'s "
                                     f"({manifest.teacher.model}): its audits are not this bundle's; give "
                                     "the store it audits to")
        return store.audits()


def drift_alarms(manifest: Manifest, records: Iterable[AuditRecord]) -> dict[str, AuditRecord]:
    """Per question, the audit at which its drift alarm rose under this bundle's calibration, as
    the server's watch raises it (``records`` in the store's order): none where no alarm rose."""
    calibration = manifest.calibration
    if calibration.certified_target is None or calibration.delta is None:
        return {}
    watch = DriftWatch(manifest.questions, calibration.certified_target, calibration.delta,
                       calibration.version())
    return {qid: record for record in records for qid in watch.observe(record)}


def plot_audit(rows: list[QuestionAudit], target: float, path: Path) -> Path:
    """Agreement and its anytime lower bound over the audited items, per question, the target, and
    where an alarm rose. (matplotlib is imported here: routing commands audit without plotting.)"""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise StoreError("the audit plot needs matplotlib: pip install -e '.[report]'") from None

    figure = Figure(figsize=(7, 4), dpi=110)
    FigureCanvasAgg(figure)
    ax = figure.subplots()
    for row in rows:
        items = range(1, len(row.lowers) + 1)
        line = ax.plot(items, row.agreements, label=f"{row.question}: agreement")[0]
        ax.plot(items, row.lowers, linestyle="--", color=line.get_color(),
                label=f"{row.question}: anytime lower bound")
        if row.monitor.alarm_at is not None:
            at = row.monitor.alarm_at
            ax.plot([at], [row.agreements[at - 1]], marker="v", markersize=9, color=line.get_color(),
                    linestyle="none", label=f"{row.question}: drift alarm (item {at})")
    ax.axhline(target, color="black", linewidth=1, label=f"target {target}")
    ax.set_xlabel("audited items")
    ax.set_ylabel("agreement with the teacher")
    ax.set_ylim(0, 1.02)
    ax.legend(loc="lower right", fontsize=7)
    ax.set_title("The certificate on audited traffic")
    figure.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, format="png")
    return path
