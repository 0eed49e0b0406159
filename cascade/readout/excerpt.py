"""Cutting a state that does not fit the teacher's context, and what a state too long is told.

A state past the context is refused unless an excerpt policy cuts it (``head_tail:N``: its first
and last tokens within N, with a mark between). The refusal says what can work: a context large
enough, or an excerpt length that fits beside the prompt's own tokens, and where the prompt
around the state alone fills the context, that no excerpt can (it advised half the context
whatever the prompt took, and the same again to a state already cut so).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from cascade.errors import RequestError

MARK = "\n[...]\n"
"""What stands for the cut middle of a state."""
SLACK = 8
"""Tokens left spare where a refusal suggests an excerpt's length: the mark, and tokens merged
otherwise where the state meets the prompt."""


class Tokenizer(Protocol):
    def tokenize(self, text: str) -> list[int]: ...

    def detokenize(self, tokens: list[int]) -> str: ...


@dataclass(frozen=True)
class HeadTailExcerpt:
    """Keep the state's first and last tokens within ``max_tokens`` when the prompt is too long."""

    max_tokens: int

    @property
    def label(self) -> str:
        return f"head_tail:{self.max_tokens}"

    @classmethod
    def parse(cls, text: str) -> HeadTailExcerpt:
        kind, _, size = text.partition(":")
        if kind != "head_tail" or not size.isdigit() or int(size) < 2:
            raise RequestError(f"excerpt policy must look like 'head_tail:1024'; got {text!r}")
        return cls(int(size))

    def cut(self, model: Tokenizer, state_text: str) -> str:
        """``state_text`` itself where it fits ``max_tokens``, else its head and tail."""
        tokens = model.tokenize(state_text)
        if len(tokens) <= self.max_tokens:
            return state_text
        head = self.max_tokens // 2
        tail = self.max_tokens - head
        return model.detokenize(tokens[:head]) + MARK + model.detokenize(tokens[-tail:])


def excerpt_remedy(tokens: int) -> str:
    return (f"raise the context (--n-ctx / n_ctx), or score a head-and-tail excerpt of the state "
            f"(--excerpt / excerpt) such as head_tail:{tokens}")


def fitting_remedy(n_ctx: int, around: int) -> str:
    """What to do where the prompt takes ``around`` tokens besides the state: an excerpt that
    fits beside them, or, where they alone fill the context, a larger context."""
    room = n_ctx - around - SLACK
    if room >= 2:
        return excerpt_remedy(room)
    return (f"the prompt around the state alone takes about {around} tokens, so no excerpt of the state "
            "fits: raise the context (--n-ctx / n_ctx) above that")
