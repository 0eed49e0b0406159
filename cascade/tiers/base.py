"""The parts every tier kind shares: the runtime interface, the manifest spec, the kind's builder.

A *tier kind* is what a manifest's ``"kind"`` names ("encoder", "gguf", "mid-layer", "external",
"upstream"). Each kind lives in one module of this room: its ``<Name>Spec`` (what the manifest
declares and pins), ``<Name>Tier`` (items and questions in, RAW distributions out, and what it costs) and
``<Name>Kind`` (how a spec becomes a runtime tier, registered in ``KINDS`` by
``cascade.tiers.kinds``). Adding a kind is one module and its registration. See
docs/architecture.md.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Generic, Protocol, TypeVar

import numpy as np
from pydantic import AfterValidator, BaseModel, ConfigDict

from cascade.answers import Readout, Usage
from cascade.cost.pricing import TierCost, TierPricing, estimate_tokens
from cascade.encoder.ngrams import NgramFeatures
from cascade.encoder.onnx_encoder import Device, Encoder
from cascade.errors import BundleError, ModelError
from cascade.heads import SoftmaxHead, load_heads
from cascade.pins import BundleFile, ModelFile
from cascade.questions import Question, State
from cascade.readout.excerpt import HeadTailExcerpt
from cascade.readout.placement import Placement, Placements, for_tier
from cascade.readout.prompts import Layout
from cascade.readout.scorer import Scorer
from cascade.teachers.identity import EndpointIdentity
from cascade.teachers.settings import UpstreamSettings


@dataclass(frozen=True)
class Item:
    """A state with the id it has in a corpus (label stores key teacher answers by it)."""

    id: str
    state: State


Asked = Sequence[Sequence[str]]
"""Per item, the question ids to answer."""
Answers = list[dict[str, np.ndarray]]
"""Per item, question id -> probabilities (option_keys order) for the questions answered."""


@dataclass
class Reply:
    """A tier's answers with what they took: per item, the llama.cpp work, from a readout tier how
    each answer was read (prompt hash, letter mass), how the tier shortened the item's state
    (None: read whole), whether the encoder's gate found the state unlike its training items
    (the router then sends the item up: ``cascade.encoder.familiar``), and why a GGUF tier below the top
    could not read the state at all (its prompt longer than the tier's context: the router sends
    it up too), so routed answers keep all of it."""

    answers: Answers
    usage: list[Usage]
    readouts: list[dict[str, Readout]]
    cuts: list[str | None]
    unfamiliar: list[bool]
    too_long: list[str | None]

    @classmethod
    def empty(cls, n: int) -> Reply:
        return cls([{} for _ in range(n)], [Usage() for _ in range(n)], [{} for _ in range(n)],
                   [None] * n, [False] * n, [None] * n)


class Tier(ABC):
    """A way to answer questions; ``name`` matches the bundle's tier name.

    ``batch_sensitive``: its answers move with the batch of questions read together (a fan-out
    decodes them in one batch), so below the top it is asked the batch calibration certified.
    ``meters_tokens``: ``reply`` reports in its usage the prompt tokens the model ran; otherwise
    ``count_tokens`` of the state texts is what it ran. ``reads_any_question``: it answers any
    question put to it, not only the bundle's (a readout reads the question from its prompt).
    """

    name: str
    batch_sensitive: ClassVar[bool] = False
    meters_tokens: ClassVar[bool] = False
    reads_any_question: ClassVar[bool] = False
    remote: ClassVar[bool] = False
    """Its answers come from another server (an upstream System One URL), not from this process."""

    @property
    def ran_on(self) -> str:
        """Where this tier computes its answers, as every answer's usage records it."""
        return "no model: recorded answers"

    @property
    def backend(self) -> str:
        """What computes its answers, as a response's audit names it."""
        return "recorded labels"

    @property
    def precision(self) -> str:
        """The numbers its model computes in (a GGUF's quantization type), for the audit."""
        return "n/a"

    @property
    def batch_size(self) -> int:
        """States worth answering in one call when there are many (1: one at a time)."""
        return 1

    def can_answer(self, qid: str) -> bool:
        """Whether the tier has a way to answer question ``qid`` at all."""
        return True

    @abstractmethod
    def answer(self, items: Sequence[Item], asked: Asked, questions: Mapping[str, Question]) -> Answers:
        """Distributions for the asked questions this tier can answer; the others are omitted."""

    def reply(self, items: Sequence[Item], asked: Asked, questions: Mapping[str, Question]) -> Reply:
        """``answer`` with its usage and readouts; tiers without llama.cpp report none."""
        reply = Reply.empty(len(items))
        reply.answers = self.answer(items, asked, questions)
        return reply

    def count_tokens(self, texts: Sequence[str]) -> list[int]:
        """Tokens per state text as this tier counts them (``CHARS_PER_TOKEN`` without a tokenizer)."""
        return estimate_tokens(texts)

    @abstractmethod
    def flops_per_token(self) -> float:
        """FLOPs each prompt token costs the tier: its roofline price where none was measured."""

    @abstractmethod
    def pricing(self, cost: TierCost) -> TierPricing:
        """How the cost model charges this tier ``cost`` for a state and its questions."""

    def close(self) -> None:
        """Free what the tier opened (a llama.cpp model); nothing by default."""
        return None


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


def _check_excerpt(value: str | None) -> str | None:
    if value is not None:
        HeadTailExcerpt.parse(value)
    return value


Excerpt = Annotated[str | None, AfterValidator(_check_excerpt)]
"""The input policy's cut of an over-long state (``head_tail:N``; None: none), checked on read."""


def read_excerpt(policy: str | None) -> HeadTailExcerpt | None:
    return HeadTailExcerpt.parse(policy) if policy else None


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


def check_heads(tier: str, heads: Mapping[str, HeadInfo], questions: Mapping[str, Question]) -> None:
    for qid, info in heads.items():
        if qid not in questions:
            raise ValueError(f"tier {tier!r} has a head for unknown question {qid!r}")
        if info.option_keys != questions[qid].option_keys():
            raise ValueError(f"head {qid!r} has option_keys {info.option_keys}; the question's "
                             f"are {questions[qid].option_keys()}")


def read_heads(path: Path, infos: Mapping[str, HeadInfo]) -> dict[str, SoftmaxHead]:
    """A tier's heads file, refused unless it holds exactly the heads its manifest lists."""
    try:
        heads = load_heads(path)
    except ModelError as exc:
        raise BundleError(f"{exc}; re-train the bundle") from exc
    expected = {qid for qid, info in infos.items() if info.has_head}
    if set(heads) != expected:
        raise BundleError(f"heads file {path} has heads for {sorted(heads)}; the manifest "
                          f"expects {sorted(expected)}; re-train the bundle")
    for qid, head in heads.items():
        if head.n_classes_ != len(infos[qid].option_keys):
            raise BundleError(f"heads file {path}: head {qid!r} has {head.n_classes_} classes, "
                              f"the manifest {len(infos[qid].option_keys)}; re-train")
    return heads


class BundleParts(Protocol):
    """What a tier kind reads of the bundle it builds a tier for (``cascade.bundle.Bundle``)."""

    directory: Path

    @property
    def heads(self) -> dict[str, SoftmaxHead]: ...

    @property
    def ngrams(self) -> NgramFeatures | None: ...

    @property
    def question_count(self) -> int: ...

    @property
    def teacher_layout(self) -> Layout: ...

    @property
    def tier_specs(self) -> Sequence[TierSpec]: ...


Labels = Mapping[str, Mapping[str, Mapping[str, float]]]
"""question id -> item id -> probabilities: the shape of a label store's labels."""


@dataclass(frozen=True)
class Build:
    """How to build a bundle's runtime tiers.

    ``teacher`` (a GGUF) answers an external top tier; ``upstream`` (a System One URL) answers
    the top tier in its place, whatever its kind, its answers checked against
    ``upstream_identity`` (None: pinned from the first); ``labels`` (recorded answers) replace the
    top tier, whatever its kind. ``device`` and ``cache_dir`` (an embedding cache) are for the
    encoder; ``threads`` for every model; ``placements`` for GGUF tiers (cascade.readout.placement).
    ``encoder`` and ``scorers`` (by tier name) are models already open to reuse: each must be the
    file its tier pins, and a scorer must decode the batches the router's would.
    """

    teacher: Path | None = None
    upstream: UpstreamSettings | None = None
    upstream_identity: EndpointIdentity | None = None
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
    def build(self, spec: S, bundle: BundleParts, build: Build, top: bool) -> Tier:
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


