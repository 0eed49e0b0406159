"""What each kind of tier declares in a bundle's manifest: its fields, the model files it pins,
the files it reads from the bundle folder and where in the cascade it may stand.

How a kind is built and run is in ``cascade.tierkinds``; the manifest that lists the tiers is in
``cascade.bundle``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, ClassVar, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, model_validator

from cascade.encoder import EncoderFiles
from cascade.pins import BundleFile, ModelFile
from cascade.placement import Placement
from cascade.questions import Question


class StrictModel(BaseModel):
    """A manifest section: unknown fields are refused, so a typo never passes for a default."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())


class HeadInfo(StrictModel):
    """One question's head: its columns, how it was trained, or why it has none."""

    option_keys: list[str]
    train_items: int = 0
    held_out_items: int = 0
    held_out_agreement: float | None = None
    skipped: str | None = None  # why there is no head (the router starts this question one tier up)

    @property
    def has_head(self) -> bool:
        return self.skipped is None


class NgramInfo(StrictModel):
    """Hashed word n-grams the heads read beside the embedding (cascade.ngrams), and their file."""

    n_features: int = Field(ge=1)
    ngram_range: tuple[int, int]
    file: BundleFile


class TierSpec(StrictModel):
    """What every kind of tier declares in the manifest, beside its fields.

    ``first_only``: the kind may only be the first tier; ``top_only``: only the last; ``may_top``:
    whether it can be the last tier at all (the top tier answers everything that reaches it).
    """

    first_only: ClassVar[bool] = False
    top_only: ClassVar[bool] = False
    may_top: ClassVar[bool] = True

    if TYPE_CHECKING:  # each kind declares them, with its defaults (declared here, they would
        # come first in every tier's JSON)
        kind: str
        name: str

    def model_files(self) -> Iterator[tuple[str, ModelFile]]:
        """The model files outside the bundle this tier pins, each with what it is."""
        return iter(())

    def bundle_files(self) -> Iterator[tuple[str, BundleFile]]:
        """The files inside the bundle folder this tier reads, each with what it is."""
        return iter(())

    def check_questions(self, questions: Mapping[str, Question]) -> None:
        """ValueError where the tier's fields disagree with the bundle's questions."""


class GateInfo(StrictModel):
    """The encoder tier's gate for unfamiliar inputs (``cascade.familiar``): its file, how many
    training vectors it holds, the quantile its radius was set at, and the radius."""

    file: BundleFile
    reference: int = Field(ge=2)
    quantile: float = Field(gt=0, lt=1)
    radius: float = Field(ge=0, le=2)


class EncoderTier(TierSpec):
    """Tier 0: one sentence embedding per state (with n-grams beside it), one softmax head per question."""

    first_only: ClassVar[bool] = True
    may_top: ClassVar[bool] = False

    kind: Literal["encoder"] = "encoder"
    name: str = Field(default="encoder", min_length=1)
    # a shared encoder lives outside the bundle; one fine-tuned for it (cascade train
    # --finetune) inside, so that the bundle moves and is deleted with it
    model: ModelFile | BundleFile
    tokenizer: ModelFile
    max_length: int = Field(ge=2)
    heads_file: BundleFile
    heads: dict[str, HeadInfo]
    ngrams: NgramInfo | None = None  # None: the heads read the embedding alone
    gate: GateInfo | None = None  # None: every state is answered (bundles before schema 4)

    def model_path(self, directory: Path) -> Path:
        """Where the encoder model is, for a bundle in ``directory``."""
        if isinstance(self.model, BundleFile):
            return Path(directory) / self.model.name
        return Path(self.model.path)

    def files(self, directory: Path) -> EncoderFiles:
        return EncoderFiles(model=self.model_path(directory), tokenizer=Path(self.tokenizer.path))

    def model_files(self) -> Iterator[tuple[str, ModelFile]]:
        if isinstance(self.model, ModelFile):
            yield f"tier {self.name!r} encoder model", self.model
        yield f"tier {self.name!r} tokenizer", self.tokenizer

    def bundle_files(self) -> Iterator[tuple[str, BundleFile]]:
        if isinstance(self.model, BundleFile):
            yield f"tier {self.name!r} fine-tuned encoder model", self.model
        yield "heads file", self.heads_file
        if self.ngrams is not None:
            yield "n-gram features file", self.ngrams.file
        if self.gate is not None:
            yield "familiarity gate file", self.gate.file

    def check_questions(self, questions: Mapping[str, Question]) -> None:
        _check_heads(self.name, self.heads, questions)


def _check_heads(tier: str, heads: Mapping[str, HeadInfo], questions: Mapping[str, Question]) -> None:
    for qid, info in heads.items():
        if qid not in questions:
            raise ValueError(f"tier {tier!r} has a head for unknown question {qid!r}")
        if info.option_keys != questions[qid].option_keys():
            raise ValueError(f"head {qid!r} has option_keys {info.option_keys}; the question's "
                             f"are {questions[qid].option_keys()}")


class GgufTier(TierSpec):
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

    def model_files(self) -> Iterator[tuple[str, ModelFile]]:
        yield f"tier {self.name!r} GGUF model", self.model


class ExternalTier(TierSpec):
    """A top tier known only by its labels (gold labels, another system): no model to run.

    A bundle ending in one can still route, but the caller must give a GGUF at decide time to
    answer what the lower tiers escalate.
    """

    top_only: ClassVar[bool] = True

    kind: Literal["external"] = "external"
    name: str = Field(default="teacher", min_length=1)
    labels: str


class MidLayerTier(TierSpec):
    """The teacher's own first ``layer`` of its ``n_layer`` blocks (``cascade.layer_readout``):
    its prompts fanned out as the teacher's, each question answered from the layer's state at
    its answer position, by a head trained on the teacher's labels (``reader="head"``) or by the
    model's own output rows (``"lens"``, no training). Never the top tier: it has no last layer.
    """

    may_top: ClassVar[bool] = False

    kind: Literal["mid-layer"] = "mid-layer"
    name: str = Field(default="mid-layer", min_length=1)
    model: ModelFile
    layer: int = Field(ge=1)
    n_layer: int = Field(ge=2)
    reader: Literal["head", "lens"] = "head"
    heads_file: BundleFile | None = None  # with reader "head"
    heads: dict[str, HeadInfo] = Field(default_factory=dict)
    n_ctx: int = Field(default=4096, ge=1)
    template: Literal["auto", "chat", "plain"] = "auto"
    placement: Placement = Placement()

    @model_validator(mode="after")
    def _consistent(self) -> MidLayerTier:
        if self.layer >= self.n_layer:
            raise ValueError(f"tier {self.name!r} runs {self.layer} of {self.n_layer} blocks; a "
                             f"mid-layer tier runs fewer than all (at most {self.n_layer - 1})")
        if (self.reader == "head") != (self.heads_file is not None):
            raise ValueError(f"tier {self.name!r}: a heads file goes with reader 'head' only")
        return self

    def default_placement(self) -> Placement:
        return self.placement.over(Placement(n_ctx=self.n_ctx))

    def model_files(self) -> Iterator[tuple[str, ModelFile]]:
        yield f"tier {self.name!r} GGUF model", self.model

    def bundle_files(self) -> Iterator[tuple[str, BundleFile]]:
        if self.heads_file is not None:
            yield f"tier {self.name!r} heads file", self.heads_file

    def check_questions(self, questions: Mapping[str, Question]) -> None:
        _check_heads(self.name, self.heads, questions)


Tier = Annotated[EncoderTier | GgufTier | MidLayerTier | ExternalTier, Field(discriminator="kind")]
TIER_SPECS: tuple[type[TierSpec], ...] = get_args(get_args(Tier)[0])
"""Every kind of tier a manifest may hold, read from ``Tier`` so the two cannot disagree."""
