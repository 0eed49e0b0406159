"""What ``/metrics`` exposes, in Prometheus's text format (the ``prometheus-client`` library).

Counters only ever grow, so shares are left to the scraper (escalation share: top-tier answers
over all answers, ``rate(cascade_answers_total{tier="teacher"}[5m]) / rate(cascade_answers_total[5m])``);
the one share given ready-made, ``cascade_escalation_share``, is over the server's lifetime.
Each server has its own registry, so two in one process (tests) never mix their counts.
"""

from __future__ import annotations

from collections.abc import Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from cascade.answers import DecisionResponse
from cascade.audit.watch import DriftWatch

CONTENT_TYPE = CONTENT_TYPE_LATEST
_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


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
                                   "why: other_teacher, overloaded, budget_limited, not_covered, too_long "
                                   "(kept below: the teacher could not read the state)",
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
        self.audits = Gauge("cascade_audits", "Audits since the server started, by outcome: audited, "
                            "dropped (the audit queue was full), failed, unreadable (the state does not "
                            "fit the teacher's context)", ["outcome"], registry=self.registry)
        self.audited = Gauge("cascade_audited_items", "Audited items counted by a question's drift alarm",
                             ["question"], registry=self.registry)
        self.lower = Gauge("cascade_agreement_lower_bound", "Anytime lower bound on a question's "
                           "agreement with the teacher, from the audit", ["question"], registry=self.registry)
        self.demoted = Gauge("cascade_demoted", "1 where a drift alarm sent a question's answers to the "
                             "teacher", ["question"], registry=self.registry)
        self._given = self._escalated = 0

    def answered(self, response: DecisionResponse, bundle_ids: Mapping[str, str]) -> None:
        """Count one response's answers, by tier, bundle question (``bundle_ids`` maps the
        request's ids to the bundle's: client-chosen names would make unbounded labels) and
        certificate."""
        for qid, answer in response.answers.items():
            routing = answer.routing
            if routing is None:
                continue
            self.answers.labels(routing.tier, bundle_ids.get(qid, "(not in bundle)")).inc()
            reason = ("too_long" if self.top_tier in routing.too_long_for else
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
        """The audit's counts and, per question, its drift alarm's state."""
        for outcome, n in counts.items():
            self.audits.labels(outcome).set(n)
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
