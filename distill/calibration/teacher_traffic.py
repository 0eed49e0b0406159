"""What the cascade sends a teacher behind a URL, counted on labelled items: the calls and the
questions, against forwarding every item whole, and their price where the user gives one.

A cascade in front of an upstream makes one call per item that has any question left after its
cheap tiers, holding only those questions (``cascade.serve.forward``); a client calling the
upstream directly makes one call per item with every question. Calibration counts this on its
certifying items and ``cascade evaluate`` on its evaluation items, so the report says what the
thresholds save in the user's currency before any traffic is served (``/metrics`` counts it live).
"""

from __future__ import annotations

from pydantic import BaseModel

from cascade.cost.upstream import UpstreamPrice


class TeacherTraffic(BaseModel):
    """``items`` answered, ``asked`` questions in them; ``calls`` the items with any question
    left for the teacher, ``sent`` those questions."""

    items: int
    asked: int
    calls: int
    sent: int

    def spent_and_saved(self, price: UpstreamPrice) -> tuple[float, float]:
        """What the calls cost at ``price``, and what they saved against every item sent whole."""
        spent = self.calls * price.per_request + self.sent * price.per_question
        whole = self.items * price.per_request + self.asked * price.per_question
        return spent, whole - spent

    def line(self, price: UpstreamPrice | None = None) -> str:
        """One sentence: the calls and questions saved, and their price where given."""
        calls = 1 - self.calls / self.items if self.items else 0.0
        questions = 1 - self.sent / self.asked if self.asked else 0.0
        text = (f"a teacher behind a URL gets {self.calls} calls for {self.items} items ({calls:.1%} "
                f"saved), {self.sent} of {self.asked} questions sent ({questions:.1%} saved)")
        if price is None:
            return text
        spent, saved = self.spent_and_saved(price)
        return f"{text}; at the given price {spent:.4g} {price.unit} spent, {saved:.4g} {price.unit} saved"
