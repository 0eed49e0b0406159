"""Versioned prompt templates for the logit readout.

A readout prompt puts the state first and the question last, so that every question about a state
shares the longest token prefix, and it ends exactly where the answer letter goes. Any change to
the text here changes answers, so it must come with a new ``PROMPT_VERSION``: label stores and
bundles refuse to mix versions. The options-first layout is a prompt version of its own
(``OPTIONS_FIRST_VERSION``); ``plan_layout`` says which layout prefills fewer tokens. See
docs/scorer.md.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from cascade.errors import ModelError
from cascade.questions import OPTION_LETTERS, NoulQuestion, Question, ScoreQuestion, State

PROMPT_VERSION = "readout-v1"
OPTIONS_FIRST_VERSION = "readout-v1-options-first"

Layout = Literal["state-first", "options-first"]
LAYOUTS: tuple[Layout, ...] = ("state-first", "options-first")
_VERSIONS: dict[Layout, str] = {"state-first": PROMPT_VERSION, "options-first": OPTIONS_FIRST_VERSION}

FINALISTS_HEADING = "Options (finalists, each the pick of a group of options):"
"""Heads the second round's block; the round's prompts part from the first round's right there,
so the tokens every prompt of both rounds shares end before it (``cascade.readout.scorer``)."""
SYSTEM_TEXT = (
    "You are a careful classifier. Read the evidence, then answer the question with the letter "
    "of exactly one option."
)
_NOUL_LABELS = ("Yes", "No")


def render_state(state: State) -> str:
    """The state as prompt text: text as-is, JSON objects and arrays as indented JSON.

    Indented JSON costs a nested state far more characters than its body (each level indents
    every line below it), so a server checks ``state_size`` before anything renders it."""
    if isinstance(state, str):
        return state.strip()
    return json.dumps(state, ensure_ascii=False, indent=2)


@dataclass(frozen=True)
class StateSize:
    """What a state costs before it is rendered: ``chars``, the exact length of
    ``render_state(state)``, and ``depth``, its nesting (0 for text and scalars)."""

    chars: int
    depth: int


def state_size(state: State, max_depth: int | None = None) -> StateSize:
    """``render_state``'s length and the state's nesting, computed without rendering it: the
    compact JSON (C speed, linear in the body) plus what indenting adds to each container, walked
    level by level without recursion. Rendering first is what a nested state turns into
    gigabytes. Past ``max_depth`` levels the walk stops: ``depth`` is then ``max_depth + 1``
    and ``chars`` counts the levels walked (a refusal needs no more)."""
    if isinstance(state, str):
        return StateSize(len(state.strip()), 0)
    extra, depth = 0, 0
    level = [state] if isinstance(state, dict | list) and state else []
    while level:
        if max_depth is not None and depth == max_depth:
            return StateSize(extra, depth + 1)
        below: list[Any] = []
        for value in level:
            n = len(value)
            # "[\n", an indented line per item, ",\n" between items, "\n" and the closing
            # indent; an object's items also gain the space after each ": "
            extra += 2 * depth + 1 + n * (2 * depth + 3)
            items = value.values() if isinstance(value, dict) else value
            extra += n if isinstance(value, dict) else 0
            below += [item for item in items if isinstance(item, dict | list) and item]
        level, depth = below, depth + 1
    return StateSize(len(json.dumps(state, ensure_ascii=False, separators=(",", ":"))) + extra, depth)


def read_chars(state: State, questions: Iterable[Question]) -> int:
    """Characters a readout reads to answer ``questions`` about ``state``: the state once (the
    fan-out shares it) and each question's blocks; what admission counts a request's work in."""
    return state_size(state).chars + sum(len(block) for q in questions for block in question_blocks(q))


def _option_label(question: Question, index: int, text: str | None) -> str:
    if isinstance(question, NoulQuestion):
        label = _NOUL_LABELS[index]
        return f"{label}: {text}" if text else label
    if isinstance(question, ScoreQuestion):
        return text if text else f"level {index}"
    key = question.option_keys()[index]
    return f"{key}: {text}" if text else key


def option_groups(n: int, size: int = len(OPTION_LETTERS)) -> list[list[int]]:
    """The options one prompt letters at a time: all of them up to ``size`` (16, the letters),
    else ceil(n / size) groups of near-equal size in the question's order.

    A question of more options is read in two rounds that share the state's prefill: each group
    is asked in a prompt of its own, then the groups' winners (the finalists) in one more, headed
    ``FINALISTS_HEADING``; an option's probability is its finalist's times its share within its
    group. 255 options make 16 groups of 15 or 16, so the finalists fit one prompt.
    """
    if not 2 <= size <= len(OPTION_LETTERS):
        raise ValueError(f"a prompt letters 2 to {len(OPTION_LETTERS)} options; got {size}")
    if n <= size:
        return [list(range(n))]
    count = -(-n // size)
    if count > len(OPTION_LETTERS):
        raise ValueError(f"{n} options in groups of {size} make {count} finalists, more than one "
                         f"prompt letters ({len(OPTION_LETTERS)})")
    bounds = [round(g * n / count) for g in range(count + 1)]
    return [list(range(bounds[g], bounds[g + 1])) for g in range(count)]


def question_blocks(question: Question) -> list[str]:
    """The blocks a readout reads for one option order of ``question``: one per option group,
    and the finalists' (the groups' first options standing in) where there are several."""
    groups = option_groups(len(question.option_keys()))
    blocks = [question_block(question, group) for group in groups]
    if len(groups) > 1:
        blocks.append(question_block(question, [group[0] for group in groups], FINALISTS_HEADING))
    return blocks


def question_block(question: Question, order: Sequence[int], heading: str = "Options:") -> str:
    """The question and options, lettered in ``order`` (order[j] = the option shown as letter j,
    at most 16 of them: a group's, or the finalists' under ``FINALISTS_HEADING``)."""
    if len(order) > len(OPTION_LETTERS):
        raise ValueError(f"one prompt letters at most {len(OPTION_LETTERS)} options; got {len(order)}")
    texts = question.option_texts()
    lines = [f"Question: {question.instructions_text()}", heading]
    for letter, option in zip(OPTION_LETTERS, order, strict=False):
        lines.append(f"{letter}. {_option_label(question, option, texts[option])}")
    letters = OPTION_LETTERS[: len(order)]
    lines.append(f"Answer with one letter ({letters[0]}-{letters[-1]}).")
    return "\n".join(lines)


def split_block(block: str) -> tuple[str, str]:
    """A question block's question and options, and its answer line (its last line): what the
    options-first layout puts before and after the state."""
    ask, cue = block.rsplit("\n", 1)
    return ask, cue


def _raise_template_error(message: str) -> None:
    raise TemplateError(message)


_STATE_MARK = "\x1fstate\x1f"
"""Stands for the state where a render is cut at it (a text no state holds)."""


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

    def head(self, block: str = "", layout: Layout = "state-first") -> str:
        """A prompt's text before the state (template, system text, the evidence heading; with the
        options first, ``block``'s question and options too): what a scorer prefills once per run
        (``cascade.readout.prompt_head``)."""
        return self.render(_STATE_MARK, block or "\n", layout).split(_STATE_MARK)[0]

    def render(self, state_text: str, block: str, layout: Layout = "state-first") -> str:
        """The prompt: state then question block, or (options first) the block's question and
        options, the state, then the block's answer line."""
        if layout == "options-first":
            ask, cue = split_block(block)
            user = f"{ask}\n\nEvidence:\n{state_text}\n\n{cue}"
        else:
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


def _digest(parts: Sequence[str]) -> str:
    return hashlib.sha256("\x1e".join(parts).encode("utf-8")).hexdigest()


def template_sha256(question: Question, version: str = PROMPT_VERSION) -> str:
    """sha256 of what identifies a question's readout prompt apart from the state and the model's
    chat template (which the model's hash pins): the prompt version and the question block."""
    return _digest([version, *question_blocks(question)])


def prompt_version(layout: Layout) -> str:
    """The prompt version a layout reads with."""
    return _VERSIONS[layout]


def layout_of(version: str | None) -> Layout | None:
    """The layout of a prompt version this code reads with; None for any other (or none)."""
    return next((layout for layout, known in _VERSIONS.items() if known == version), None)


def plan_layout(questions: Sequence[Question], permutations: int) -> tuple[Layout, str]:
    """The layout that prefills fewer tokens per item, and why, in words.

    With the prompt head computed once per run, state first costs an item its state, then each
    branch's block and answer line (one branch per question, option order and option group);
    options first costs each branch its state and answer line, and saves the block only where
    every item starts with it: where there is one branch. So options first wins exactly with one
    branch (one question, one option order, at most 16 options), and the fan-out wins otherwise.
    """
    branches = sum(len(question_blocks(q)) for q in questions) * permutations
    if branches == 1:
        return "options-first", ("options-first: one question in one option order, so its block is "
                                 "prefilled once per run and each item reads its state and the answer line")
    return "state-first", (f"state-first: {branches} prompts per item share the state, prefilled once "
                           "per item and fanned out to each block")


def letters_sha256(question: Question) -> str:
    """sha256 of the answers a question allows: each option letter with the key it stands for,
    group by group where one prompt cannot letter them all."""
    keys = question.option_keys()
    return _digest(["\x1d".join(f"{letter}={keys[option]}" for letter, option in zip(OPTION_LETTERS, group,
                                                                                      strict=False))
                    for group in option_groups(len(keys))])
