"""Model bundles: one folder that says which models answer which questions, and how confidently.

A bundle is ``manifest.json`` (this schema), the trained heads (``.npz``) and the split of its
labelled items (``split.json``). Model files (encoder, GGUFs) are referenced by absolute path and
sha256, never copied: they are gigabytes and already live elsewhere. Files inside the bundle are
referenced by name and sha256. Loading runs no code from the bundle (JSON, and ``np.load`` with
``allow_pickle=False``), and refuses any file whose bytes differ from what the manifest pinned:
thresholds calibrated for one model say nothing about another.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)

from cascade.encoder import EncoderFiles
from cascade.errors import CascadeError, ModelError
from cascade.hashing import file_sha256
from cascade.heads import SoftmaxHead, load_heads
from cascade.ngrams import NgramFeatures
from cascade.placement import Placement
from cascade.prompts import PROMPT_VERSION
from cascade.questions import Question

SCHEMA_VERSION = 1
MANIFEST_NAME = "manifest.json"
HEADS_NAME = "heads.npz"
NGRAMS_NAME = "ngrams.npz"
SPLIT_NAME = "split.json"

_QUESTIONS = TypeAdapter(dict[str, Question])


class BundleError(CascadeError, ValueError):
    """A bundle cannot be loaded as it is: missing or changed files, or an unknown schema."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())


Sha256 = Annotated[str, Field(pattern="^[0-9a-f]{64}$")]


class ModelFile(_Strict):
    """A model file outside the bundle, pinned by content."""

    path: str
    sha256: Sha256

    @field_validator("path")
    @classmethod
    def _absolute(cls, value: str) -> str:
        if not Path(value).is_absolute():
            raise ValueError(f"must be an absolute path, so the bundle loads from any directory; "
                             f"got {value!r}")
        return value

    @classmethod
    def of(cls, path: Path) -> ModelFile:
        resolved = Path(path).resolve()
        return cls(path=str(resolved), sha256=file_sha256(resolved))


class BundleFile(_Strict):
    """A file inside the bundle folder, named relative to it."""

    name: str
    sha256: Sha256

    @field_validator("name")
    @classmethod
    def _plain_name(cls, value: str) -> str:
        if not value or Path(value).name != value or value.startswith("."):
            raise ValueError(f"must be a file name inside the bundle folder, without a folder or "
                             f"leading dot; got {value!r}")
        return value

    @classmethod
    def of(cls, directory: Path, name: str) -> BundleFile:
        """Pin a file already written into the bundle folder ``directory``."""
        return cls(name=name, sha256=file_sha256(Path(directory) / name))


class HeadInfo(_Strict):
    """One question's head: its columns, how it was trained, or why it has none."""

    option_keys: list[str]
    train_items: int = 0
    held_out_items: int = 0
    held_out_agreement: float | None = None
    skipped: str | None = None  # why there is no head (the router starts this question one tier up)

    @property
    def has_head(self) -> bool:
        return self.skipped is None


class NgramInfo(_Strict):
    """Hashed word n-grams the heads read beside the embedding (cascade.ngrams), and their file."""

    n_features: int = Field(ge=1)
    ngram_range: tuple[int, int]
    file: BundleFile


class EncoderTier(_Strict):
    """Tier 0: one sentence embedding per state (with n-grams beside it), one softmax head per question."""

    kind: Literal["encoder"] = "encoder"
    name: str = Field(default="encoder", min_length=1)
    model: ModelFile
    tokenizer: ModelFile
    max_length: int = Field(ge=2)
    heads_file: BundleFile
    heads: dict[str, HeadInfo]
    ngrams: NgramInfo | None = None  # None: the heads read the embedding alone

    def files(self) -> EncoderFiles:
        return EncoderFiles(model=Path(self.model.path), tokenizer=Path(self.tokenizer.path))


class GgufTier(_Strict):
    """A logit-readout scorer on a GGUF model, with the settings its thresholds were made for."""

    kind: Literal["gguf"] = "gguf"
    name: str = Field(min_length=1)
    model: ModelFile
    n_ctx: int = Field(default=4096, ge=1)
    permutations: int = Field(default=1, ge=1)
    template: Literal["auto", "chat", "plain"] = "auto"
    placement: Placement = Placement()  # where it runs by default; Cascade.load may override it

    def default_placement(self) -> Placement:
        """The bundle's placement for this tier, with its certified context size."""
        return self.placement.over(Placement(n_ctx=self.n_ctx))


class ExternalTier(_Strict):
    """A top tier known only by its labels (gold labels, another system): no model to run.

    A bundle ending in one can still route, but the caller must give a GGUF at decide time to
    answer what the lower tiers escalate.
    """

    kind: Literal["external"] = "external"
    name: str = Field(default="teacher", min_length=1)
    labels: str


Tier = Annotated[EncoderTier | GgufTier | ExternalTier, Field(discriminator="kind")]


class TeacherInfo(_Strict):
    """Who made the labels the heads learnt and the thresholds were calibrated on."""

    kind: Literal["gguf", "external"]
    model: str
    model_sha256: str | None = None
    prompt_version: str | None = None


class SplitInfo(_Strict):
    """How labelled items were split, and the file listing each part's ids."""

    fractions: dict[str, float]
    salt: str
    file: BundleFile


class Manifest(_Strict):
    """Everything a router needs to know about a bundle, as plain JSON."""

    schema_version: Literal[1] = 1
    name: str = Field(min_length=1)
    created_at: datetime
    prompt_version: str = PROMPT_VERSION
    questions: dict[str, dict[str, Any]] = Field(min_length=1)
    tiers: list[Tier] = Field(min_length=1)
    # question -> tier -> lowest RAW top probability kept (None: never accept)
    thresholds: dict[str, dict[str, float | None]] = {}
    temperatures: dict[str, dict[str, float]] = {}  # question -> tier -> T (absent: 1.0)
    calibration: dict[str, Any] = {}
    training: dict[str, Any] = {}
    teacher: TeacherInfo
    split: SplitInfo

    _parsed: dict[str, Question] = PrivateAttr(default_factory=dict)

    @model_validator(mode="after")
    def _consistent(self) -> Manifest:
        try:
            self._parsed = _QUESTIONS.validate_python(self.questions)
        except ValidationError as exc:
            raise ValueError(f"questions are not System One questions: {exc}") from None
        _check_tiers(self.tiers)
        _check_heads(self.tiers, self._parsed)
        names = [tier.name for tier in self.tiers]
        _check_table("thresholds", self.thresholds, self.questions, names[:-1], _is_probability)
        _check_table("temperatures", self.temperatures, self.questions, names, _is_temperature)
        return self

    def parsed_questions(self) -> dict[str, Question]:
        """The questions as typed objects (validated when the manifest was)."""
        return dict(self._parsed)

    @property
    def encoder_tier(self) -> EncoderTier | None:
        first = self.tiers[0]
        return first if isinstance(first, EncoderTier) else None

    def threshold(self, question: str, tier: str) -> float | None:
        """Lowest confidence ``tier`` may answer ``question`` with; None means always escalate."""
        return self.thresholds.get(question, {}).get(tier)

    def temperature(self, question: str, tier: str) -> float:
        return self.temperatures.get(question, {}).get(tier, 1.0)

    def model_files(self) -> Iterator[tuple[str, ModelFile]]:
        for tier in self.tiers:
            if isinstance(tier, EncoderTier):
                yield f"tier {tier.name!r} encoder model", tier.model
                yield f"tier {tier.name!r} tokenizer", tier.tokenizer
            elif isinstance(tier, GgufTier):
                yield f"tier {tier.name!r} GGUF model", tier.model

    def bundle_files(self) -> Iterator[tuple[str, BundleFile]]:
        if self.encoder_tier is not None:
            yield "heads file", self.encoder_tier.heads_file
            if self.encoder_tier.ngrams is not None:
                yield "n-gram features file", self.encoder_tier.ngrams.file
        yield "split file", self.split.file


def _check_tiers(tiers: list[Any]) -> None:
    names = [tier.name for tier in tiers]
    if len(set(names)) < len(names):
        raise ValueError(f"tier names must be unique; got {names}")
    if any(isinstance(tier, EncoderTier) for tier in tiers[1:]):
        raise ValueError("only the first tier may be an encoder tier")
    if any(isinstance(tier, ExternalTier) for tier in tiers[:-1]):
        raise ValueError("only the last (top) tier may be external")
    if isinstance(tiers[-1], EncoderTier):
        raise ValueError("the last (top) tier must be 'gguf' or 'external': it answers everything")


def _check_heads(tiers: list[Any], questions: Mapping[str, Question]) -> None:
    first = tiers[0]
    if not isinstance(first, EncoderTier):
        return
    for qid, info in first.heads.items():
        if qid not in questions:
            raise ValueError(f"tier {first.name!r} has a head for unknown question {qid!r}")
        if info.option_keys != questions[qid].option_keys():
            raise ValueError(f"head {qid!r} has option_keys {info.option_keys}; the question's "
                             f"are {questions[qid].option_keys()}")


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
            _check_model_file(what, model, self.directory)
        for what, inside in self.manifest.bundle_files():
            _check_bundle_file(what, inside, self.directory)
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
        _write_atomically(target / MANIFEST_NAME, text + "\n")
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
        data = _read_json(path, "split file")
        if not isinstance(data, dict) or not all(
            isinstance(ids, list) and all(isinstance(i, str) for i in ids) for ids in data.values()
        ):
            raise BundleError(f"split file {path} must map each part to a list of item ids")
        return data

    def _load_heads(self) -> dict[str, SoftmaxHead]:
        tier = self.manifest.encoder_tier
        if tier is None:
            return {}
        path = self.directory / tier.heads_file.name
        try:
            heads = load_heads(path)
        except ModelError as exc:
            raise BundleError(f"{exc}; re-train the bundle") from exc
        expected = {qid for qid, info in tier.heads.items() if info.has_head}
        if set(heads) != expected:
            raise BundleError(f"heads file {path} has heads for {sorted(heads)}; the manifest "
                              f"expects {sorted(expected)}; re-train the bundle")
        for qid, head in heads.items():
            if head.n_classes_ != len(tier.heads[qid].option_keys):
                raise BundleError(f"heads file {path}: head {qid!r} has {head.n_classes_} classes, "
                                  f"the manifest {len(tier.heads[qid].option_keys)}; re-train")
        return heads


def _read_manifest(path: Path) -> Manifest:
    if not path.is_file():
        raise BundleError(f"no bundle at {path.parent}: {path.name} not found; check the path, or "
                          "make one with `cascade train`")
    data = _read_json(path, "bundle manifest")
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
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise BundleError(f"{path}: schema_version {version!r} is not a bundle schema version "
                          f"(this cascade reads {SCHEMA_VERSION}); is this a bundle manifest?")
    if version > SCHEMA_VERSION:
        raise BundleError(f"{path}: bundle schema {version} is newer than this cascade "
                          f"({SCHEMA_VERSION}); upgrade cascade")


def _read_json(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise BundleError(f"cannot read {what} {path}: {exc}") from exc
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BundleError(f"{what} {path} is not valid JSON ({exc}); re-train the bundle") from None


def _check_model_file(what: str, model: ModelFile, directory: Path) -> None:
    path = Path(model.path)
    repoint = (f"re-point its 'path' in {directory / MANIFEST_NAME} to the file the bundle was "
               "trained with, or re-train the bundle")
    if not path.is_file():
        raise BundleError(f"{what} {path} not found; {repoint}")
    actual = file_sha256(path)
    if actual != model.sha256:
        raise BundleError(f"{what} {path} has sha256 {actual}, but the bundle expects "
                          f"{model.sha256}: it is not the file the bundle was trained with; {repoint}")


def _check_bundle_file(what: str, inside: BundleFile, directory: Path) -> None:
    path = directory / inside.name
    if not path.is_file():
        raise BundleError(f"{what} {path} is missing from the bundle; re-train the bundle")
    actual = file_sha256(path)
    if actual != inside.sha256:
        raise BundleError(f"{what} {path} has sha256 {actual}, but the manifest expects "
                          f"{inside.sha256}: it changed after the bundle was saved; re-train the bundle")


def _write_atomically(path: Path, text: str) -> None:
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as out:
            out.write(text)
        os.replace(temporary, path)
    except BaseException:
        os.unlink(temporary)
        raise


def write_json_file(directory: Path, name: str, data: Any) -> BundleFile:
    """Write a JSON file into a bundle folder atomically and pin it."""
    Path(directory).mkdir(parents=True, exist_ok=True)
    _write_atomically(Path(directory) / name, json.dumps(data, ensure_ascii=False) + "\n")
    return BundleFile.of(directory, name)

