"""What answering will cost, predicted before any tier runs, so a budget can choose what to pay for.

A tier charges ``seconds_per_state`` for each state it reads and ``seconds_per_token`` for each
token it runs. The encoder tier runs a state's tokens once for all its questions. A readout tier
prefills a state once and fans its questions out, so the first question of a state escalated to
it pays the prompt (template + state) and its own suffix, and every further question of that
state only its suffix (the question block, once per option order).

Figures come from measurements when calibration stored them in the manifest
(``calibration["costs"][tier] = {"seconds_per_state", "seconds_per_token"}``), else from the
roofline: FLOPs = 2 x weights x tokens (``cost.decision_flops``) at a throughput (FLOP/s) given
by the caller, stored in the manifest as ``calibration["flops_per_second"]``, or measured here
once with numpy (``cost.measure_cpu_flops``). Predictions
serve to rank and to budget; what a call really took is in its ``usage``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cascade.bundle import BundleError, GgufTier, Manifest
from cascade.prompts import PromptTemplate, question_block, render_state
from cascade.questions import Question
from cascade.tiers import HeadsTier, Item, LabelsTier, ReadoutTier, Tier

TEACHER_PARAMS = 4.0e9
"""Weights assumed for an external teacher known only by its labels: the 4B decision model
(Qwen3.5-4B) this project is built around, so a cost ratio against it is the one that matters."""
CHARS_PER_TOKEN = 4.0
"""Where no tokenizer is loaded, a state costs len(text) / 4 tokens: the usual rule of thumb for
English under BPE vocabularies (a ~10-20% error either way; it only ranks and budgets)."""
COSTS_KEY = "costs"
THROUGHPUT_KEY = "flops_per_second"

TokenCounter = Callable[[Sequence[str]], list[int]]


@dataclass(frozen=True)
class TierCost:
    """Seconds a tier takes per state read and per token run; ``source`` says how it was known."""

    seconds_per_state: float
    seconds_per_token: float
    source: str = "measured"


def estimate_tokens(texts: Sequence[str]) -> list[int]:
    """``ceil(len / CHARS_PER_TOKEN)`` tokens per text, at least one."""
    return [max(1, math.ceil(len(text) / CHARS_PER_TOKEN)) for text in texts]


@dataclass
class TierPricing:
    """One tier's cost figures and how it counts tokens.

    ``fanout`` tiers (logit readout) charge prompt + per-question suffix tokens; the others (the
    encoder) charge the state's tokens once, whatever the number of questions.
    """

    cost: TierCost
    count_tokens: TokenCounter
    fanout: bool
    permutations: int = 1
    template: PromptTemplate = field(default_factory=lambda: PromptTemplate("plain"))
    _suffix: dict[str, int] = field(default_factory=dict)
    _overhead: int | None = None

    def prompt_tokens(self, state_text: str) -> int:
        """Tokens of the shared prompt part: the state, plus the template around it for a readout."""
        if not self.fanout:
            return self.count_tokens([state_text])[0]
        if self._overhead is None:
            self._overhead = self.count_tokens([self.template.render("", "")])[0]
        return self._overhead + self.count_tokens([state_text])[0]

    def suffix_tokens(self, qid: str, question: Question) -> int:
        """Tokens one question adds to a readout: its block, once per option order."""
        if not self.fanout:
            return 0
        if qid not in self._suffix:
            block = question_block(question, list(range(len(question.option_keys()))))
            self._suffix[qid] = self.count_tokens([block])[0] * self.permutations
        return self._suffix[qid]


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
        throughput = _Throughput(flops_per_second, manifest.calibration.get(THROUGHPUT_KEY))
        measured = manifest.calibration.get(COSTS_KEY, {})
        specs = {spec.name: spec for spec in manifest.tiers}
        pricing = {}
        for tier in tiers:
            cost = _measured(measured, tier.name)
            if cost is None:
                cost = _roofline_cost(_flops_per_token(tier, specs[tier.name]), throughput)
            pricing[tier.name] = _pricing(tier, specs[tier.name], cost)
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
    """FLOP/s for roofline costs, measured only if some tier needs it and nothing gave it."""

    def __init__(self, given: float | None, stored: Any) -> None:
        self._value = given if given is not None else stored
        if self._value is not None and not _is_positive(self._value):
            raise BundleError(f"flops_per_second must be a finite number > 0; got {self._value!r} "
                              f"(argument, or the manifest's calibration[{THROUGHPUT_KEY!r}])")

    @property
    def value(self) -> float:
        if self._value is None:
            from cascade.cost import measure_cpu_flops

            self._value = measure_cpu_flops()
        return float(self._value)


def _is_positive(value: Any) -> bool:
    return (isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
            and value > 0)


def _measured(table: Any, name: str) -> TierCost | None:
    """The manifest's measured cost of a tier, checked: a bad figure would silently misroute."""
    if not isinstance(table, Mapping) or name not in table:
        return None
    row = table[name]
    fields = ("seconds_per_state", "seconds_per_token")
    valid = isinstance(row, Mapping) and all(
        isinstance(row.get(f), int | float) and not isinstance(row.get(f), bool)
        and math.isfinite(row[f]) and row[f] >= 0 for f in fields)
    if not valid:
        raise BundleError(f"manifest calibration[{COSTS_KEY!r}][{name!r}] must be an object with "
                          f"finite numbers >= 0 for {list(fields)}; got {row!r}; re-run calibration")
    return TierCost(float(row["seconds_per_state"]), float(row["seconds_per_token"]), "measured")


def _flops_per_token(tier: Tier, spec: Any) -> float:
    """FLOPs each prompt token costs a tier, for the roofline.

    GGUF tiers: ``cost.decision_flops`` of one token, read from the file's shape (the output rows
    read and the attention growth past the first token are left out: a few % for decisions).
    An external teacher: 2 x TEACHER_PARAMS. The encoder: 2 x its ONNX file size in bytes, since
    the file holds at least one byte per weight (int8; fp16 2, fp32 4); an over-estimate of a
    tier that costs ~1000x less than the teacher.
    """
    if isinstance(tier, HeadsTier):
        return 2.0 * Path(tier.encoder.files.model).stat().st_size
    if isinstance(tier, ReadoutTier):
        return _gguf_flops_per_token(tier.scorer.model.path)
    if isinstance(spec, GgufTier):
        return _gguf_flops_per_token(Path(spec.model.path))
    return 2.0 * TEACHER_PARAMS


def _gguf_flops_per_token(path: Path) -> float:
    from cascade.cost import ModelShape, decision_flops

    return decision_flops(ModelShape.from_gguf(path), prompt_tokens=1, output_rows=0)


def _roofline_cost(flops_per_token: float, throughput: _Throughput) -> TierCost:
    return TierCost(0.0, flops_per_token / throughput.value, "roofline")


def _pricing(tier: Tier, spec: Any, cost: TierCost) -> TierPricing:
    if isinstance(tier, HeadsTier):
        return TierPricing(cost, tier.encoder.token_counts, fanout=False)
    if isinstance(tier, ReadoutTier):
        model = tier.scorer.model
        return TierPricing(cost, lambda texts: [len(model.tokenize(t)) for t in texts], fanout=True,
                           permutations=tier.permutations, template=tier.scorer.template)
    permutations = spec.permutations if isinstance(spec, GgufTier) else 1
    if not isinstance(tier, LabelsTier):
        raise BundleError(f"tier {tier.name!r} is a {type(tier).__name__}; the cost model knows "
                          "HeadsTier, ReadoutTier and LabelsTier")
    return TierPricing(cost, estimate_tokens, fanout=True, permutations=permutations)
