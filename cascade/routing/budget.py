"""A routing call's state: the budget it may spend and each question's answer so far.

``cascade.routing.router`` moves questions up the tiers; what it moves lives here, so that a server can
hold many calls at once and hand each from one tier's worker to the next.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from cascade.answers import Readout, Usage
from cascade.checks import is_finite, is_real
from cascade.errors import RequestError
from cascade.routing.forecast import BatchCost
from cascade.tiers.base import Item


class Budget(BaseModel):
    """What one call may spend; None leaves that bound off.

    ``ms_per_call``: predicted milliseconds per state; a batch pools ``ms_per_call x states``, so
    its least confident questions escalate first wherever they are. ``max_escalation_fraction``:
    the most the top tier may answer, as a share of all questions asked in the call (those with
    no lower tier to answer them count, and go up regardless, marked ``routing.over_budget``
    past the share).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    ms_per_call: float | None = None
    max_escalation_fraction: float | None = None

    def __init__(self, /, **data: Any) -> None:  # positional self: a client's key may be 'self'
        try:
            super().__init__(**data)
        except ValidationError as exc:
            problems = "; ".join(
                f"budget.{'.'.join(str(p) for p in e['loc'])}: {e['msg'].removeprefix('Value error, ')}"
                for e in exc.errors())
            raise RequestError(problems) from None

    @field_validator("ms_per_call", mode="before")
    @classmethod
    def _positive(cls, value: Any) -> Any:
        if value is not None and not (is_finite(value) and value > 0):
            raise ValueError(f"must be a finite number of milliseconds > 0, or None; got {value!r}")
        return value

    @field_validator("max_escalation_fraction", mode="before")
    @classmethod
    def _fraction(cls, value: Any) -> Any:
        if value is not None and not (is_real(value) and 0 <= value <= 1):
            raise ValueError(f"must be a number in [0, 1], or None; got {value!r}")
        return value


@dataclass
class Pick:
    """The current answer to one question about one state, from the highest tier asked so far."""

    tier: int
    raw: np.ndarray
    probs: np.ndarray
    score: float  # what the threshold is compared with: ``threshold_score`` of ``raw``
    threshold: float | None
    calibrated: bool
    readout: Readout | None = None
    cut: str | None = None
    tokens: int = 0  # what the tier read to answer it (the state, or the question's prompts)
    budget_limited: bool = False
    overloaded: bool = False

    @property
    def accepted(self) -> bool:
        """Thresholds are certified on the tier's raw score (by ``cascade calibrate``)."""
        return self.threshold is not None and self.score >= self.threshold

    @property
    def doubt(self) -> tuple[float, float]:
        """What orders escalations under a budget: the smaller, the sooner it escalates.

        First, how far the raw score falls short of its threshold, negated: a distance on
        the scale the threshold was certified on, which means the same for a yes/no question as
        for a 16-way one, where a confidence (raw or calibrated) does not (0.6 is sure among 16
        options, a coin toss between 2). An answer without a threshold has no certified level
        to fall short of and comes first. Then the top probability's distance from a uniform
        guess, as a share of the way to certainty, so that option counts cancel there too.
        """
        top, k = float(self.raw.max()), len(self.raw)
        shortfall = math.inf if self.threshold is None else self.threshold - self.score
        return -shortfall, (top - 1 / k) / (1 - 1 / k)


@dataclass
class Run:
    """One routing call's state: answers so far, what each tier is asked and answered, what each
    tier was predicted to cost and took, the budget spent (predicted seconds, top answers), and
    ``at``, the next tier to ask (tiers are asked once each, lowest first)."""

    items: Sequence[Item]
    asked: Sequence[Sequence[str]]
    budget: Budget
    costs: BatchCost
    n_tiers: int
    picks: list[dict[str, Pick]] = field(init=False)
    queued: list[list[list[str]]] = field(init=False)  # tier -> item -> question ids to ask it
    answered: list[list[list[str]]] = field(init=False)  # tier -> item -> question ids answered
    took: list[list[float]] = field(init=False)  # tier -> item -> seconds measured
    over_budget: set[tuple[int, str]] = field(default_factory=set)  # (item, question)
    unfamiliar: set[int] = field(default_factory=set)  # items the encoder's gate sent up
    too_long: set[tuple[int, int]] = field(default_factory=set)  # (tier, item): state past its context
    errors: dict[tuple[int, str], str] = field(default_factory=dict)  # (item, question): no answer, why
    usage: list[Usage] = field(init=False)
    spent: float = 0.0
    top_used: int = 0
    at: int = 0

    def __post_init__(self) -> None:
        self.picks = [{} for _ in self.items]
        self.queued = [[[] for _ in self.items] for _ in range(self.n_tiers)]
        self.answered = [[[] for _ in self.items] for _ in range(self.n_tiers)]
        self.took = [[0.0 for _ in self.items] for _ in range(self.n_tiers)]
        self.usage = [Usage(questions=len(qids)) for qids in self.asked]


def allowance(budget: Budget, run: Run, top: bool) -> tuple[float, float]:
    """The call's predicted seconds (pooled over its items) and, when escalating to the top
    tier, the number of questions that tier may answer; inf where the budget sets no bound."""
    seconds = math.inf
    if budget.ms_per_call is not None:
        seconds = budget.ms_per_call * len(run.items) / 1e3 * (1 + 1e-9)  # float slack
    share = math.inf
    if top and budget.max_escalation_fraction is not None:
        share = math.floor(budget.max_escalation_fraction * sum(map(len, run.asked)) + 1e-9)
    return seconds, share
