"""The external kind: a top tier known only by its labels (another system, gold labels).

A bundle ending in one routes, but answering what the lower tiers escalate needs a teacher GGUF
or a System One URL given at load time, or recorded labels to replay.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from cascade.cost.pricing import TEACHER_PARAMS
from cascade.errors import RouterError
from cascade.readout.placement import Placement
from cascade.readout.scorer import Scorer, branch_slots
from cascade.tiers.base import Build, BundleParts, Excerpt, Tier, TierKind, TierSpec, read_excerpt
from cascade.tiers.gguf import GgufTier
from cascade.tiers.labels import LabelsTier
from cascade.tiers.upstream import upstream_tier


class ExternalSpec(TierSpec):
    """A top tier known only by its labels (gold labels, another system): no model to run.

    A bundle ending in one can still route, but the caller must give a GGUF at decide time to
    answer what the lower tiers escalate.
    """

    top_only: ClassVar[bool] = True

    kind: Literal["external"] = "external"
    name: str = Field(default="teacher", min_length=1)
    labels: str
    n_ctx: int | None = Field(default=None, ge=16)  # the input policy the labels were read with
    excerpt: Excerpt = None


class ExternalKind(TierKind[ExternalSpec]):
    """A teacher known by its labels only: replayed from them, or run from a GGUF given at load."""

    spec = ExternalSpec

    def check_top(self, spec: ExternalSpec, bundle_name: str, build: Build) -> None:
        if build.teacher is None and build.upstream is None and build.labels is None:
            raise RouterError(
                f"bundle {bundle_name!r} ends in the external tier {spec.name!r} (labels "
                f"{spec.labels!r}), which cannot run: give --teacher PATH.gguf or a System One URL "
                "to answer the questions the lower tiers escalate (in the library: teacher=, or "
                "labels= to replay recorded answers)")

    def build(self, spec: ExternalSpec, bundle: BundleParts, build: Build, top: bool) -> Tier:
        if build.labels is not None:
            return LabelsTier(spec.name, build.labels)
        if build.upstream is not None:
            return upstream_tier(spec.name, build)
        if build.teacher is None:
            raise RouterError(f"the external tier {spec.name!r} has no model to run: give a teacher "
                              "GGUF (teacher=) or recorded labels (labels=)")
        place = build.placement(spec.name, Placement(n_ctx=spec.n_ctx))
        questions = bundle.question_count
        excerpt = read_excerpt(spec.excerpt)
        return GgufTier(spec.name, Scorer.placed(build.teacher, place, branch_slots(questions),
                                                    layout=bundle.teacher_layout), excerpt=excerpt)

    def weights(self, spec: ExternalSpec) -> tuple[float, str]:
        return TEACHER_PARAMS, f"external: taken as a {TEACHER_PARAMS / 1e9:.0f}B model"


