"""One interface for every tier of the cascade: items and questions in, raw distributions out.

A tier answers the questions it can for each item and leaves the rest out (the router starts those
at the next tier). Tiers return RAW probabilities in each question's ``option_keys()`` order;
temperatures and thresholds belong to the router, which owns the calibration.

A tier also says what it costs (``flops_per_token`` for the roofline, ``pricing`` for the cost
model) and how it is run (``batch_size``, ``batch_sensitive``), so that the router, the cost model
and calibration ask it instead of testing which class it is. ``cascade.tierkinds`` builds tiers
from a bundle's manifest.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np

from cascade.answers import Readout, Usage
from cascade.encoder import EmbeddingCache, Encoder
from cascade.errors import CascadeError, InputTooLongError
from cascade.familiar import FamiliarityGate
from cascade.heads import HeadStack, SoftmaxHead
from cascade.layer_readout import LayerAnswers, LayerScorer
from cascade.ngrams import NgramFeatures, beside
from cascade.pricing import TEACHER_PARAMS, TierCost, TierPricing, estimate_tokens, gguf_flops_per_token
from cascade.prompts import render_state
from cascade.questions import DecisionRequest, Question, State
from cascade.readout import HeadTailExcerpt, Scorer


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
    (the router then sends the item up: ``cascade.familiar``), and why a GGUF tier below the top
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


class HeadsTier(Tier):
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


class _LlamaTier(Tier):
    """A tier on a llama.cpp scorer: where it runs, its precision and its tokens are the scorer's.

    ``passes_long``: a state whose prompt its context cannot hold is left unanswered, the reason
    in ``Reply.too_long``, for the router to send up (a tier below the top: the teacher may hold
    it); False (the top tier, and the default) raises ``InputTooLongError``, as nothing above
    could answer.
    """

    scorer: Scorer
    passes_long: bool = False

    def _read_each(self, items: Sequence[Item], asked: Asked,
                   read: Callable[[Reply, int, Item, Sequence[str]], None]) -> Reply:
        """``read(reply, i, item, qids)`` for every item asked something; an over-long state
        recorded (``passes_long``) or raised."""
        out = Reply.empty(len(items))
        for i, (item, qids) in enumerate(zip(items, asked, strict=True)):
            if not qids:
                continue
            try:
                read(out, i, item, qids)
            except InputTooLongError as exc:
                if not self.passes_long:
                    raise
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


class ReadoutTier(_LlamaTier):
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
        passes_long: bool = False,
    ) -> None:
        """``passes_long``: True below the top tier (``_LlamaTier``)."""
        self.name = name
        self.scorer = scorer
        self.permutations = permutations
        self.excerpt = excerpt
        self.owned = owned
        self.passes_long = passes_long

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


class LayerTier(_LlamaTier):
    """The mid-layer tier: the teacher's prompts through its first ``layer`` blocks, each asked
    question answered from the layer's state at its answer position (``cascade.layer_readout``).

    Priced as a readout of the teacher at ``layer / n_layer`` of its FLOPs per token; what it
    computed is not reused by an escalation, which runs the whole teacher from the start.
    """

    batch_sensitive = True
    meters_tokens = True
    passes_long = True  # never the top tier

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


class LabelsTier(Tier):
    """Teacher answers recorded in a label store, for replaying a cascade on labelled items.

    ``labels`` maps question id -> item id -> probabilities keyed like the answers (the shape of
    a label store's labels). A missing label is an error, never a silent gap. The tier is priced
    as the teacher whose answers these are: the GGUF ``model`` read with ``permutations`` option
    orders, or, for an external teacher (None), a model of TEACHER_PARAMS weights.
    """

    def __init__(self, name: str, labels: Mapping[str, Mapping[str, Mapping[str, float]]],
                 model: Path | None = None, permutations: int = 1) -> None:
        self.name = name
        self.labels = labels
        self.model = model
        self.permutations = permutations

    def flops_per_token(self) -> float:
        return 2.0 * TEACHER_PARAMS if self.model is None else gguf_flops_per_token(self.model)

    def pricing(self, cost: TierCost) -> TierPricing:
        """As a readout, with tokens estimated from the characters: no tokenizer is loaded."""
        return TierPricing(cost, estimate_tokens, fanout=True, permutations=self.permutations)

    def answer(self, items: Sequence[Item], asked: Asked, questions: Mapping[str, Question]) -> Answers:
        out: Answers = [{} for _ in items]
        for i, (item, qids) in enumerate(zip(items, asked, strict=True)):
            for qid in qids:
                row = self.labels.get(qid, {}).get(item.id)
                if row is None:
                    raise CascadeError(
                        f"tier {self.name!r} has no teacher label for item {item.id!r}, question "
                        f"{qid!r}; label it first (cascade label) or give a GGUF teacher"
                    )
                out[i][qid] = np.asarray([row[key] for key in questions[qid].option_keys()])
        return out
