"""The tier registry: every kind a manifest may name is registered once, and a kind's registration
alone decides how its tier is built, answers and is priced: the router and the cost model ask the
tier, never which class it is.

The stand-in kind here replaces the GGUF registration for one test, so a bundle with a GGUF middle
tier routes through a tier defined in this file, with no llama.cpp model anywhere.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import pytest
from bundles import MIDDLE, TOP, write_bundle

from cascade.answers import ChoiceAnswer, NoulAnswer
from cascade.bundle.manifest import Bundle
from cascade.cost.pricing import TEACHER_PARAMS, TierCost, TierPricing, estimate_tokens
from cascade.errors import RouterError
from cascade.pins import ModelFile
from cascade.questions import Question
from cascade.routing.router import Cascade
from cascade.tiers.base import KINDS, Answers, Asked, Build, Item, Tier, TierKind, register
from cascade.tiers.gguf import GgufKind, GgufSpec
from cascade.tiers.kinds import TIER_SPECS, kind_of
from cascade.tiers.labels import LabelsTier

FLOPS = 1e9
ROWS = {"urgent": [0.9, 0.1], "team": [0.55, 0.45]}
LABELS = {"urgent": {"i1": {"true": 0.3, "false": 0.7}}, "team": {"i1": {"billing": 0.1, "technical": 0.9}}}


def test_every_manifest_kind_is_registered_exactly_once() -> None:
    kinds = [spec.model_fields["kind"].default for spec in TIER_SPECS]
    assert len(kinds) == len(set(kinds)) == len(KINDS)
    for spec, kind in zip(TIER_SPECS, kinds, strict=True):
        assert KINDS[kind].spec is spec
    with pytest.raises(ValueError, match="tier kind 'gguf' is already registered"):
        register(GgufKind())


class Constant(Tier):
    """Answers every question it is asked with the same distribution, at a fixed roofline price."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.closed = False

    def answer(self, items: Sequence[Item], asked: Asked, questions: Mapping[str, Question]) -> Answers:
        return [{qid: np.asarray(ROWS[qid]) for qid in qids} for qids in asked]

    def flops_per_token(self) -> float:
        return 1e6

    def pricing(self, cost: TierCost) -> TierPricing:
        return TierPricing(cost, estimate_tokens, fanout=False)

    def close(self) -> None:
        self.closed = True


class ConstantKind(TierKind[GgufSpec]):
    spec = GgufSpec

    def __init__(self) -> None:
        self.built: list[Constant] = []

    def build(self, spec: GgufSpec, bundle: Bundle, build: Build, top: bool) -> Tier:
        self.built.append(Constant(spec.name))
        return self.built[-1]

    def weights(self, spec: GgufSpec) -> tuple[float, str]:
        return 5e5, "stand-in"


def test_a_registration_decides_how_a_tier_is_built_answers_and_is_priced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    kind = ConstantKind()
    monkeypatch.setitem(KINDS, "gguf", kind)
    thresholds = {qid: {MIDDLE: 0.8} for qid in ROWS}
    directory = write_bundle(tmp_path / "bundle", thresholds=thresholds)
    text = "My payouts have been failing for three days."
    with Cascade.load(directory, labels=LABELS, flops_per_second=FLOPS) as cascade:
        assert [type(tier) for tier in cascade.tiers] == [Constant, LabelsTier]
        assert kind_of(cascade.manifest.tiers[0]) is kind
        (response,) = cascade.decide_batch([Item("i1", text)])
        assert cascade.costs.cost(MIDDLE) == TierCost(0.0, 1e6 / FLOPS, "roofline")
        assert cascade.costs.cost(TOP) == TierCost(0.0, 2 * TEACHER_PARAMS / FLOPS, "roofline")
    assert kind.built[-1].closed
    urgent, team = response.answers["urgent"], response.answers["team"]
    assert isinstance(urgent, NoulAnswer) and isinstance(team, ChoiceAnswer)
    assert urgent.routing is not None and team.routing is not None
    assert (urgent.routing.tier, urgent.noul) == (MIDDLE, pytest.approx(0.9))
    assert (team.routing.tier, team.choice) == (TOP, "technical")
    tokens = math.ceil(len(text) / 4)
    assert response.usage.tiers[MIDDLE].predicted_seconds == pytest.approx(tokens * 1e6 / FLOPS)


def test_a_kind_nobody_registered_is_refused_by_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(KINDS, "gguf")
    with pytest.raises(RouterError, match="tier 'small' is of kind 'gguf', which no TierKind registers"):
        Cascade.load(write_bundle(tmp_path / "bundle"), labels=LABELS, flops_per_second=FLOPS)


def test_a_pinned_top_tier_takes_its_own_file_as_the_teacher_and_refuses_another(
    gemma_path: Path, tmp_path: Path
) -> None:
    """The manual builds a bundle with --teacher-model (a pinned top tier) and then serves it with
    --teacher naming the same model: that is no conflict. Another model is, before any load."""
    spec = GgufSpec(name="teacher", model=ModelFile.of(gemma_path))
    GgufKind().check_top(spec, "b", Build(teacher=gemma_path))
    other = tmp_path / "other.gguf"
    other.write_bytes(b"GGUF not the pinned model")
    with pytest.raises(RouterError, match=r"runs its pinned GGUF .* the teacher given, .*other.gguf "
                       r"\(sha256 [0-9a-f]{12}\.\.\.\), is another model: drop --teacher"):
        GgufKind().check_top(spec, "b", Build(teacher=other))
