"""Versioned prompt templates for the logit readout.

A readout prompt puts the state (the evidence) first and the question last, so that every question
about one state shares the longest possible token prefix (the fan-out prefills it once), and it
ends exactly where the answer letter goes. Any change to the text here changes answers, so it must
come with a new ``PROMPT_VERSION``: label stores and bundles refuse to mix versions.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from cascade.errors import ModelError
from cascade.questions import OPTION_LETTERS, NoulQuestion, Question, ScoreQuestion, State

PROMPT_VERSION = "readout-v1"

SYSTEM_TEXT = (
    "You are a careful classifier. Read the evidence, then answer the question with the letter "
    "of exactly one option."
)
_NOUL_LABELS = ("Yes", "No")


def render_state(state: State) -> str:
    """The state as prompt text: text as-is, JSON objects and arrays as indented JSON."""
    if isinstance(state, str):
        return state.strip()
    return json.dumps(state, ensure_ascii=False, indent=2)


def _option_label(question: Question, index: int, text: str | None) -> str:
    if isinstance(question, NoulQuestion):
        label = _NOUL_LABELS[index]
        return f"{label}: {text}" if text else label
    if isinstance(question, ScoreQuestion):
        return text if text else f"level {index}"
    key = question.option_keys()[index]
    return f"{key}: {text}" if text else key


def question_block(question: Question, order: Sequence[int]) -> str:
    """The question and its options, lettered in ``order`` (order[j] = option shown as letter j)."""
    texts = question.option_texts()
    lines = [f"Question: {question.instructions_text()}", "Options:"]
    for letter, option in zip(OPTION_LETTERS, order, strict=False):
        lines.append(f"{letter}. {_option_label(question, option, texts[option])}")
    letters = OPTION_LETTERS[: len(order)]
    lines.append(f"Answer with one letter ({letters[0]}-{letters[-1]}).")
    return "\n".join(lines)


def _raise_template_error(message: str) -> None:
    raise TemplateError(message)


@dataclass(frozen=True)
class PromptTemplate:
    """How one model is prompted: its own chat template when it has one, else a plain layout.

    ``letter_lead`` is the text the answer letter carries in front of it in that layout (a space
    after "Answer:" in the plain one, nothing after a chat template's generation prompt).
    """

    kind: Literal["chat", "plain"]
    chat_template: str | None = None
    bos_text: str = ""

    @property
    def letter_lead(self) -> str:
        return "" if self.kind == "chat" else " "

    def render(self, state_text: str, block: str) -> str:
        user = f"Evidence:\n{state_text}\n\n{block}"
        if self.kind == "plain":
            return f"{SYSTEM_TEXT}\n\n{user}\n\nAnswer:"
        return self._render_chat(user)

    def _render_chat(self, user: str) -> str:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_template_error
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": SYSTEM_TEXT},
            {"role": "user", "content": user},
        ]
        try:
            template = env.from_string(self.chat_template or "")
            return template.render(
                messages=messages,
                add_generation_prompt=True,
                enable_thinking=False,
                bos_token=self.bos_text,
                eos_token="",
            )
        except TemplateError as exc:
            raise ModelError(
                f"the model's chat template failed to render ({exc}); "
                f"score with template='plain' to use the plain completion layout"
            ) from exc


def prompt_hash(prompts: Sequence[str]) -> str:
    """sha256 of the exact prompt texts a question was scored with (all option orders)."""
    digest = hashlib.sha256()
    for text in prompts:
        digest.update(text.encode("utf-8"))
        digest.update(b"\x1e")
    return digest.hexdigest()
