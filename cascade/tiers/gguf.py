"""The GGUF kind: a logit-readout scorer on a pinned GGUF, below the top or as the teacher.

Its tier reads a state ONCE and fans its questions out (``cascade.readout.scorer``); ``LlamaTier``
is what every llama.cpp tier shares (the mid-layer kind too): where it runs, its precision, its
tokens and what it does with a state longer than its context.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import Field

from cascade.cost.pricing import TierCost, TierPricing, gguf_flops_per_token
from cascade.errors import InputTooLongError, RouterError
from cascade.hashing import file_sha256
from cascade.pins import ModelFile
from cascade.questions import DecisionRequest, Question
from cascade.readout.excerpt import HeadTailExcerpt
from cascade.readout.placement import Placement
from cascade.readout.prompts import Layout
from cascade.readout.scorer import Scorer, branch_slots
from cascade.tiers.base import (
    Answers,
    Asked,
    Build,
    BundleParts,
    Excerpt,
    Item,
    Reply,
    Tier,
    TierKind,
    TierSpec,
    read_excerpt,
)
from cascade.tiers.labels import LabelsTier
from cascade.tiers.upstream import upstream_tier


class GgufSpec(TierSpec):
    """A logit-readout scorer on a GGUF model, with the settings its thresholds were made for."""

    kind: Literal["gguf"] = "gguf"
    name: str = Field(min_length=1)
    model: ModelFile
    n_ctx: int = Field(default=4096, ge=1)
    permutations: int = Field(default=1, ge=1)
    template: Literal["auto", "chat", "plain"] = "auto"
    placement: Placement = Placement()  # where it runs by default; Cascade.load may override it
    excerpt: Excerpt = None  # the input policy's cut of an over-long state

    def default_placement(self) -> Placement:
        """The bundle's placement for this tier, with its certified context size."""
        return self.placement.over(Placement(n_ctx=self.n_ctx))


    def model_files(self) -> Iterator[tuple[str, ModelFile]]:
        yield f"tier {self.name!r} GGUF model", self.model


class LlamaTier(Tier):
    """A tier on a llama.cpp scorer: where it runs, its precision and its tokens are the scorer's.

    A state whose prompt its context cannot hold (and no excerpt policy cuts) is left unanswered,
    the reason in ``Reply.too_long``: below the top the router sends its questions up; at the top
    they keep a lower answer, marked uncertified, or get a per-question error. It never fails the
    other items of a batch.
    """

    scorer: Scorer

    def _read_each(self, items: Sequence[Item], asked: Asked,
                   read: Callable[[Reply, int, Item, Sequence[str]], None]) -> Reply:
        """``read(reply, i, item, qids)`` for every item asked something; an over-long state
        recorded in ``too_long``."""
        out = Reply.empty(len(items))
        for i, (item, qids) in enumerate(zip(items, asked, strict=True)):
            if not qids:
                continue
            try:
                read(out, i, item, qids)
            except InputTooLongError as exc:
                out.too_long[i] = f"{self.name}: {exc}"
        return out

    @property
    def ran_on(self) -> str:
        return self.scorer.ran_on

    @property
    def backend(self) -> str:
        return "llama.cpp"

    @property
    def precision(self) -> str:
        return self.scorer.model.precision

    def count_tokens(self, texts: Sequence[str]) -> list[int]:
        return [len(self.scorer.model.tokenize(text)) for text in texts]


class GgufTier(LlamaTier):
    """A GGUF logit-readout tier: one prefill per state, its asked questions fanned out.

    ``owned``: the tier opened its scorer and closes it; a scorer it was given stays open for
    its owner.
    """

    batch_sensitive = True
    meters_tokens = True
    reads_any_question = True

    def __init__(
        self,
        name: str,
        scorer: Scorer,
        permutations: int = 1,
        excerpt: HeadTailExcerpt | None = None,
        owned: bool = True,
    ) -> None:
        """``excerpt``: how a state longer than the context is read (the bundle's input policy)."""
        self.name = name
        self.scorer = scorer
        self.permutations = permutations
        self.excerpt = excerpt
        self.owned = owned

    def answer(self, items: Sequence[Item], asked: Asked, questions: Mapping[str, Question]) -> Answers:
        return self.reply(items, asked, questions).answers

    def flops_per_token(self) -> float:
        return gguf_flops_per_token(self.scorer.model.path)

    def pricing(self, cost: TierCost) -> TierPricing:
        """The prompt once per state, then each question's block once per option order."""
        return TierPricing(cost, self.count_tokens, fanout=True, permutations=self.permutations,
                           template=self.scorer.template, layout=self.scorer.layout)

    def close(self) -> None:
        if self.owned:
            self.scorer.close()

    def reply(self, items: Sequence[Item], asked: Asked, questions: Mapping[str, Question]) -> Reply:
        def read(out: Reply, i: int, item: Item, qids: Sequence[str]) -> None:
            request = DecisionRequest(state=item.state, questions={q: questions[q] for q in qids})
            response = self.scorer.score(request, permutations=self.permutations, excerpt=self.excerpt)
            out.usage[i] = response.usage
            for qid, ans in response.answers.items():
                out.answers[i][qid] = np.asarray(list(ans.probabilities.values()))
                if ans.readout is not None:
                    out.readouts[i][qid] = ans.readout
                    out.cuts[i] = ans.readout.excerpt

        return self._read_each(items, asked, read)


class GgufKind(TierKind[GgufSpec]):
    """A logit-readout tier on a pinned GGUF, below the top or as the teacher."""

    spec = GgufSpec

    def check_top(self, spec: GgufSpec, bundle_name: str, build: Build) -> None:
        """A teacher given for a pinned top tier must be the pinned model (the same bytes)."""
        if build.teacher is None:
            return
        given = file_sha256(build.teacher)
        if given != spec.model.sha256:
            raise RouterError(f"bundle {bundle_name!r} runs its pinned GGUF {spec.model.path} (sha256 "
                              f"{spec.model.sha256[:12]}...) as the top tier {spec.name!r}; the teacher "
                              f"given, {build.teacher} (sha256 {given[:12]}...), is another model: drop "
                              "--teacher / teacher=, or give the pinned file")

    def build(self, spec: GgufSpec, bundle: BundleParts, build: Build, top: bool) -> Tier:
        """A readout on the pinned file, or the recorded labels in its place at the top.

        Its scorer decodes the ``questions`` x permutations branches of a state in the groups of
        ``cascade.readout.scorer.branch_slots``, wherever it is opened: the batch shape moves the
        numbers, and thresholds must certify the ones routing reads.
        """
        if top and build.labels is not None:
            return LabelsTier(spec.name, build.labels, Path(spec.model.path), spec.permutations)
        if top and build.upstream is not None:  # the pinned GGUF's own server, say (its answers checked)
            return upstream_tier(spec.name, build)
        questions = bundle.question_count
        branches = branch_slots(questions, spec.permutations)
        given = build.scorers.get(spec.name)
        layout: Layout = bundle.teacher_layout if top else "state-first"
        if given is None:
            place = build.placement(spec.name, spec.default_placement())
            scorer = Scorer.placed(spec.model.path, place, branches, spec.template, layout)
            return GgufTier(spec.name, scorer, spec.permutations, read_excerpt(spec.excerpt))
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
        return GgufTier(spec.name, given, spec.permutations, read_excerpt(spec.excerpt), owned=False)

    def weights(self, spec: GgufSpec) -> tuple[float, str]:
        from cascade.cost.roofline import ModelShape

        return float(ModelShape.from_gguf(Path(spec.model.path)).n_params_matmul), spec.model.path


