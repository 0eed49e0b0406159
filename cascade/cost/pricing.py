"""How one tier is priced: seconds per state and per token, and how it counts its tokens.

Each runtime tier prices itself (``Tier.pricing``), from a cost measured at calibration or
estimated on the roofline (``Tier.flops_per_token``); the cost model (``cascade.routing.forecast``)
adds the prices up for the states and questions of a call. A readout tier pays its prompt once per
state and each escalated question's block on top; the prompt head, copied rather than prefilled,
is not charged. The rules in full: docs/budgets.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from cascade.questions import Question
from cascade.readout.prompts import Layout, PromptTemplate, question_blocks, split_block

TEACHER_PARAMS = 4.0e9
"""Weights assumed for an external teacher known only by its labels: the 4B decision model
(Qwen3.5-4B) this project is built around, so a cost ratio against it is the one that matters."""
CHARS_PER_TOKEN = 4.0
"""Where no tokenizer is loaded, a state costs len(text) / 4 tokens: the usual rule of thumb for
English under BPE vocabularies (a ~10-20% error either way; it only ranks and budgets)."""

TokenCounter = Callable[[Sequence[str]], list[int]]


@dataclass(frozen=True)
class TierCost:
    """Seconds a tier takes per state read and per token run; ``source`` says how it was known."""

    seconds_per_state: float
    seconds_per_token: float
    source: str = "measured"


def estimate_tokens(texts: Sequence[str]) -> list[int]:
    """``ceil(len / CHARS_PER_TOKEN)`` tokens per text, at least one."""
    return [max(1, math.ceil(len(text) / CHARS_PER_TOKEN)) for text in texts]


def gguf_flops_per_token(path: Path) -> float:
    """FLOPs one prompt token costs a GGUF model: ``cost.decision_flops`` of one token, read from
    the file's shape (the output rows read and the attention growth past the first token are left
    out: a few % for decisions)."""
    from cascade.cost.roofline import ModelShape, decision_flops

    return decision_flops(ModelShape.from_gguf(Path(path)), prompt_tokens=1, output_rows=0)


@dataclass
class TierPricing:
    """One tier's cost figures and how it counts tokens.

    ``fanout`` tiers (logit readout) charge prompt + per-question suffix tokens; the others (the
    encoder) charge the state's tokens once, whatever the number of questions.
    """

    cost: TierCost
    count_tokens: TokenCounter
    fanout: bool
    permutations: int = 1
    template: PromptTemplate = field(default_factory=lambda: PromptTemplate("plain"))
    layout: Layout = "state-first"
    _suffix: dict[str, int] = field(default_factory=dict)
    _overhead: int | None = None

    def prompt_tokens(self, state_text: str) -> int:
        """Tokens of the shared prompt part a state costs: the state, plus for a readout the
        template around it but its head (prefilled once per run)."""
        if not self.fanout:
            return self.count_tokens([state_text])[0]
        if self._overhead is None:
            whole, head = self.count_tokens([self.template.render("", ""), self.template.head()])
            self._overhead = whole - head
        return self._overhead + self.count_tokens([state_text])[0]

    def suffix_tokens(self, qid: str, question: Question) -> int:
        """Tokens one question adds to a readout: its blocks (one, or each option group's and the
        finalists'), once per option order."""
        if not self.fanout:
            return 0
        if qid not in self._suffix:
            blocks = question_blocks(question)
            if self.layout == "options-first":  # the rest is in the head; the answer line is not
                blocks = [split_block(block)[1] for block in blocks]
            self._suffix[qid] = sum(self.count_tokens(blocks)) * self.permutations
        return self._suffix[qid]
