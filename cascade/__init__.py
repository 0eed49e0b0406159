"""A tiered cascade decision router: the public surface.

``from cascade import Cascade, Budget, Scorer, parse_request, ...``. Names load on first use, so
``import cascade`` (and the command line's ``--help``) does not start llama.cpp or ONNX Runtime.
The rooms behind it, each a package with one job (see docs/architecture.md):

- ``readout``: llama.cpp: the logit-readout scorer, prompts, placement, the mid-layer reader;
- ``encoder``: the ONNX sentence encoder, its n-grams and the familiarity gate;
- ``cost``: the roofline and how each tier is priced;
- ``teachers``: a System One URL as the teacher: its client, identity, wire checks, admission;
- ``tiers``: each tier kind's manifest spec, runtime tier and builder, one module per kind;
- ``bundle``: the manifest and its sections;
- ``routing``: the router (``Cascade``), budgets and the cost forecast;
- ``audit`` and ``serve``: the certificate watched on live traffic, and ``cascade serve``.

Wire types (``questions``, ``answers``), every exception (``errors``), the heads and the
thresholds' maths sit at the top, under all the rooms.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from cascade.answers import Answer, DecisionResponse, Routing, Usage
    from cascade.bundle.manifest import Bundle, Manifest
    from cascade.encoder.onnx_encoder import Encoder
    from cascade.errors import (
        BundleError,
        CascadeError,
        CorpusError,
        InputTooLongError,
        ModelError,
        RequestError,
        RouterError,
        ServiceError,
        TemperatureError,
        UpstreamError,
    )
    from cascade.questions import DecisionRequest, Question, parse_request
    from cascade.readout.placement import Placement
    from cascade.readout.scorer import Scorer
    from cascade.routing.budget import Budget
    from cascade.routing.router import Cascade
    from cascade.teachers.settings import UpstreamSettings
    from cascade.tiers.base import Item

_HOMES = {
    "Answer": "cascade.answers", "DecisionResponse": "cascade.answers", "Routing": "cascade.answers",
    "Usage": "cascade.answers", "Bundle": "cascade.bundle.manifest", "Manifest": "cascade.bundle.manifest",
    "Encoder": "cascade.encoder.onnx_encoder", "BundleError": "cascade.errors",
    "CascadeError": "cascade.errors", "CorpusError": "cascade.errors", "InputTooLongError": "cascade.errors",
    "ModelError": "cascade.errors", "RequestError": "cascade.errors", "RouterError": "cascade.errors",
    "TemperatureError": "cascade.errors", "DecisionRequest": "cascade.questions",
    "Question": "cascade.questions", "parse_request": "cascade.questions",
    "Placement": "cascade.readout.placement", "Scorer": "cascade.readout.scorer",
    "Budget": "cascade.routing.budget", "Cascade": "cascade.routing.router", "Item": "cascade.tiers.base",
    "ServiceError": "cascade.errors", "UpstreamError": "cascade.errors",
    "UpstreamSettings": "cascade.teachers.settings",
}
__all__ = [
    "Answer",
    "Budget",
    "Bundle",
    "BundleError",
    "Cascade",
    "CascadeError",
    "CorpusError",
    "DecisionRequest",
    "DecisionResponse",
    "Encoder",
    "InputTooLongError",
    "Item",
    "Manifest",
    "ModelError",
    "Placement",
    "Question",
    "RequestError",
    "RouterError",
    "Routing",
    "Scorer",
    "ServiceError",
    "TemperatureError",
    "UpstreamError",
    "UpstreamSettings",
    "Usage",
    "parse_request",
]


def __getattr__(name: str) -> Any:
    """Import a public name from its module on first use (PEP 562)."""
    if name not in _HOMES:
        raise AttributeError(f"module 'cascade' has no attribute {name!r}")
    value = getattr(import_module(_HOMES[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
