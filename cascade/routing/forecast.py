"""What answering will cost, predicted before any tier runs, so a budget can choose what to pay for.

Each tier prices itself (``Tier.pricing``, ``cascade.cost.pricing``), from calibration's
measurements in the manifest (``calibration.costs[tier]``) or else from the roofline at a stored
or measured FLOP/s. Every tier a question reaches is charged in full: no tier reuses another's
work (an escalation from the mid-layer tier runs the whole teacher). What a call really took is in
its ``usage``. See docs/budgets.md.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

from cascade.bundle.manifest import BundleError, Manifest
from cascade.checks import is_finite
from cascade.cost.pricing import TierCost, TierPricing
from cascade.questions import Question
from cascade.readout.prompts import render_state
from cascade.tiers.base import Item, Tier


class CostModel:
    """Predicted seconds of asking a tier some questions about a state, by tier name."""

    def __init__(self, pricing: Mapping[str, TierPricing], questions: Mapping[str, Question]) -> None:
        self.pricing = dict(pricing)
        self.questions = dict(questions)

    @classmethod
    def for_tiers(
        cls, manifest: Manifest, tiers: Sequence[Tier], flops_per_second: float | None = None
    ) -> CostModel:
        """Pricing for a cascade's runtime tiers: measured where the manifest has it, else roofline."""
        throughput = _Throughput(flops_per_second, manifest.calibration.flops_per_second)
        pricing = {}
        for tier in tiers:
            measured = manifest.calibration.costs.get(tier.name)
            if measured is None:
                cost = TierCost(0.0, tier.flops_per_token() / throughput.value, "roofline")
            else:
                cost = TierCost(measured.seconds_per_state, measured.seconds_per_token, "measured")
            pricing[tier.name] = tier.pricing(cost)
        return cls(pricing, manifest.parsed_questions())

    def batch(self, items: Sequence[Item]) -> BatchCost:
        """A cost view of these items that counts each state's tokens once per tier."""
        return BatchCost(self, items)

    def cost(self, tier: str) -> TierCost:
        return self.pricing[tier].cost


class BatchCost:
    """Seconds per (tier, item, questions) for one batch of items, with token counts cached."""

    def __init__(self, model: CostModel, items: Sequence[Item]) -> None:
        self.model = model
        self.texts = [render_state(item.state) for item in items]
        self._prompt: dict[tuple[str, int], int] = {}

    def seconds(self, tier: str, item: int, qids: Collection[str]) -> float:
        """Predicted seconds for ``tier`` to answer ``qids`` about item number ``item``; 0 for none."""
        if not qids:
            return 0.0
        pricing = self.model.pricing[tier]
        key = (tier, item)
        if key not in self._prompt:
            self._prompt[key] = pricing.prompt_tokens(self.texts[item])
        questions = self.model.questions
        tokens = self._prompt[key] + sum(pricing.suffix_tokens(q, questions[q]) for q in qids)
        return pricing.cost.seconds_per_state + tokens * pricing.cost.seconds_per_token


class _Throughput:
    """FLOP/s for roofline costs, measured only if some tier needs it and nothing gave it.

    A stored figure was checked when the manifest loaded (``CalibrationSection``); one given here
    is checked now.
    """

    def __init__(self, given: float | None, stored: float | None) -> None:
        if given is not None and not (is_finite(given) and given > 0):
            raise BundleError(f"flops_per_second must be a finite number > 0; got {given!r}")
        self._value = given if given is not None else stored

    @property
    def value(self) -> float:
        if self._value is None:
            from cascade.cost.roofline import measure_cpu_flops

            self._value = measure_cpu_flops()
        return float(self._value)
