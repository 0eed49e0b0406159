"""Auditing one routed item: the teacher answers every bundle question, the record is written,
and the drift watch counts it (with a shared stream, in the stream's order: ``cascade.audit.stream``).

``Cascade.decide`` callers (``cascade decide``) audit inline, on the thread that routed; the server
reads the teacher on the top tier's worker at the lowest priority (``ask``) and writes the record
on a thread of its own (``audit`` with the answers), so that no worker waits for the store
(``cascade.serve.engine``). Only a live GGUF teacher can audit: with recorded labels as the top
tier there is nothing new to learn.

An item the cascade sent up on every bundle question already carries the teacher's answers (the
top tier is never temperature-scaled: they are its raw distributions), so its audit records
those and asks the teacher nothing (``answered_above``): a second readout of the same item would
cost a teacher call and could only disagree with the first by the teacher's own batch noise.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Mapping

from cascade.answers import DecisionResponse, NoulAnswer
from cascade.audit.record import AuditRecord, AuditSink, certified_answers
from cascade.audit.sample import AuditSampler
from cascade.audit.stream import AuditStream, StreamFollower
from cascade.audit.watch import DriftWatch, OnDrift
from cascade.errors import CascadeError
from cascade.routing.router import Cascade
from cascade.tiers.base import Item

log = logging.getLogger("cascade.audit")
Known = tuple[dict[str, dict[str, float]], dict[str, str]]
"""The teacher's distribution by option key per bundle question, and the prompt hash of each."""


class Auditor:
    """Audits a ``sampler``'s share of a cascade's items into ``sink``, watched by a ``DriftWatch``
    (None where the bundle has no calibration target to watch).

    ``stream``: where the watch reads every writer's audits from (the store ``sink`` writes to,
    shared by replicas): the watch then counts the stream in its order, this process's audits
    among the others', and ``follower`` keeps it caught up. None: the watch counts this process's
    records as it writes them. ``closing``: what else ``close`` lets go of (the store's connection
    the sink holds), so that a server that retires a bundle at each promotion keeps none open."""

    def __init__(self, cascade: Cascade, sampler: AuditSampler, sink: AuditSink,
                 on_drift: OnDrift = "demote", stream: AuditStream | None = None,
                 closing: Callable[[], None] | None = None) -> None:
        if not cascade.tiers[-1].reads_any_question:
            raise CascadeError(f"auditing needs a live teacher as the top tier; {cascade.tiers[-1].name!r} "
                               "replays recorded labels (give --teacher PATH.gguf, or --audit-share 0)")
        if not cascade.certified:
            raise CascadeError("auditing needs the teacher the thresholds were certified against; "
                               "--accept-other-teacher runs another (give --audit-share 0)")
        self.cascade, self.sampler, self.sink = cascade, sampler, sink
        calibration = cascade.manifest.calibration
        self.watch = None
        if calibration.certified_target is not None and calibration.delta is not None:
            self.watch = DriftWatch(cascade.questions, calibration.certified_target, calibration.delta,
                                    cascade.calibration_version, on_drift)
            cascade.demoted = self.watch.demoted
        self.follower: StreamFollower | None = None
        if self.watch is not None and stream is not None:
            watch = self.watch
            self.follower = StreamFollower(watch, stream, lambda qid: self._report(watch, qid))
        self.audited = 0
        self.unreadable = 0
        self.run_id = uuid.uuid4().hex[:12]
        self.routed: dict[str, int] = dict.fromkeys(cascade.questions, 0)
        self._routing = threading.Lock()
        self._closing = closing

    def route(self, response: DecisionResponse, bundle_ids: Mapping[str, str]) -> dict[str, int]:
        """Count an answered item among the routed ones (per bundle question it has a certified
        answer to: what the alarm watches) and return the counts so far, this item's included:
        logged with each audit, they tell estimators the population the audits were drawn from."""
        certified = certified_answers(response.answers, bundle_ids)
        with self._routing:
            for qid in certified:
                self.routed[qid] = self.routed.get(qid, 0) + 1
            return dict(self.routed)

    def replay(self, records: list[AuditRecord] | None = None) -> None:
        """Count records written before (a restart): a question demoted stays demoted. With a
        stream, ``records`` is None: the stream is read from its start."""
        if self.follower is not None:
            self.follower.catch_up()
        elif self.watch is not None:
            for record in records or []:
                self.watch.observe(record)

    def close(self) -> None:
        """Stop following the stream (where ``follower.follow`` started a thread) and let go of
        ``closing``'s resources; once (a second call does nothing more)."""
        if self.follower is not None:
            self.follower.close()
        closing, self._closing = self._closing, None
        if closing is not None:
            closing()

    def audit(self, item: Item, response: DecisionResponse, bundle_ids: Mapping[str, str],
              survival: float = 1.0, routed: Mapping[str, int] | None = None,
              answers: Known | None = None) -> AuditRecord | None:
        """Record the teacher's answer to every bundle question about ``item`` (those ``response``
        holds where it holds all, else read now); ``response`` is what the system answered,
        ``bundle_ids`` maps its question ids to the bundle's. ``survival``: the chance
        the audit survived a full queue's random drops (1: audited inline), logged times the share
        as the item's inclusion probability, with ``routed`` (``route``'s counts); ``answers``: the
        teacher's, read already (``ask``). None (said once per run, counted in ``unreadable``)
        when the teacher's context cannot hold the state: nothing to compare with."""
        known = answers or self.answered_above(response, bundle_ids)
        if known is None:
            known = self.ask(item)
            if known is None:
                return None
        teacher, hashes = known
        record = AuditRecord(
            item_id=f"audit:{self.run_id}:{item.id}", state=item.state,
            calibration_version=self.cascade.calibration_version, at=time.time(), teacher=teacher,
            prompt_hashes=hashes, system=certified_answers(response.answers, bundle_ids),
            inclusion=self.sampler.share * survival, routed=dict(routed or {}))
        self.sink(record)
        self.audited += 1
        if self.follower is not None:  # this record, and every one the store put before it
            self.follower.catch_up()
        elif self.watch is not None:
            for qid in self.watch.observe(record):
                self._report(self.watch, qid)
        return record

    def answered_above(self, response: DecisionResponse, bundle_ids: Mapping[str, str]) -> Known | None:
        """The teacher's answers to every bundle question, with their prompt hashes, where
        ``response`` holds them (the top tier answered each: an audit then asks nothing); None
        where any is missing (a question not asked, answered below, or unreadable)."""
        top = self.cascade.tiers[-1].name
        teacher: dict[str, dict[str, float]] = {}
        hashes: dict[str, str] = {}
        for qid, answer in response.answers.items():
            bundle_qid = bundle_ids.get(qid)
            if bundle_qid is None or answer.routing is None or answer.routing.tier != top:
                continue
            keys = self.cascade.questions[bundle_qid].option_keys()
            if isinstance(answer, NoulAnswer):
                probabilities = [answer.noul, 1.0 - answer.noul]
            elif list(answer.probabilities) == keys:
                probabilities = list(answer.probabilities.values())
            else:
                continue
            teacher[bundle_qid] = dict(zip(keys, map(float, probabilities), strict=True))
            if answer.readout is not None and answer.readout.prompt_hash:
                hashes[bundle_qid] = answer.readout.prompt_hash
        return (teacher, hashes) if set(teacher) == set(self.cascade.questions) else None

    def ask(self, item: Item) -> Known | None:
        """The teacher's answers to every bundle question about ``item``, read now; None (said
        once per run, counted in ``unreadable``) where its context cannot hold the state."""
        qids = list(self.cascade.questions)
        reply = self.cascade.tiers[-1].reply([item], [qids], self.cascade.questions)
        if reply.too_long[0] is not None:
            if not self.unreadable:
                log.warning("audit: the teacher cannot read item %r (%s); such items are not audited",
                            item.id, reply.too_long[0])
            self.unreadable += 1
            return None
        teacher = {qid: dict(zip(self.cascade.questions[qid].option_keys(), map(float, reply.answers[0][qid]),
                                 strict=True)) for qid in qids}
        return teacher, {qid: r.prompt_hash for qid, r in reply.readouts[0].items()}

    @staticmethod
    def _report(watch: DriftWatch, qid: str) -> None:
        then = ("its answers now escalate to the teacher until a calibration certifies it again"
                if watch.on_drift == "demote" else "reported only (--on-drift alarm)")
        log.warning("drift alarm on question %r: %s; %s", qid, watch.monitors[qid].explain(), then)
