"""The prompt head: a prompt's tokens before the state, decoded once and copied into each request.

A scorer keeps the tokens every prompt of a run starts with (chat template, system text, evidence
heading; with the options first, the question block too) in a sequence of its own and copies them
into sequence 0 (``llama_memory_seq_cp``) instead of prefilling them again. The head is always
decoded in a batch of its own, so an answer is the same to the last bit whether the head was
decoded now or copied. Details and figures: docs/scorer.md.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from cascade.readout.llama import LlamaContext
from cascade.readout.prompts import Layout, PromptTemplate

MIN_HEAD = 8
"""Fewest tokens worth splitting off as a head (a sequence copy and a decode call of their own)."""
_TEXTS = 256
"""Head texts kept (one per question block with the options first); past it the cache restarts."""


class PromptHead:
    """The head held in sequence ``seq`` of ``ctx``, for prompts of ``template`` in ``layout``."""

    def __init__(self, ctx: LlamaContext, seq: int, template: PromptTemplate, layout: Layout) -> None:
        self.ctx, self.seq, self.template, self.layout = ctx, seq, template, layout
        self.tokens: list[int] = []  # what the head sequence holds
        self._texts: dict[str, str] = {}  # block ("" with the state first) -> text before the state
        self._tokenized: dict[str, list[int]] = {}  # head text -> its tokens

    def __len__(self) -> int:
        return len(self.tokens)

    def text(self, block: str) -> str:
        """A prompt's text before the state: the template's own with the state first, the
        block's too with the options first."""
        key = block if self.layout == "options-first" else ""
        if key not in self._texts:
            if len(self._texts) >= _TEXTS:
                self._texts.clear()
            self._texts[key] = self.template.head(block, self.layout)
        return self._texts[key]

    def _head_of(self, shared: list[int], texts: Sequence[str], tokenize: Callable[[str], list[int]]
                 ) -> list[int]:
        """The prompts' common text before the state, tokenized (once per text), as far as
        ``shared`` starts with it (none below ``MIN_HEAD``)."""
        text = texts[0]
        for other in texts[1:]:
            text = text[:common_prefix(text, other)]
        if text not in self._tokenized:
            if len(self._tokenized) >= _TEXTS:
                self._tokenized.clear()
            self._tokenized[text] = tokenize(text) if text else []
        n = common_prefix(self._tokenized[text], shared)
        return shared[:n] if n >= MIN_HEAD else []

    def forget(self) -> None:
        """Drop the head; the next prefill decodes it again."""
        self.ctx.drop_sequence(self.seq)
        self.tokens = []

    def prefill(self, shared: list[int], texts: Sequence[str], tokenize: Callable[[str], list[int]]
                ) -> None:
        """Sequence 0 holds ``shared`` (every prompt's shared tokens; ``texts`` their text before
        the state) and nothing else does but the head: the head in a batch of its own (copied
        where it is held already), then the rest in the next."""
        self.ctx.keep_only(self.seq)
        head = self._head_of(shared, texts, tokenize)
        if head != self.tokens:
            self.forget()
            self.tokens = head
            if head:
                self.ctx.decode([(self.seq, 0, head)], outputs=False)
        if head:
            self.ctx.copy_sequence(self.seq, 0)
        if shared[len(head):]:
            self.ctx.decode([(0, len(head), shared[len(head):])], outputs=False)


def common_prefix(a: Sequence[int] | str, b: Sequence[int] | str) -> int:
    """How many leading tokens (or characters) ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
