"""The registry of tier kinds: how each kind a manifest names becomes a runtime tier, once.

A kind is the manifest's ``"kind"`` of a tier ("encoder", "gguf", "mid-layer", "external"). Its
parts live in three places, none of which tests which kind it has: the manifest spec
(``cascade.tier_specs``: its fields, the model files it pins, where in the cascade it may stand),
the runtime tier (``cascade.tiers``: how it answers and what it costs) and its ``TierKind`` here,
registered in ``KINDS``, which builds the one from the other for a bundle. The router, the cost model,
calibration and the report ask these, the way RouteLLM's controller looks its routers up in a
dict: adding a kind is a spec, a tier and one registration, with nothing to edit elsewhere.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Generic, TypeVar

from cascade.bundle import Bundle, Manifest, read_heads
from cascade.encoder import Device, EmbeddingCache, Encoder
from cascade.errors import BundleError, CascadeError
from cascade.familiar import FamiliarityGate
from cascade.heads import SoftmaxHead
from cascade.layer_readout import LayerAnswers, LayerScorer, LetterLens
from cascade.placement import Placement, Placements, for_tier
from cascade.pricing import TEACHER_PARAMS
from cascade.prompts import Layout, layout_of
from cascade.readout import Scorer, branch_slots
from cascade.tier_specs import EncoderTier, ExternalTier, GgufTier, MidLayerTier, TierSpec
from cascade.tiers import HeadsTier, LabelsTier, LayerTier, ReadoutTier, Tier

Labels = Mapping[str, Mapping[str, Mapping[str, float]]]
"""question id -> item id -> probabilities: the shape of a label store's labels."""


class RouterError(CascadeError, ValueError):
    """A cascade cannot be built as asked: a missing teacher, conflicting arguments, a model given
    for a tier that is not the one the bundle pins."""


@dataclass(frozen=True)
class Build:
    """How to build a bundle's runtime tiers.

    ``teacher`` (a GGUF) answers an external top tier; ``labels`` (recorded answers) replace the
    top tier, whatever its kind. ``device`` and ``cache_dir`` (an embedding cache) are for the
    encoder; ``threads`` for every model; ``placements`` for GGUF tiers (cascade.placement).
    ``encoder`` and ``scorers`` (by tier name) are models already open to reuse: each must be the
    file its tier pins, and a scorer must decode the batches the router's would.
    """

    teacher: Path | None = None
    labels: Labels | None = None
    device: Device = "cpu"
    cache_dir: Path | None = None
    threads: int | None = None
    placements: Placements = None
    encoder: Encoder | None = None
    scorers: Mapping[str, Scorer] = field(default_factory=dict)

    def placement(self, tier: str, default: Placement | None) -> Placement:
        """The tier's placement: what was asked for it, over the bundle's default, over threads."""
        return (for_tier(self.placements, tier) or Placement()).over(default).over(
            Placement(threads=self.threads))


S = TypeVar("S", bound=TierSpec)


class TierKind(ABC, Generic[S]):
    """One kind of tier: its manifest spec, and how it is built and priced from that spec."""

    spec: ClassVar[type[TierSpec]]

    def check_top(self, spec: S, bundle_name: str, build: Build) -> None:
        """Before any model loads: RouterError where this top tier cannot answer as built."""

    @abstractmethod
    def build(self, spec: S, bundle: Bundle, build: Build, top: bool) -> Tier:
        """The runtime tier of ``spec`` in ``bundle``; ``top``: it is the bundle's last tier."""

    @abstractmethod
    def weights(self, spec: S) -> tuple[float, str]:
        """Weights each prompt token multiplies, and where the figure comes from: what prices the
        tier on the roofline where it is not run (a teacher whose labels are replayed)."""


KINDS: dict[str, TierKind[Any]] = {}
"""Manifest kind -> its TierKind, filled by ``register``."""


def register(kind: TierKind[Any]) -> None:
    """Add ``kind`` under its spec's manifest kind; a kind registers once."""
    name = kind.spec.model_fields["kind"].default
    if name in KINDS:
        raise ValueError(f"tier kind {name!r} is already registered ({type(KINDS[name]).__name__})")
    KINDS[name] = kind


def kind_of(spec: TierSpec) -> TierKind[Any]:
    """The registered kind of a manifest's tier."""
    if spec.kind not in KINDS:
        raise RouterError(f"tier {spec.name!r} is of kind {spec.kind!r}, which no TierKind registers; "
                          f"registered: {sorted(KINDS)}")
    return KINDS[spec.kind]


def build_tiers(bundle: Bundle, build: Build, specs: Sequence[TierSpec] | None = None) -> list[Tier]:
    """The runtime tiers of ``specs`` (default: all the bundle's), in order; on a failure the
    tiers built so far are closed before the error goes up."""
    last = bundle.manifest.tiers[-1]
    tiers: list[Tier] = []
    try:
        for spec in bundle.manifest.tiers if specs is None else specs:
            tiers.append(kind_of(spec).build(spec, bundle, build, spec is last))
    except BaseException:
        close_tiers(tiers)
        raise
    return tiers


def close_tiers(tiers: Sequence[Tier]) -> None:
    for tier in tiers:
        tier.close()


class EncoderKind(TierKind[EncoderTier]):
    """The encoder tier: one ONNX sentence embedding per state, the bundle's heads on it."""

    spec = EncoderTier

    def build(self, spec: EncoderTier, bundle: Bundle, build: Build, top: bool) -> Tier:
        encoder = build.encoder
        if encoder is None:
            encoder = Encoder(spec.files(bundle.directory), device=build.device, max_length=spec.max_length,
                              threads=build.threads)
        elif encoder.sha256 != spec.model.sha256 or encoder.max_length != spec.max_length:
            raise RouterError(f"encoder runs {encoder.files.model} (sha256 {encoder.sha256}, max_length "
                              f"{encoder.max_length}); tier {spec.name!r} pins "
                              f"{spec.model_path(bundle.directory)} (sha256 {spec.model.sha256}, "
                              f"max_length {spec.max_length})")
        cache = EmbeddingCache(Path(build.cache_dir), encoder) if build.cache_dir else None
        gate = FamiliarityGate.load(bundle.directory / spec.gate.file.name) if spec.gate else None
        return HeadsTier(spec.name, encoder, bundle.heads, cache, bundle.ngrams, gate)

    def weights(self, spec: EncoderTier) -> tuple[float, str]:
        raise RouterError(f"tier {spec.name!r} is an encoder tier, which is never a bundle's top tier: "
                          "nothing is priced by its weights")


class GgufKind(TierKind[GgufTier]):
    """A logit-readout tier on a pinned GGUF, below the top or as the teacher."""

    spec = GgufTier

    def check_top(self, spec: GgufTier, bundle_name: str, build: Build) -> None:
        if build.teacher is not None:
            raise RouterError(f"bundle {bundle_name!r} already runs its pinned GGUF {spec.model.path} "
                              f"as the top tier {spec.name!r}; drop --teacher / teacher=")

    def build(self, spec: GgufTier, bundle: Bundle, build: Build, top: bool) -> Tier:
        """A readout on the pinned file, or the recorded labels in its place at the top.

        Its scorer decodes the ``questions`` x permutations branches of a state in the groups of
        ``cascade.readout.branch_slots``, wherever it is opened: the batch shape moves the
        numbers, and thresholds must certify the ones routing reads.
        """
        if top and build.labels is not None:
            return LabelsTier(spec.name, build.labels, Path(spec.model.path), spec.permutations)
        questions = len(bundle.manifest.questions)
        branches = branch_slots(questions, spec.permutations)
        given = build.scorers.get(spec.name)
        layout: Layout = teacher_layout(bundle.manifest) if top else "state-first"
        if given is None:
            place = build.placement(spec.name, spec.default_placement())
            scorer = Scorer.placed(spec.model.path, place, branches, spec.template, layout)
            return ReadoutTier(spec.name, scorer, spec.permutations, passes_long=not top)
        if given.layout != layout:
            raise RouterError(f"scorers[{spec.name!r}] reads its prompts {given.layout}, and tier "
                              f"{spec.name!r} was certified on prompts read {layout}; open it with "
                              f"layout={layout!r}")
        if given.model_sha256 != spec.model.sha256:
            raise RouterError(f"scorers[{spec.name!r}] runs {given.model.path} (sha256 "
                              f"{given.model_sha256}); tier {spec.name!r} pins {spec.model.path} "
                              f"(sha256 {spec.model.sha256})")
        needed = questions * spec.permutations
        if min(given.ctx.config.max_branches, needed) != branches:
            raise RouterError(f"scorers[{spec.name!r}] decodes at most {given.ctx.config.max_branches} "
                              f"branches at once, and the router {branches} of the {needed} a state "
                              "needs: the batches would differ, and so would the numbers; open it "
                              f"with max_branches={branches}")
        return ReadoutTier(spec.name, given, spec.permutations, owned=False, passes_long=not top)

    def weights(self, spec: GgufTier) -> tuple[float, str]:
        from cascade.cost import ModelShape

        return float(ModelShape.from_gguf(Path(spec.model.path)).n_params_matmul), spec.model.path


class ExternalKind(TierKind[ExternalTier]):
    """A teacher known by its labels only: replayed from them, or run from a GGUF given at load."""

    spec = ExternalTier

    def check_top(self, spec: ExternalTier, bundle_name: str, build: Build) -> None:
        if build.teacher is None and build.labels is None:
            raise RouterError(
                f"bundle {bundle_name!r} ends in the external tier {spec.name!r} (labels "
                f"{spec.labels!r}), which cannot run: give --teacher PATH.gguf (teacher=) to answer "
                "the questions the lower tiers escalate, or labels= to replay recorded answers")

    def build(self, spec: ExternalTier, bundle: Bundle, build: Build, top: bool) -> Tier:
        if build.labels is not None:
            return LabelsTier(spec.name, build.labels)
        if build.teacher is None:
            raise RouterError(f"the external tier {spec.name!r} has no model to run: give a teacher "
                              "GGUF (teacher=) or recorded labels (labels=)")
        place = build.placement(spec.name, None)
        questions = len(bundle.manifest.questions)
        return ReadoutTier(spec.name, Scorer.placed(build.teacher, place, branch_slots(questions),
                                                    layout=teacher_layout(bundle.manifest)))

    def weights(self, spec: ExternalTier) -> tuple[float, str]:
        return TEACHER_PARAMS, f"external: taken as a {TEACHER_PARAMS / 1e9:.0f}B model"


class MidLayerKind(TierKind[MidLayerTier]):
    """The teacher's own first blocks, read at each question's answer position (below the top)."""

    spec = MidLayerTier

    def build(self, spec: MidLayerTier, bundle: Bundle, build: Build, top: bool) -> Tier:
        questions = len(bundle.manifest.questions)
        place = build.placement(spec.name, spec.default_placement())
        scorer = LayerScorer.placed_at(spec.model.path, [spec.layer], place, branch_slots(questions),
                                       spec.template)
        try:
            if scorer.model.n_layer != spec.n_layer:
                raise RouterError(f"tier {spec.name!r} was trained on {spec.n_layer} blocks; "
                                  f"{spec.model.path} has {scorer.model.n_layer}")
            if spec.reader == "lens":
                reader = LayerAnswers(spec.layer, lens=LetterLens(spec.model.path, scorer.letter_ids))
            else:
                reader = LayerAnswers(spec.layer, heads=_layer_heads(spec, bundle))
        except BaseException:
            scorer.close()
            raise
        return LayerTier(spec.name, scorer, reader)

    def weights(self, spec: MidLayerTier) -> tuple[float, str]:
        raise RouterError(f"tier {spec.name!r} is a mid-layer tier, which is never a bundle's top tier")


def _layer_heads(spec: MidLayerTier, bundle: Bundle) -> dict[str, SoftmaxHead]:
    if spec.heads_file is None:
        raise BundleError(f"tier {spec.name!r} reads with heads and names no heads file; re-train")
    return read_heads(bundle.directory / spec.heads_file.name, spec.heads)


def teacher_layout(manifest: Manifest) -> Layout:
    """The layout a bundle's labels were read with, for the teacher that answers in their place
    (state first where the version is not one this code reads: only an accepted other teacher)."""
    return layout_of(manifest.teacher.prompt_version) or "state-first"


register(EncoderKind())
register(GgufKind())
register(MidLayerKind())
register(ExternalKind())
