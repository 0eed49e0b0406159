"""The mid-layer kind: the teacher's own first blocks, read at each question's answer position.

Never the top tier (it has no last layer). Its scorer is ``cascade.readout.layer_scorer``; its
heads are trained by ``distill.training.mid_layer``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import ClassVar, Literal

from pydantic import Field, model_validator

from cascade.cost.pricing import TierCost, TierPricing, gguf_flops_per_token
from cascade.errors import BundleError, RouterError
from cascade.heads import SoftmaxHead
from cascade.pins import BundleFile, ModelFile
from cascade.questions import DecisionRequest, Question
from cascade.readout.layer_scorer import LayerAnswers, LayerScorer, LetterLens
from cascade.readout.placement import Placement
from cascade.readout.scorer import branch_slots
from cascade.tiers.base import (
    Answers,
    Asked,
    Build,
    BundleParts,
    HeadInfo,
    Item,
    Reply,
    Tier,
    TierKind,
    TierSpec,
    check_heads,
    read_heads,
)
from cascade.tiers.gguf import LlamaTier


class MidLayerSpec(TierSpec):
    """The teacher's own first ``layer`` of its ``n_layer`` blocks (``cascade.readout.layer_scorer``):
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
    def _consistent(self) -> MidLayerSpec:
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
        check_heads(self.name, self.heads, questions)


class MidLayerTier(LlamaTier):
    """The mid-layer tier: the teacher's prompts through its first ``layer`` blocks, each asked
    question answered from the layer's state at its answer position (``cascade.readout.layer_scorer``).

    Priced as a readout of the teacher at ``layer / n_layer`` of its FLOPs per token; what it
    computed is not reused by an escalation, which runs the whole teacher from the start.
    """

    batch_sensitive = True
    meters_tokens = True

    scorer: LayerScorer

    def __init__(self, name: str, scorer: LayerScorer, reader: LayerAnswers) -> None:
        self.name, self.scorer, self.reader = name, scorer, reader

    def can_answer(self, qid: str) -> bool:
        return self.reader.lens is not None or qid in self.reader.heads

    def flops_per_token(self) -> float:
        share = self.reader.layer / self.scorer.model.n_layer
        return share * gguf_flops_per_token(self.scorer.model.path)

    def pricing(self, cost: TierCost) -> TierPricing:
        """As the teacher's readout (prompt once per state, each question's block), one order."""
        return TierPricing(cost, self.count_tokens, fanout=True, template=self.scorer.template)

    def close(self) -> None:
        self.scorer.close()

    def answer(self, items: Sequence[Item], asked: Asked, questions: Mapping[str, Question]) -> Answers:
        return self.reply(items, asked, questions).answers

    def reply(self, items: Sequence[Item], asked: Asked, questions: Mapping[str, Question]) -> Reply:
        def read(out: Reply, i: int, item: Item, qids: Sequence[str]) -> None:
            mine = {q: questions[q] for q in qids}
            states = self.scorer.states(DecisionRequest(state=item.state, questions=mine))
            out.usage[i] = states.usage
            out.cuts[i] = states.cut
            for qid, question in mine.items():
                out.answers[i][qid] = self.reader.probabilities(qid, question, states.vectors[qid])

        mine = [[q for q in qids if self.reader.can_answer(q, questions[q])] for qids in asked]
        return self._read_each(items, mine, read)


class MidLayerKind(TierKind[MidLayerSpec]):
    """The teacher's own first blocks, read at each question's answer position (below the top)."""

    spec = MidLayerSpec

    def build(self, spec: MidLayerSpec, bundle: BundleParts, build: Build, top: bool) -> Tier:
        questions = bundle.question_count
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
        return MidLayerTier(spec.name, scorer, reader)

    def weights(self, spec: MidLayerSpec) -> tuple[float, str]:
        raise RouterError(f"tier {spec.name!r} is a mid-layer tier, which is never a bundle's top tier")


def _layer_heads(spec: MidLayerSpec, bundle: BundleParts) -> dict[str, SoftmaxHead]:
    if spec.heads_file is None:
        raise BundleError(f"tier {spec.name!r} reads with heads and names no heads file; re-train")
    return read_heads(bundle.directory / spec.heads_file.name, spec.heads)


