"""Every tier kind, registered: the manifest's union of specs and the lookup by kind.

``AnyTierSpec`` is what a manifest's ``tiers`` list holds; ``kind_of`` finds a spec's
``TierKind``; ``build_tiers`` turns a bundle's specs into runtime tiers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, get_args

from pydantic import Field

from cascade.errors import RouterError
from cascade.tiers.base import KINDS, Build, BundleParts, Tier, TierKind, TierSpec, register
from cascade.tiers.encoder import EncoderKind, EncoderSpec
from cascade.tiers.external import ExternalKind, ExternalSpec
from cascade.tiers.gguf import GgufKind, GgufSpec
from cascade.tiers.mid_layer import MidLayerKind, MidLayerSpec
from cascade.tiers.upstream import UpstreamKind, UpstreamSpec

AnyTierSpec = Annotated[EncoderSpec | GgufSpec | MidLayerSpec | ExternalSpec | UpstreamSpec,
                        Field(discriminator="kind")]
TIER_SPECS: tuple[type[TierSpec], ...] = get_args(get_args(AnyTierSpec)[0])
"""Every kind of tier a manifest may hold, read from ``AnyTierSpec`` so the two cannot disagree."""


def kind_of(spec: TierSpec) -> TierKind[Any]:
    """The registered kind of a manifest's tier."""
    if spec.kind not in KINDS:
        raise RouterError(f"tier {spec.name!r} is of kind {spec.kind!r}, which no TierKind registers; "
                          f"registered: {sorted(KINDS)}")
    return KINDS[spec.kind]


def build_tiers(bundle: BundleParts, build: Build, specs: Sequence[TierSpec] | None = None) -> list[Tier]:
    """The runtime tiers of ``specs`` (default: all the bundle's), in order; on a failure the
    tiers built so far are closed before the error goes up."""
    last = bundle.tier_specs[-1]
    tiers: list[Tier] = []
    try:
        for spec in bundle.tier_specs if specs is None else specs:
            tiers.append(kind_of(spec).build(spec, bundle, build, spec is last))
    except BaseException:
        close_tiers(tiers)
        raise
    return tiers


def close_tiers(tiers: Sequence[Tier]) -> None:
    for tier in tiers:
        tier.close()


register(EncoderKind())
register(GgufKind())
register(MidLayerKind())
register(ExternalKind())
register(UpstreamKind())
