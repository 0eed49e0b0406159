"""What an upstream teacher costs in the user's currency, and what the cascade saved of it.

A hosted decision API charges per request and per question; a colleague's GPU box costs time.
So an upstream is priced as the user says (``UpstreamPrice``: per request, per question, a
unit), or, without a price, by its measured latency: the seconds of a call fitted as a fixed part
plus a part per question sent (least squares over the calls made), in upstream seconds.

What was saved is counted against forwarding every request whole, which is what a client calling
the upstream directly pays: every request a call, every question asked sent. The cascade pays for
the calls it made (only the questions it could not answer) and for its audits.

Both sums are running totals: each request and audit is priced when it happens (without a price,
by the latency fit as it stands then; what was priced is not priced again as the fit moves), so
that both only grow and ``/metrics`` exports them as counters.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass

from cascade.errors import CascadeError


@dataclass(frozen=True)
class UpstreamPrice:
    """``per_request`` and ``per_question`` in ``unit`` (any currency name)."""

    per_request: float = 0.0
    per_question: float = 0.0
    unit: str = "USD"

    @classmethod
    def parse(cls, text: str) -> UpstreamPrice:
        """``request=0.002,question=0.0005,unit=EUR`` (each part optional; unit USD)."""
        parts: dict[str, str] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, sep, value = part.partition("=")
            if not sep or key.strip() not in ("request", "question", "unit"):
                raise CascadeError(f"--upstream-price: {part!r} is not request=X, question=X or unit=NAME; "
                                   "give e.g. request=0.002,question=0.0005,unit=USD")
            key, value = key.strip(), value.strip()
            if key in parts:  # the second silently won
                raise CascadeError(f"--upstream-price: {key} is given twice in {text!r}; give it once")
            if not value:  # an empty unit printed "12  spent"
                example = "USD" if key == "unit" else "0.002"
                raise CascadeError(f"--upstream-price: {key}= is empty; give e.g. {key}={example}")
            parts[key] = value
        try:
            price = cls(float(parts.get("request", 0)), float(parts.get("question", 0)),
                        parts.get("unit", "USD"))
        except ValueError:
            raise CascadeError(f"--upstream-price: the prices in {text!r} must be numbers") from None
        if not all(math.isfinite(v) and v >= 0 for v in (price.per_request, price.per_question)):
            raise CascadeError(f"--upstream-price: prices must be finite and >= 0; got {text!r}")
        return price


@dataclass(frozen=True)
class Ledger:
    """Counts since the server started and their price: ``requests`` answered and ``asked``
    questions in them; ``calls`` and ``sent`` questions that went upstream for them, ``audit_calls``
    and ``audit_questions`` for audits; in ``unit``, what was ``spent`` upstream and what
    forwarding every request whole would have cost (``forwarded``)."""

    requests: int
    asked: int
    calls: int
    sent: int
    audit_calls: int
    audit_questions: int
    spent: float
    forwarded: float
    unit: str

    @property
    def saved(self) -> float:
        return self.forwarded - self.spent

    @property
    def saved_calls(self) -> int:
        return self.requests - self.calls

    @property
    def saved_questions(self) -> int:
        return self.asked - self.sent


class UpstreamLedger:
    """Thread-safe counts of what went upstream, priced by ``price`` or by measured latency."""

    def __init__(self, price: UpstreamPrice | None = None) -> None:
        self.price = price
        self._lock = threading.Lock()
        self._n = [0] * 6  # requests, asked, calls, sent, audit calls, audit questions
        self._fit = [0.0] * 5  # calls, sum q, sum s, sum q*q, sum q*s: seconds ~ a + b * questions
        self._cost = [0.0, 0.0]  # spent, forwarded: each priced when it happened

    def request(self, asked: int, sent: int, seconds: float | None = None) -> None:
        """One answered request of ``asked`` questions, ``sent`` of them upstream in one call
        (0: none went) that took ``seconds``."""
        with self._lock:
            self._n[0] += 1
            self._n[1] += asked
            if sent:
                self._n[2] += 1
                self._n[3] += sent
                self._observe(sent, seconds)
            per_request, per_question, _ = self.rates()
            self._cost[1] += per_request + asked * per_question
            if sent:
                self._cost[0] += per_request + sent * per_question

    def audit(self, questions: int, seconds: float | None = None) -> None:
        """One audit call of ``questions`` questions."""
        with self._lock:
            self._n[4] += 1
            self._n[5] += questions
            self._observe(questions, seconds)
            per_request, per_question, _ = self.rates()
            self._cost[0] += per_request + questions * per_question

    def _observe(self, questions: int, seconds: float | None) -> None:
        if seconds is None or not math.isfinite(seconds):
            return
        for k, v in enumerate((1.0, questions, seconds, questions * questions, questions * seconds)):
            self._fit[k] += v

    def rates(self) -> tuple[float, float, str]:
        """(per request, per question, unit): the price given, else the latency fit in seconds."""
        if self.price is not None:
            return self.price.per_request, self.price.per_question, self.price.unit
        n, sq, ss, sqq, sqs = self._fit
        if n == 0:
            return 0.0, 0.0, "s"
        spread = n * sqq - sq * sq
        if spread <= 1e-9 * max(1.0, n * sqq):  # every call sent as many questions: no slope to fit
            return ss / n, 0.0, "s"
        per_question = max(0.0, (n * sqs - sq * ss) / spread)
        return max(0.0, (ss - per_question * sq) / n), per_question, "s"

    def ledger(self) -> Ledger:
        with self._lock:
            requests, asked, calls, sent, audit_calls, audit_questions = self._n
            spent, forwarded = self._cost
            unit = self.rates()[2]
        return Ledger(requests, asked, calls, sent, audit_calls, audit_questions, spent, forwarded, unit)
