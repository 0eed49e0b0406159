"""What a label store holds and refuses: the teacher identity, the input policy, one label row,
the errors, and the check every distribution passes before it is stored. Shared by both backends."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, SerializerFunctionWrapHandler, model_serializer, model_validator

from cascade.checks import is_finite
from cascade.errors import CascadeError, StoreUnavailable
from cascade.teachers.identity import EndpointIdentity

SCHEMA_VERSION = 3
"""2 added each label's letter mass and the recorded input policy; 3 the audits' order in the store
(``audits.seq``, which every replica's drift watch reads in) and the claims that keep two writers
off one item. An older SQLite store is upgraded in place when opened for writing (its labels'
letter mass and policy stay unknown; its audits keep the order they were written in)."""
READABLE_VERSIONS = ("1", "2", str(SCHEMA_VERSION))
SUM_TOLERANCE = 1e-3
TEACHER_FIELDS = ("kind", "model", "model_sha256", "prompt_version", "identity")


class StoreError(CascadeError, ValueError):
    """A label store cannot be opened or written, or labels given to it are invalid."""


class StoreUnavailableError(StoreError, StoreUnavailable):
    """The store cannot be reached now (``cascade.errors.StoreUnavailable``): try again later."""


class LabelConflictError(StoreError):
    """An item's label differs from the one the store holds, which is never overwritten."""


class StoreMismatchError(StoreError):
    """An existing store was made by a different teacher than the one now writing to it."""


class Teacher(BaseModel):
    """Who produced the labels; thresholds calibrated on them are only valid for this teacher."""

    model_config = ConfigDict(frozen=True, extra="forbid", protected_namespaces=())

    kind: Literal["gguf", "external", "endpoint"]
    model: str
    model_sha256: str | None = None
    prompt_version: str | None = None
    identity: str | None = None
    """An endpoint's identity (``cascade.teachers.identity.EndpointIdentity`` as JSON, without its
    per-question template hashes, which each label keeps as its ``prompt_hash``); None otherwise."""

    @model_validator(mode="after")
    def _gguf_is_pinned(self) -> Teacher:
        if self.kind == "gguf" and (not self.model_sha256 or not self.prompt_version):
            raise ValueError(
                "a teacher of kind 'gguf' needs both model_sha256 and prompt_version, because "
                f"labels are only reproducible from a pinned model and prompt; got "
                f"model_sha256={self.model_sha256!r}, prompt_version={self.prompt_version!r}"
            )
        if (self.kind == "endpoint") != (self.identity is not None):
            raise ValueError(f"a teacher of kind 'endpoint', and only one, has an identity; got kind "
                             f"{self.kind!r} with identity {self.identity!r}")
        return self

    @model_serializer(mode="wrap")
    def _identity_where_known(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """No ``identity`` key for a teacher without one, as a bundle's ``TeacherInfo`` writes it:
        the two compare equal for the same teacher."""
        data: dict[str, Any] = handler(self)
        if data.get("identity") is None:
            data.pop("identity", None)
        return data

    @classmethod
    def of_endpoint(cls, identity: EndpointIdentity) -> Teacher:
        """The store identity of labels an endpoint answered: its model and hashes."""
        plain = EndpointIdentity(model=identity.model, model_hash=identity.model_hash,
                                 calibration_version=identity.calibration_version)
        return cls(kind="endpoint", model=identity.model or "unnamed endpoint model",
                   identity=plain.model_dump_json())


class InputPolicy(BaseModel):
    """How the teacher read each state: its context size and the excerpt of an over-long state
    (``head_tail:N``; None: whole states only, an over-long one is not labelled). Every path that
    reads a state for the bundle (calibration, routing, serving) must read it the same way."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    n_ctx: int
    excerpt: str | None = None

    def __str__(self) -> str:
        return f"n_ctx {self.n_ctx}, " + (f"excerpt {self.excerpt}" if self.excerpt else "no excerpt")


class Label(BaseModel):
    """One stored row: the teacher's distribution for one question about one item."""

    item_id: str
    question_id: str
    probabilities: dict[str, float]
    prompt_hash: str | None
    created_at: float


def check_probabilities(probs: Any, where: str) -> dict[str, float]:
    """Finite, non-negative, summing to 1 within SUM_TOLERANCE; returned renormalised."""
    if not isinstance(probs, Mapping) or not probs:
        raise StoreError(f"{where} must be a non-empty object of option -> probability")
    for key, p in probs.items():
        if not is_finite(p) or not 0 <= p <= 1:  # above 1 cannot sum to 1, and may overflow the sum
            raise StoreError(f"{where}[{key!r}] must be a finite number in [0, 1], got {p!r}")
    total = math.fsum(probs.values())
    if abs(total - 1.0) > SUM_TOLERANCE:
        raise StoreError(f"{where} must sum to 1 (within {SUM_TOLERANCE}), sums to {total!r}")
    return {str(k): float(p) / total for k, p in probs.items()}


def stored_probabilities(text: str, item_id: str, question_id: str, store: object) -> dict[str, float]:
    """A stored label read back, as it was stored (not renormalised again); a row changed outside
    cascade (``[1, 2]``, ``null``, ``{}``, NaN) is refused as damage naming it: it was a
    ValidationError, KeyError or ValueError traceback in export, evaluate and training, or a NaN
    written into an export."""
    try:
        probs = json.loads(text)
        check_probabilities(probs, "probabilities")
    except (ValueError, TypeError) as exc:  # JSONDecodeError and StoreError among them
        raise StoreError(f"the label of {item_id!r} for {question_id!r} in {store} is damaged ({exc}); "
                         "it was changed outside cascade: restore the store from a copy, or relabel "
                         "that item into a new one") from None
    return {str(k): float(p) for k, p in probs.items()}


def conflict_message(item_id: str, question_ids: list[str]) -> str:
    return (f"item {item_id!r} already has different labels for {question_ids}; stored labels "
            "are never overwritten. Use a new --store path to relabel.")


def policy_of(meta: Mapping[str, str | None]) -> InputPolicy | None:
    text = meta.get("input_policy")
    return InputPolicy.model_validate_json(text) if text else None


def check_version(meta: Mapping[str, str | None], where: object) -> None:
    """Refuse a store of a schema version this code cannot read, saying which side to upgrade."""
    version = meta.get("schema_version")
    if version not in READABLE_VERSIONS:
        newer = version is not None and version.isdigit() and int(version) > SCHEMA_VERSION
        raise StoreError(
            f"label store {where} has schema version {version!r}; this code reads version "
            f"{SCHEMA_VERSION}" + (": it was made by a newer cascade, upgrade this one." if newer
                                   else ". Relabel into a new --store path."))
