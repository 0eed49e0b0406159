"""What ``/metrics`` exposes, in Prometheus's text format (the ``prometheus-client`` library).

Counters only ever grow, so shares are left to the scraper (escalation share: top-tier answers
over all answers, ``rate(cascade_answers_total{tier="teacher"}[5m]) / rate(cascade_answers_total[5m])``);
the one share given ready-made, ``cascade_escalation_share``, is over the server's lifetime.
Each server has its own registry, so two in one process (tests) never mix their counts.

Every running total is a Prometheus counter (``NAME_total``), so ``rate()`` and ``increase()``
apply: the ones counted here, and the ones their owners keep (the upstream's ledger, the
escalation collector, the bundle watch, each engine's audits and abandoned jobs), read at a
scrape and exported through a ``Total`` (a collector yielding a counter family). They count since
the server started: a swap keeps the server's metrics, and the engines' totals are added up, a
retired engine's included (its last audits still count), from the first scrape that found it
serving (so a bundle swapped out again before any scrape saw it is not counted). What is a state
rather than a total stays a gauge (the queues, the drift alarm's items, its bound, the certificate).
The series per bundle version are kept for the serving bundle and the few it replaced last
(``RETIRED_SERIES``), so that a server promoted every hour does not grow its scrape for ever.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from cascade.answers import DecisionResponse
from cascade.audit.watch import DriftWatch
from cascade.backoff import down_for
from cascade.cost.upstream import Ledger
from cascade.serve.totals import DROP_REASONS, Totals

if TYPE_CHECKING:
    from cascade.collect.collector import Collector
    from cascade.collect.escalation import EscalationRecord
    from cascade.routing.router import Cascade
    from cascade.serve.engine import Engine
    from cascade.serve.swap import BundleWatch, Version

CONTENT_TYPE = CONTENT_TYPE_LATEST
RETIRED_SERIES = 3
"""Replaced bundle versions whose series (``cascade_bundle_info`` at 0,
``cascade_version_requests_total``) stay in the scrape: enough to see a swap and the requests the
last bundles answered; each promotion would otherwise add two series for as long as the server runs."""
_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Total:
    """A running total its owner keeps, exported as a Prometheus counter (``NAME_total``): ``set``
    at a scrape to what the owner counts, by label values, and yielded as a counter family. The
    owner's count only grows, which is what makes it a counter."""

    def __init__(self, name: str, documentation: str, labels: Sequence[str] = (),
                 registry: CollectorRegistry | None = None) -> None:
        self.name, self.documentation, self.labels = name, documentation, list(labels)
        self._values: dict[tuple[str, ...], float] = {}
        if registry is not None:
            registry.register(self)

    def set(self, value: float, *labels: str) -> None:
        if len(labels) != len(self.labels):
            raise ValueError(f"{self.name} takes the labels {self.labels}; got {list(labels)}")
        self._values[labels] = float(value)

    def describe(self) -> Iterator[CounterMetricFamily]:
        yield CounterMetricFamily(self.name, self.documentation, labels=self.labels)

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(self.name, self.documentation, labels=self.labels)
        for labels, value in sorted(self._values.items()):
            family.add_metric(list(labels), value)
        yield family


class ServerMetrics:
    """The server's counters, gauges and histograms."""

    def __init__(self, top_tier: str) -> None:
        self.registry = CollectorRegistry()
        self.top_tier = top_tier
        self.requests = Counter("cascade_requests", "Requests answered, by HTTP status code",
                                ["code"], registry=self.registry)
        self.answers = Counter("cascade_answers", "Answers given, by the tier that gave them and the "
                               "bundle question", ["tier", "question"], registry=self.registry)
        self.uncertified = Counter("cascade_uncertified_answers", "Answers no certificate covers, by "
                                   "why: other_teacher, teacher_changed (the upstream's identity changed: "
                                   "demoted), overloaded, budget_limited, not_covered, too_long (kept below: "
                                   "the teacher could not read the state)",
                                   ["reason"], registry=self.registry)
        self.errors = Counter("cascade_question_errors", "Asked questions left without an answer (x_errors), "
                              "by code and bundle question", ["code", "question"], registry=self.registry)
        self.share = Gauge("cascade_escalation_share", "Share of all answers the top tier gave, since "
                           "the server started", registry=self.registry)
        self.request_seconds = Histogram("cascade_request_seconds", "Seconds from a request's body "
                                         "read to its answer", buckets=_SECONDS, registry=self.registry)
        self.tier_seconds = Histogram("cascade_tier_seconds", "Seconds a tier took per state",
                                      ["tier"], buckets=_SECONDS, registry=self.registry)
        self.queue = Gauge("cascade_queue_depth", "Requests waiting for a tier's worker", ["tier"],
                           registry=self.registry)
        self.audits = Total("cascade_audits", "Audits since the server started, by outcome: audited, "
                            "dropped (by reason: cascade_audits_dropped_total), failed, unreadable (the "
                            "state does not fit the teacher's context)", ["outcome"], registry=self.registry)
        self.audits_dropped = Total("cascade_audits_dropped", "Audits dropped since the server started, by "
                                    "reason: queue_full (--audit-queue audits waited: one drawn at random "
                                    "was dropped), store_behind (as many waited for the store), stopped "
                                    "(left waiting when a bundle's engine stopped)",
                                    ["reason"], registry=self.registry)
        self.audit_sample = Total("cascade_audit_requests", "Answered requests since the server started that "
                                  "the audit sample looked at (eligible: a certificate in force) and chose",
                                  ["count"], registry=self.registry)
        self.audit_routed = Total("cascade_audit_routed", "Eligible answered requests since the server "
                                  "started with a certified answer to a bundle question: the population "
                                  "its audits sample", ["question"], registry=self.registry)
        self.audit_pauses = Total("cascade_audit_pauses", "Audits the upstream teacher answered 429 or 503: "
                                  "each is kept and retried after its Retry-After", registry=self.registry)
        self.audit_known = Total("cascade_audits_answered_above", "Audited items the teacher had "
                                 "answered already (every bundle question escalated): recorded from "
                                 "those answers, with no teacher call", registry=self.registry)
        self.audit_asked = Gauge("cascade_audit_share_asked", "The share of answered requests the audit "
                                 "sample asks for (--audit-share)", registry=self.registry)
        self.audit_realised = Gauge("cascade_audit_share_realised", "Audited over eligible answered "
                                    "requests since the server started", registry=self.registry)
        self.audited = Gauge("cascade_audited_items", "Audited items counted by a question's drift alarm "
                             "(the serving calibration's: a new one starts afresh)",
                             ["question"], registry=self.registry)
        self.lower = Gauge("cascade_agreement_lower_bound", "Anytime lower bound on a question's "
                           "agreement with the teacher, from the audit", ["question"], registry=self.registry)
        self.demoted = Gauge("cascade_demoted", "1 where a drift alarm sent a question's answers to the "
                             "teacher", ["question"], registry=self.registry)
        self.by_version = Counter("cascade_version_requests", "Requests answered, by the bundle and "
                                  "calibration version that answered them", ["bundle", "calibration_version"],
                                  registry=self.registry)
        self.bundle = Gauge("cascade_bundle_info", "1 for the bundle serving new requests, 0 for those it "
                            "replaced", ["bundle", "calibration_version", "manifest_sha256"],
                            registry=self.registry)
        self.swaps = Total("cascade_bundle_swaps", "Promoted bundles this server took, and the ones that "
                           "failed to load (the old one kept serving)", ["outcome"], registry=self.registry)
        self.void = Gauge("cascade_certificate_void", "1 while the upstream teacher's identity differs "
                          "from the bundle's: every question goes upstream, marked demoted",
                          registry=self.registry)
        self.admitted = Gauge("cascade_top_admitted", "Requests admitted to the top tier's queue and not "
                              "yet answered (waiting or in service)", registry=self.registry)
        self.abandoned = Total("cascade_abandoned_requests", "Requests dropped uncomputed because their "
                               "client had gone, since the server started", registry=self.registry)
        self.upstream = Total("cascade_upstream", "Since the server started: requests answered and "
                              "questions asked in them; calls and questions sent upstream for them, and "
                              "for audits; calls and questions not sent (against forwarding every "
                              "request whole)",
                              ["count"], registry=self.registry)
        self.cost = Total("cascade_upstream_cost", "Since the server started, in the --upstream-price "
                          "unit (s: priced by measured latency), each call priced when it was made: what "
                          "the upstream calls cost (spent), and what forwarding every request whole would "
                          "have (forwarded); saved is forwarded - spent", ["kind", "unit"],
                          registry=self.registry)
        self.store_down = Gauge("cascade_store_unavailable_seconds", "Seconds the store has not answered "
                                "a writer (audits, escalations kept), whose writes wait to be retried; 0 "
                                "while it answers", registry=self.registry)
        self.kept = Total("cascade_escalations_kept", "Escalated requests since the server started, by "
                          "what keeping the teacher's answers made of them: collected, not_chosen (outside "
                          "--escalation-share), full (--escalation-max reached), dropped (the write queue "
                          "was full: too many items, or too many bytes, waiting; or the store was still "
                          "down when the server stopped), unreadable, failed (the store refused it)",
                          ["outcome"], registry=self.registry)
        self._given = self._escalated = 0
        self._retired = Totals()  # of the engines retired and let go, folded at each swap
        self._engines: list[tuple[weakref.ref[Engine], Totals]] = []  # of the engines alive
        self._totals: list[Totals] = []  # both: what a scrape adds up (replaced whole, never changed)
        self._versions: list[tuple[str, str, str]] = []  # whose series are shown, the serving one last

    def serving(self, engine: Engine, version: Version | None, replaced: Cascade | None = None) -> None:
        """A bundle's engine now serves new requests (in place of ``replaced``); its totals count
        from now on, and on after it retires."""
        self._fold((weakref.ref(engine), engine.totals))
        cascade = engine.cascade
        self.top_tier = cascade.tiers[-1].name
        sha = version.manifest_sha256 if version is not None else cascade.manifest_sha256
        self.bundle.labels(cascade.manifest.name, cascade.calibration_version, sha).set(1)
        if replaced is not None:
            self.bundle.labels(replaced.manifest.name, replaced.calibration_version,
                               replaced.manifest_sha256).set(0)
        self._shown((cascade.manifest.name, cascade.calibration_version, sha))

    def _fold(self, serving: tuple[weakref.ref[Engine], Totals]) -> None:
        """Fold the totals of the engines let go since (their counts no longer change) into one,
        so that a server keeps one object per engine alive, not one per engine it ever ran."""
        gone = [totals for ref, totals in self._engines if ref() is None]
        self._retired = functools.reduce(Totals.plus, gone, self._retired)
        self._engines = [(ref, totals) for ref, totals in self._engines if ref() is not None] + [serving]
        self._totals = [self._retired, *(totals for _, totals in self._engines)]

    def _shown(self, labels: tuple[str, str, str]) -> None:
        """Keep the per-version series of the serving bundle and the ``RETIRED_SERIES`` last
        replaced; older ones are removed (a bundle swapped back in gets them again)."""
        if labels in self._versions:
            self._versions.remove(labels)
        self._versions.append(labels)
        for name, calibration, sha in self._versions[:-RETIRED_SERIES - 1]:
            with contextlib.suppress(KeyError):
                self.bundle.remove(name, calibration, sha)
            with contextlib.suppress(KeyError):
                self.by_version.remove(name, calibration)
        del self._versions[:-RETIRED_SERIES - 1]

    def scraped(self, engine: Engine, ledger: Ledger, watch: BundleWatch | None,
                escalations: Collector[EscalationRecord] | None = None) -> None:
        """What is read at a scrape: queues, audits, the certificate, the upstream's ledger, the
        escalations kept."""
        self.queues(engine.queue_depths())
        auditor = engine.auditor
        self.watched(self._audits(), auditor.watch if auditor is not None else None)
        self.sampled(auditor.sampler.share if auditor is not None else 0.0)
        self.void.set(float(engine.voided is not None))
        self.abandoned.set(sum(totals.abandoned for totals in self._totals))
        self.admitted.set(engine.admission.inside)
        for name, value in (("requests", ledger.requests), ("asked_questions", ledger.asked),
                            ("calls", ledger.calls), ("sent_questions", ledger.sent),
                            ("audit_calls", ledger.audit_calls), ("audit_questions", ledger.audit_questions),
                            ("saved_calls", ledger.saved_calls), ("saved_questions", ledger.saved_questions)):
            self.upstream.set(value, name)
        self.cost.set(ledger.spent, "spent", ledger.unit)
        self.cost.set(ledger.forwarded, "forwarded", ledger.unit)
        if watch is not None:
            self.swaps.set(watch.swaps, "taken")
            self.swaps.set(watch.failures, "failed")
        for outcome, n in (escalations.counts.items() if escalations is not None else ()):
            self.kept.set(n, outcome)
        self.store_down.set(down_for(engine.store_down, escalations.backoff if escalations else None))

    def _audits(self) -> dict[str, int]:
        """The audits of every engine served, by outcome."""
        added: dict[str, int] = {}
        for totals in self._totals:
            for outcome, n in list(totals.audits.items()):
                added[outcome] = added.get(outcome, 0) + n
        return added

    def sampled(self, asked: float) -> None:
        """The audit sample's share asked for and realised, and what it was drawn from."""
        engines = self._totals
        eligible = sum(totals.eligible for totals in engines)
        audited = sum(totals.audits["audited"] for totals in engines)
        self.audit_asked.set(asked)
        self.audit_realised.set(audited / eligible if eligible else 0.0)
        self.audit_sample.set(eligible, "eligible")
        self.audit_sample.set(sum(totals.chosen for totals in engines), "chosen")
        self.audit_pauses.set(sum(totals.paused for totals in engines))
        self.audit_known.set(sum(totals.answered_above for totals in engines))
        for reason in DROP_REASONS:
            self.audits_dropped.set(sum(totals.dropped[reason] for totals in engines), reason)
        routed: dict[str, int] = {}
        for totals in engines:
            for qid, n in totals.routed.items():
                routed[qid] = routed.get(qid, 0) + n
        for qid, n in routed.items():
            self.audit_routed.set(n, qid)

    def answered(self, response: DecisionResponse, bundle_ids: Mapping[str, str],
                 cascade: Cascade | None = None) -> None:
        """Count one response's answers, by tier, bundle question (``bundle_ids`` maps the
        request's ids to the bundle's: client-chosen names would make unbounded labels) and
        certificate, and the version that answered (``cascade``)."""
        if cascade is not None:
            self.by_version.labels(cascade.manifest.name, cascade.calibration_version).inc()
        for qid, answer in response.answers.items():
            routing = answer.routing
            if routing is None:
                continue
            self.answers.labels(routing.tier, bundle_ids.get(qid, "(not in bundle)")).inc()
            reason = ("too_long" if self.top_tier in routing.too_long_for else
                      "teacher_changed" if routing.demoted and not routing.certified else
                      _uncertified(routing.covered, routing.overloaded, routing.budget_limited,
                                   routing.certified))
            if reason:
                self.uncertified.labels(reason).inc()
            self._given += 1
            self._escalated += routing.tier == self.top_tier
        for qid, error in (response.errors or {}).items():
            self.errors.labels(error.code, bundle_ids.get(qid, "(not in bundle)")).inc()
        self.share.set(self._escalated / self._given if self._given else 0.0)
        for tier, usage in response.usage.tiers.items():
            self.tier_seconds.labels(tier).observe(usage.seconds)

    def queues(self, depths: Mapping[str, int]) -> None:
        for tier, depth in depths.items():
            self.queue.labels(tier).set(depth)

    def watched(self, counts: Mapping[str, int], watch: DriftWatch | None) -> None:
        """The audits' counts since the server started and, per question, its drift alarm's state."""
        for outcome, n in counts.items():
            self.audits.set(n, outcome)
        if watch is None:
            return
        for qid, monitor in watch.monitors.items():
            self.audited.labels(qid).set(monitor.items)
            self.lower.labels(qid).set(monitor.lower)
            self.demoted.labels(qid).set(float(qid in watch.demoted))

    def text(self) -> bytes:
        return generate_latest(self.registry)


def _uncertified(covered: bool, overloaded: bool, budget_limited: bool, certified: bool) -> str | None:
    if not covered:
        return "not_covered"
    if overloaded:
        return "overloaded"
    if budget_limited:
        return "budget_limited"
    return None if certified else "other_teacher"
