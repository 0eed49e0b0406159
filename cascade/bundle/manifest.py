"""Model bundles: one folder that says which models answer which questions, and how confidently.

A bundle is ``manifest.json`` (this schema), the trained heads (``.npz``) and the split of its
labelled items (``split.json``). Model files (encoder, GGUFs) are referenced by absolute path and
sha256, never copied: they are gigabytes and already live elsewhere. Files inside the bundle are
referenced by name and sha256 (``cascade.pins``). Loading runs no code from the bundle (JSON, and
``np.load`` with ``allow_pickle=False``), and refuses any file whose bytes differ from what the
manifest pinned: thresholds calibrated for one model say nothing about another.

Each kind of tier declares what it pins, what it reads from the bundle folder and where in the
cascade it may stand in its own module of ``cascade.tiers``, beside how it is built and run.
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    Field,
    FieldSerializationInfo,
    PrivateAttr,
    SerializerFunctionWrapHandler,
    TypeAdapter,
    ValidationError,
    field_serializer,
    model_serializer,
    model_validator,
)

from cascade.bundle.sections import CalibrationSection, TrainingSection
from cascade.checks import is_int
from cascade.encoder.ngrams import NgramFeatures
from cascade.errors import BundleError, ModelError
from cascade.heads import SoftmaxHead
from cascade.pins import (
    BundleFile,
    ModelFile,
    check_bundle_file,
    check_model_file,
    read_json,
    write_atomically,
)
from cascade.questions import Question
from cascade.readout.prompts import PROMPT_VERSION, Layout, layout_of
from cascade.teachers.identity import EndpointIdentity
from cascade.thresholds import ThresholdScore
from cascade.tiers.base import StrictModel, TierSpec, read_heads
from cascade.tiers.encoder import EncoderSpec
from cascade.tiers.kinds import TIER_SPECS, AnyTierSpec

SCHEMA_VERSION = 6
VECTORS_ALONE_SCHEMA = 3
"""The first schema whose thresholds certify encoder vectors computed from each text alone
(``cascade.encoder.onnx_encoder``); before it, an encoder with dynamic int8 activations ran in batches."""
MANIFEST_NAME = "manifest.json"
HEADS_NAME = "heads.npz"
NGRAMS_NAME = "ngrams.npz"
SPLIT_NAME = "split.json"

_QUESTIONS = TypeAdapter(dict[str, Question])




class TeacherInfo(StrictModel):
    """Who made the labels the heads learnt and the thresholds were calibrated on: a GGUF (its
    sha256 and prompt version), a System One endpoint (``identity``: as JSON, the model and
    hashes its answers stated, ``cascade.teachers.identity``; ``model`` is its model name), or
    external labels known by name only. The fields are the label store's (``distill.store``),
    so that the two compare equal for the same teacher."""

    kind: Literal["gguf", "external", "endpoint"]
    model: str
    model_sha256: str | None = None
    prompt_version: str | None = None
    identity: str | None = None

    @model_serializer(mode="wrap")
    def _identity_where_known(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """No ``identity`` key for a teacher without one: a bundle of a GGUF teacher reads as
        before, in a cascade that predates endpoint teachers too."""
        data: dict[str, Any] = handler(self)
        if data.get("identity") is None:
            data.pop("identity", None)
        return data

    def endpoint_identity(self) -> EndpointIdentity | None:
        """An endpoint teacher's identity, parsed (None for another kind)."""
        return EndpointIdentity.model_validate_json(self.identity) if self.identity else None


class SplitInfo(StrictModel):
    """How labelled items were split, and the file listing each part's ids."""

    fractions: dict[str, float]
    salt: str
    file: BundleFile


class Manifest(StrictModel):
    """Everything a router needs to know about a bundle, as plain JSON.

    Each schema version adds what an older cascade must refuse rather than misread; the history
    is in docs/bundles.md. Schema 6 adds the input policy the teacher's labels were read with
    (the top tier's ``n_ctx`` and ``excerpt``), which every path that reads a state follows.
    """

    schema_version: Literal[1, 2, 3, 4, 5, 6] = 6
    name: str = Field(min_length=1)
    created_at: datetime
    prompt_version: str = PROMPT_VERSION
    questions: dict[str, dict[str, Any]] = Field(min_length=1)
    tiers: list[AnyTierSpec] = Field(min_length=1)
    threshold_on: ThresholdScore = "margin"
    # question -> tier -> lowest RAW score (``threshold_on``) kept (None: never accept)
    thresholds: dict[str, dict[str, float | None]] = Field(default_factory=dict)
    # question -> tier -> T (absent: 1.0)
    temperatures: dict[str, dict[str, float]] = Field(default_factory=dict)
    calibration: CalibrationSection = CalibrationSection()
    training: TrainingSection = TrainingSection()
    teacher: TeacherInfo
    split: SplitInfo

    _parsed: dict[str, Question] = PrivateAttr(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _schema_one_scores(cls, data: Any) -> Any:
        """A schema-1 manifest has no ``threshold_on``: its thresholds are on the top probability."""
        if isinstance(data, dict) and data.get("schema_version") == 1:
            data = {"threshold_on": "top", **data}
        return data

    @model_validator(mode="after")
    def _consistent(self) -> Manifest:
        if self.schema_version == 1 and self.threshold_on != "top":
            raise ValueError("a schema-1 manifest's thresholds are on the top probability; "
                             f"threshold_on {self.threshold_on!r} needs schema_version 2")
        try:
            self._parsed = _QUESTIONS.validate_python(self.questions)
        except ValidationError as exc:
            raise ValueError(f"questions are not System One questions: {exc}") from None
        _check_tiers(self.tiers)
        for tier in self.tiers:
            tier.check_questions(self._parsed)
        names = [tier.name for tier in self.tiers]
        _check_table("thresholds", self.thresholds, self.questions, names[:-1], _is_probability)
        _check_table("temperatures", self.temperatures, self.questions, names, _is_temperature)
        return self

    @field_serializer("calibration", "training")
    def _given_fields(self, section: BaseModel, info: FieldSerializationInfo) -> dict[str, Any]:
        """A section as it was given: a default never becomes a key the bundle did not have."""
        return section.model_dump(mode=info.mode, exclude_unset=True)

    def parsed_questions(self) -> dict[str, Question]:
        """The questions as typed objects (validated when the manifest was)."""
        return dict(self._parsed)

    @property
    def encoder_tier(self) -> EncoderSpec | None:
        first = self.tiers[0]
        return first if isinstance(first, EncoderSpec) else None

    def threshold(self, question: str, tier: str) -> float | None:
        """Lowest confidence ``tier`` may answer ``question`` with; None means always escalate."""
        return self.thresholds.get(question, {}).get(tier)

    def temperature(self, question: str, tier: str) -> float:
        return self.temperatures.get(question, {}).get(tier, 1.0)

    def teacher_layout(self) -> Layout:
        """The layout the bundle's labels were read with, for the teacher that answers in their
        place (state first where the version is not one this code reads: only an accepted other
        teacher)."""
        return layout_of(self.teacher.prompt_version) or "state-first"

    def model_files(self) -> Iterator[tuple[str, ModelFile]]:
        for tier in self.tiers:
            yield from tier.model_files()

    def bundle_files(self) -> Iterator[tuple[str, BundleFile]]:
        for tier in self.tiers:
            yield from tier.bundle_files()
        yield "split file", self.split.file


def _check_tiers(tiers: Sequence[TierSpec]) -> None:
    names = [tier.name for tier in tiers]
    if len(set(names)) < len(names):
        raise ValueError(f"tier names must be unique; got {names}")
    for tier in tiers[1:]:
        if tier.first_only:
            raise ValueError(f"only the first tier may be an {tier.kind} tier")
    for tier in tiers[:-1]:
        if tier.top_only:
            raise ValueError(f"only the last (top) tier may be {tier.kind}")
    if not tiers[-1].may_top:
        tops = [repr(spec.model_fields["kind"].default) for spec in TIER_SPECS if spec.may_top]
        raise ValueError(f"the last (top) tier must be {' or '.join(tops)}: it answers everything")


def _check_table(what: str, table: Mapping[str, Mapping[str, Any]], questions: Mapping[str, Any],
                 tiers: list[str], valid: Callable[[Any], bool]) -> None:
    for qid, row in table.items():
        if qid not in questions:
            raise ValueError(f"{what}[{qid!r}]: unknown question; known: {sorted(questions)}")
        for tier, value in row.items():
            if tier not in tiers:
                raise ValueError(f"{what}[{qid!r}][{tier!r}]: unknown tier; allowed: {tiers}")
            if not valid(value):
                raise ValueError(f"{what}[{qid!r}][{tier!r}]: invalid value {value!r}")


def _is_probability(value: float | None) -> bool:
    return value is None or 0.0 <= value <= 1.0


def _is_temperature(value: float) -> bool:
    return math.isfinite(value) and value > 0


class Bundle:
    """A manifest and the folder it lives in; heads load on first use."""

    def __init__(
        self, manifest: Manifest, directory: Path, heads: Mapping[str, SoftmaxHead] | None = None
    ) -> None:
        self.manifest = manifest
        self.directory = Path(directory)
        self._heads = dict(heads) if heads is not None else None
        self._ngrams: tuple[NgramFeatures | None] | None = None  # (loaded,) once read

    @classmethod
    def load(cls, directory: Path, verify: bool = True) -> Bundle:
        """Read a bundle; with ``verify``, check every file's sha256 and load the heads now."""
        directory = Path(directory)
        manifest = _read_manifest(directory / MANIFEST_NAME)
        bundle = cls(manifest, directory)
        if verify:
            bundle.verify()
        return bundle

    def verify(self) -> None:
        """BundleError naming the first referenced file that is missing or has changed."""
        for what, model in self.manifest.model_files():
            check_model_file(what, model, self.directory / MANIFEST_NAME)
        for what, inside in self.manifest.bundle_files():
            check_bundle_file(what, inside, self.directory)
        self._heads = self._load_heads()
        self._ngrams = (self._load_ngrams(),)

    def save(self, directory: Path | None = None) -> Bundle:
        """Write the manifest (atomically) into ``directory``, copying the bundle's own files there.

        Calibration rewrites thresholds this way: ``Bundle(new_manifest, old.directory).save()``.
        """
        target = Path(directory) if directory is not None else self.directory
        target.mkdir(parents=True, exist_ok=True)
        for what, inside in self.manifest.bundle_files():
            source = self.directory / inside.name
            if not source.is_file():
                raise BundleError(f"cannot save bundle: its {what} {source} is missing")
            if source.resolve() != (target / inside.name).resolve():
                shutil.copyfile(source, target / inside.name)
        text = json.dumps(self.manifest.model_dump(mode="json"), indent=2, ensure_ascii=False)
        write_atomically(target / MANIFEST_NAME, text + "\n")
        return Bundle(self.manifest, target, self._heads)

    @property
    def heads(self) -> dict[str, SoftmaxHead]:
        """The fitted heads of the encoder tier by question id (empty without one)."""
        if self._heads is None:
            self._heads = self._load_heads()
        return self._heads

    @property
    def ngrams(self) -> NgramFeatures | None:
        """The encoder tier's n-gram features, or None where its heads read the embedding alone."""
        if self._ngrams is None:
            self._ngrams = (self._load_ngrams(),)
        return self._ngrams[0]

    def _load_ngrams(self) -> NgramFeatures | None:
        tier = self.manifest.encoder_tier
        if tier is None or tier.ngrams is None:
            return None
        path = self.directory / tier.ngrams.file.name
        try:
            features = NgramFeatures.load(path)
        except ModelError as exc:
            raise BundleError(f"{exc}; re-train the bundle") from exc
        if (features.n_features, features.ngram_range) != (tier.ngrams.n_features, tier.ngrams.ngram_range):
            raise BundleError(f"n-gram features file {path} has {features.n_features} columns and "
                              f"n-grams {features.ngram_range}; the manifest says "
                              f"{tier.ngrams.n_features} and {tier.ngrams.ngram_range}; re-train")
        return features

    def split_ids(self) -> dict[str, list[str]]:
        """Item ids per part ("train", "calibration", "evaluation") as written by training."""
        path = self.directory / self.manifest.split.file.name
        data = read_json(path, "split file")
        if not isinstance(data, dict) or not all(
            isinstance(ids, list) and all(isinstance(i, str) for i in ids) for ids in data.values()
        ):
            raise BundleError(f"split file {path} must map each part to a list of item ids")
        return data

    @property
    def question_count(self) -> int:
        return len(self.manifest.questions)

    @property
    def teacher_layout(self) -> Layout:
        return self.manifest.teacher_layout()

    @property
    def tier_specs(self) -> list[AnyTierSpec]:
        return self.manifest.tiers

    def _load_heads(self) -> dict[str, SoftmaxHead]:
        tier = self.manifest.encoder_tier
        if tier is None:
            return {}
        return read_heads(self.directory / tier.heads_file.name, tier.heads)


def _read_manifest(path: Path) -> Manifest:
    if not path.is_file():
        raise BundleError(f"no bundle at {path.parent}: {path.name} not found; check the path, or "
                          "make one with `cascade train`")
    data = read_json(path, "bundle manifest")
    _check_schema_version(data, path)
    try:
        return Manifest.model_validate(data)
    except ValidationError as exc:
        problems = "\n".join(
            f"  {'.'.join(str(p) for p in e['loc']) or 'manifest'}: {e['msg']}" for e in exc.errors()
        )
        raise BundleError(f"{path} is not a valid bundle manifest:\n{problems}") from None


def _check_schema_version(data: Any, path: Path) -> None:
    """Refuse a manifest from a newer cascade before reading fields this one does not know."""
    version = data.get("schema_version") if isinstance(data, dict) else None
    if not is_int(version) or version < 1:
        raise BundleError(f"{path}: schema_version {version!r} is not a bundle schema version "
                          f"(this cascade reads {SCHEMA_VERSION}); is this a bundle manifest?")
    if version > SCHEMA_VERSION:
        raise BundleError(f"{path}: bundle schema {version} is newer than this cascade "
                          f"({SCHEMA_VERSION}); upgrade cascade")
