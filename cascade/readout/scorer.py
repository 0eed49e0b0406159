"""The logit-readout scorer: one forward pass per question, no generated token.

Every question about a state is rendered as a full prompt and tokenised; the tokens all prompts
share form the prefix, the rest are per-branch suffixes. Three decode paths run exactly those
tokens: ``fanout`` (prefill once, ``llama_memory_seq_cp`` to N branches, ONE ``llama_decode``;
works on hybrid models), ``serial`` (snapshot and restore per question) and ``fresh`` (one full
prompt per question, the reference). Nothing falls back from one path to another: the caller
names the path. The prompt head is copied in by ``cascade.readout.prompt_head``. See
docs/scorer.md.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Literal

import numpy as np

from cascade.answers import Answer, Audit, DecisionResponse, Readout, Usage
from cascade.checks import is_int
from cascade.errors import InputTooLongError, ModelError, RequestError
from cascade.hashing import file_sha256
from cascade.questions import OPTION_LETTERS, DecisionRequest, Question
from cascade.readout.excerpt import HeadTailExcerpt, excerpt_remedy, fitting_remedy
from cascade.readout.llama import ContextConfig, LlamaContext, LlamaModel
from cascade.readout.orders import Order, balanced_orders, unpermute
from cascade.readout.placement import ExtraBuffers, Placement, say_once
from cascade.readout.prompt_head import PromptHead, common_prefix
from cascade.readout.prompts import (
    FINALISTS_HEADING,
    Layout,
    PromptTemplate,
    letters_sha256,
    option_groups,
    prompt_hash,
    prompt_version,
    question_block,
    render_state,
    template_sha256,
)
from cascade.readout.turns import one_at_a_time

DecodePath = Literal["fanout", "serial", "fresh"]
PATHS: tuple[DecodePath, ...] = ("fanout", "serial", "fresh")
MAX_BRANCHES = 64


def branch_slots(questions: int, permutations: int = 1) -> int:
    """Branches one decode holds for a state: every (question, option order), up to MAX_BRANCHES.

    Routing, calibration and labelling all size their scorers here, because the batch shape
    moves the numbers: a threshold certifies only answers read in the groups it was read in.
    """
    return max(1, min(MAX_BRANCHES, questions * permutations))


@dataclass
class _Branch:
    """One prompt: a question's options (``shown``: all of them, one group's, or the finalists'),
    lettered in ``order`` (letter j shows option ``shown[order[j]]``)."""

    question_id: str
    order: Order
    text: str
    tokens: list[int]
    shown: tuple[int, ...]
    final: bool = False
    head: str = ""  # the prompt's text before the state


@dataclass
class _Readings:
    """Letter probabilities and vocabulary mass on the letters, one row per branch."""

    probabilities: list[np.ndarray]
    letter_mass: list[float]


class Scorer:
    """Answers System One questions about a state from option-letter logits of a GGUF model.
    Safe to call from several threads: one request reads at a time (``one_at_a_time``)."""

    def __init__(
        self,
        model_path: str | Path,
        n_ctx: int = 4096,
        max_branches: int = 16,
        n_threads: int | None = None,
        n_gpu_layers: int = 0,
        template: Literal["auto", "chat", "plain"] = "auto",
        chat_template: str | None = None,
        extra_buffers: ExtraBuffers | None = None,
        letters_per_prompt: int = len(OPTION_LETTERS),
        layout: Layout = "state-first",
    ) -> None:
        """``chat_template`` (Jinja text) replaces the one in the GGUF, e.g. for a file without one.
        ``layout``: the state before the questions (the fan-out's) or the options first
        (``cascade.readout.prompts``); each is its own prompt version, which every answer records.
        ``letters_per_prompt``: most options one prompt letters (16); a question of more is read
        in two rounds (``cascade.readout.prompts.option_groups``). Fewer is for measuring the rounds
        against one prompt (bench/option_rounds.py); the cost model prices groups of 16.

        ``n_gpu_layers`` and ``extra_buffers`` place the model (cascade.readout.placement): GPU layers on a
        build without GPU offload are refused, never run on the CPU in silence. An ``n_ctx`` beyond
        the model's trained context is lowered to it, said once and recorded in :attr:`ran_on`.
        """
        self.lock = threading.Lock()
        if max_branches < 1:
            raise RequestError(f"max_branches must be at least 1; got {max_branches}")
        option_groups(2, letters_per_prompt)  # refuses a size no prompt can letter
        if layout not in ("state-first", "options-first"):
            raise RequestError(f"layout must be 'state-first' or 'options-first'; got {layout!r}")
        if template not in ("auto", "chat", "plain"):  # "Chat" read as a chat template of none
            raise RequestError(f"template must be 'auto', 'chat' or 'plain'; got {template!r}")
        if n_threads is not None and (not is_int(n_threads) or n_threads < 1):
            raise RequestError(f"n_threads must be a whole number >= 1, or None (the free cores); "
                               f"got {n_threads!r}")
        self.letters_per_prompt = letters_per_prompt
        self.layout: Layout = layout
        self.prompt_version = prompt_version(layout)
        self.model = LlamaModel(model_path, n_gpu_layers=n_gpu_layers, extra_buffers=extra_buffers)
        self.n_ctx_note = ""
        if n_ctx > self.model.n_ctx_train > 0:
            self.n_ctx_note = f"n_ctx {self.model.n_ctx_train}, the model's trained context ({n_ctx} asked)"
            say_once(f"{self.model.path.name}: {self.n_ctx_note}")
            n_ctx = self.model.n_ctx_train
        self.template = self._choose_template(template, chat_template)
        self.ctx = self._context(ContextConfig(n_ctx=n_ctx, n_seq_max=max_branches + 2,
                                               n_threads=n_threads, reserved=1))
        self.letter_ids = self._letter_ids()
        self.head = PromptHead(self.ctx, max_branches + 1, self.template, layout)

    @classmethod
    def placed(cls, model_path: str | Path, place: Placement, max_branches: int = 16,
               template: Literal["auto", "chat", "plain"] = "auto", layout: Layout = "state-first"
               ) -> Scorer:
        """A scorer where ``place`` says (fields left None: CPU, all cores, 4096 tokens)."""
        return cls(model_path, n_ctx=place.n_ctx or 4096, max_branches=max_branches,
                   n_threads=place.threads, n_gpu_layers=place.gpu_layers or 0, template=template,
                   extra_buffers=place.extra_buffers, layout=layout)

    def _context(self, config: ContextConfig) -> LlamaContext:
        """The decoding context (``cascade.readout.layer_scorer`` adds its layer tap here)."""
        return LlamaContext(self.model, config)

    def _choose_template(self, template: str, override: str | None) -> PromptTemplate:
        chat = override or self.model.meta("tokenizer.chat_template")
        if template == "chat" and not chat:
            raise ModelError(f"{self.model.path.name} has no chat template; use template='plain'")
        if template == "plain" or (template == "auto" and not chat):
            return PromptTemplate("plain")
        return PromptTemplate("chat", chat, self.model.bos_text())

    def _tokens(self, text: str) -> list[int]:
        tokens = self.model.tokenize(text)
        bos = self.model.bos_token()
        if self.model.add_bos() and bos >= 0 and (not tokens or tokens[0] != bos):
            tokens.insert(0, bos)
        return tokens

    def _letter_ids(self) -> np.ndarray:
        """Token ids of "A".."P" as they follow this template's prompt, verified to be safe.

        Each letter must be ONE token in the prompt's own leading context, and appending it must
        leave the prompt's tokens unchanged; otherwise logits at the prompt's end say nothing
        about that letter.
        """
        probe = self.template.render("The evidence.", "Question: Which?")
        base = self._tokens(probe)
        ids = []
        for letter in OPTION_LETTERS:
            full = self._tokens(probe + self.template.letter_lead + letter)
            if full[: len(base)] != base or len(full) != len(base) + 1:
                raise ModelError(
                    f"{self.model.path.name} cannot serve a letter readout: "
                    f"{self.template.letter_lead + letter!r} after the prompt is not one token of its "
                    f"own (got {len(full) - len(base)} new tokens); use a model whose vocabulary has "
                    f"single-token capital letters"
                )
            ids.append(full[-1])
        if len(set(ids)) != len(ids):
            raise ModelError(f"{self.model.path.name} maps two option letters to one token")
        return np.asarray(ids, dtype=np.int64)

    @property
    def model_sha256(self) -> str:
        """The model file's sha256, hashed once per process (cascade.hashing), not per answer."""
        return file_sha256(self.model.path)

    @cached_property
    def ran_on(self) -> str:
        """Where this scorer runs, as each answer's usage records it."""
        model = self.model
        if model.gpu_layers:
            place = f"gpu: {min(model.gpu_layers, model.n_layer + 1)} of {model.n_layer + 1} layers offloaded"
        else:
            place = "cpu"
        buffers = "on" if model.extra_buffers else "off"
        threads = f"{self.ctx.threads} thread{'s' if self.ctx.threads != 1 else ''}"
        if self.ctx.threads_reason != "asked":
            threads += f" ({self.ctx.threads_reason})"
        parts = [place, threads, f"extra buffers {buffers} ({model.extra_buffers_reason})"]
        return ", ".join(parts + ([self.n_ctx_note] if self.n_ctx_note else []))

    @one_at_a_time
    def close(self) -> None:
        self.ctx.close()
        self.model.close()

    @one_at_a_time
    def score(
        self,
        request: DecisionRequest,
        path: DecodePath = "fanout",
        permutations: int = 1,
        excerpt: HeadTailExcerpt | None = None,
    ) -> DecisionResponse:
        """Answer every question of ``request`` with the named decode ``path``."""
        if not isinstance(request, DecisionRequest):
            raise RequestError(f"request must be a DecisionRequest (cascade.parse_request(...)); got "
                               f"{type(request).__name__}")
        if path not in PATHS:
            raise RequestError(f"path must be one of {', '.join(PATHS)}; got {path!r}")
        started = time.perf_counter()
        calls, tokens = self.ctx.decode_calls, self.ctx.decoded_tokens
        branches, probes, cut, state_text = self._branches(request, permutations, excerpt)
        shared = _shared_prefix(branches + probes)
        readings = self._read(branches, shared, path)
        if probes:  # the second round: the finalists of questions with more than 16 options
            finals = self._finals(request, state_text, branches, readings, probes, shared, permutations)
            branches += finals
            self._read(finals, shared, path, readings, prefilled=True)
        answers = self._answers(request, branches, readings, cut)
        usage = Usage(
            questions=len(request.questions),
            input_tokens=self.ctx.decoded_tokens - tokens,
            forward_passes=self.ctx.decode_calls - calls,
            seconds=time.perf_counter() - started,
            ran_on={self.model.path.name: self.ran_on},
        )
        return DecisionResponse(model=self.model.path.name, answers=answers, usage=usage,
                                audit=self._audit(request, answers))

    def _audit(self, request: DecisionRequest, answers: dict[str, Answer]) -> Audit:
        """A raw readout's audit: no calibration stands behind its numbers."""
        questions = list(request.questions.values())
        return Audit(model_hash=self.model_sha256, calibration_version="uncalibrated",
                     prompt_template_sha256=[template_sha256(q, self.prompt_version) for q in questions],
                     allowed_token_set_hash=[letters_sha256(q) for q in questions],
                     input_tokens=[a.readout.tokens if a.readout else 0 for a in answers.values()],
                     backend=f"llama.cpp {'gpu' if self.model.gpu_layers else 'cpu'}",
                     precision=self.model.precision)

    def _branches(
        self, request: DecisionRequest, permutations: int, excerpt: HeadTailExcerpt | None
    ) -> tuple[list[_Branch], list[_Branch], str | None, str]:
        """The first round's prompts, the second round's stand-ins (``probes``: what its prompts
        will be like, to size the context and the shared prefix), the excerpt policy used, and
        the state text they read."""
        state_text = render_state(request.state)
        alone = self._past_context(state_text)
        if alone is None:  # the state may fit: render every prompt around it, and see
            branches, probes = self._render(request, state_text, permutations)
            if _longest(branches + probes) <= self.ctx.config.n_ctx:
                return branches, probes, None, state_text
            if excerpt is None:
                raise self._too_long(branches + probes, state_text, state_text)
        elif excerpt is None:
            raise InputTooLongError(
                f"the prompt needs more than {alone} tokens (the state alone {alone}) but the context holds "
                f"{self.ctx.config.n_ctx}; {self._remedy}")
        cut_text = excerpt.cut(self.model, state_text)
        branches, probes = self._render(request, cut_text, permutations)
        if _longest(branches + probes) > self.ctx.config.n_ctx:
            raise self._too_long(branches + probes, state_text, cut_text)
        return branches, probes, excerpt.label, cut_text

    def _render(self, request: DecisionRequest, state_text: str, k: int
                ) -> tuple[list[_Branch], list[_Branch]]:
        branches, probes = [], []
        for qid, question in request.questions.items():
            groups = option_groups(len(question.option_keys()), self.letters_per_prompt)
            for group in groups:
                branches += self._prompts(qid, question, state_text, tuple(group), k)
            if len(groups) > 1:
                stand_ins = tuple(group[0] for group in groups)
                probes += self._prompts(qid, question, state_text, stand_ins, k, final=True)
        return branches, probes

    def _prompts(self, qid: str, question: Question, state_text: str, shown: tuple[int, ...], k: int,
                 final: bool = False) -> list[_Branch]:
        """One prompt per option order of the options ``shown``."""
        heading = FINALISTS_HEADING if final else "Options:"
        out = []
        for order in balanced_orders(len(shown), k):
            block = question_block(question, [shown[i] for i in order], heading)
            text = self.template.render(state_text, block, self.layout)
            out.append(_Branch(qid, order, text, self._tokens(text), shown, final, self.head.text(block)))
        return out

    def _finals(self, request: DecisionRequest, state_text: str, branches: list[_Branch],
                readings: _Readings, probes: list[_Branch], shared: int, k: int) -> list[_Branch]:
        """The second round's prompts: each big question's group winners, after the first round."""
        finals = []
        for qid in dict.fromkeys(probe.question_id for probe in probes):
            groups = _group_readings(branches, readings, qid)
            winners = tuple(shown[int(np.argmax(p))] for shown, p in groups)
            finals += self._prompts(qid, request.questions[qid], state_text, winners, k, final=True)
        first = probes[0].tokens[:shared]
        if any(branch.tokens[:shared] != first for branch in finals):
            raise ModelError(f"{self.model.path.name}: the finalists' prompt does not start with the "
                             "tokens the first round shared; a tokenizer merged across the heading")
        return finals

    def _past_context(self, state_text: str) -> int | None:
        """The state's tokens where they alone fill the context, else None: a state that cannot
        fit is refused (or cut) before a prompt is built around it for every question. A token
        holds at least one byte, so a state of fewer bytes than the context is never tokenized
        here."""
        if len(state_text.encode()) < self.ctx.config.n_ctx:
            return None
        tokens = len(self.model.tokenize(state_text))
        return tokens if tokens >= self.ctx.config.n_ctx else None

    @property
    def _remedy(self) -> str:
        return excerpt_remedy(max(2, self.ctx.config.n_ctx // 2))

    def _too_long(self, branches: list[_Branch], state_text: str, rendered: str) -> InputTooLongError:
        """The refusal, with a remedy that can work (``fitting_remedy``; ``rendered``: the state or
        its excerpt, as ``branches`` hold it)."""
        n_ctx, longest = self.ctx.config.n_ctx, _longest(branches)
        remedy = fitting_remedy(n_ctx, longest - len(self.model.tokenize(rendered)))
        return InputTooLongError(
            f"the prompt needs {longest} tokens (the state alone {len(self.model.tokenize(state_text))}) but "
            f"the context holds {n_ctx}; {remedy}")

    def _read(self, branches: list[_Branch], shared: int, path: DecodePath, readings: _Readings | None = None,
              prefilled: bool = False) -> _Readings:
        """Read ``branches`` (into ``readings``); ``prefilled``: sequence 0 already holds the
        ``shared`` tokens (a second round), so they are not decoded again."""
        readings = readings if readings is not None else _Readings([], [])
        if path == "fresh":
            self.head.forget()
            for branch in branches:
                self.ctx.clear()
                self.ctx.decode([(0, 0, branch.tokens)])
                self._collect(readings, [branch], 0)
            return readings
        if not prefilled:
            self.head.prefill(branches[0].tokens[:shared], [b.head for b in branches], self._tokens)
        if path == "serial":
            self._read_serial(branches, shared, readings)
        else:
            self._read_fanout(branches, shared, readings)
        return readings

    @property
    def prompt_head(self) -> int:
        """Tokens of the prompt head held now: what the next request copies rather than decodes."""
        return len(self.head)

    @one_at_a_time
    def forget_head(self) -> None:
        """Drop the prompt head, so that the next request decodes it again (for measuring with
        and without it: the numbers are the same either way)."""
        self.head.forget()

    def _read_serial(self, branches: list[_Branch], shared: int, readings: _Readings) -> None:
        """Each branch after the shared tokens, sequence 0 restored to them after each (so that a
        second round finds them there)."""
        snapshot = self.ctx.snapshot(0)
        for branch in branches:
            self.ctx.decode([(0, shared, branch.tokens[shared:])])
            self._collect(readings, [branch], 0)
            self.ctx.restore(0, snapshot)

    def _read_fanout(self, branches: list[_Branch], shared: int, readings: _Readings) -> None:
        for group in self._groups(branches, shared):
            for seq in range(1, len(group) + 1):
                self.ctx.copy_sequence(0, seq)
            rows = [(seq, shared, b.tokens[shared:]) for seq, b in enumerate(group, start=1)]
            self.ctx.decode(rows)
            self._collect(readings, group, 0)
            for seq in range(1, len(group) + 1):
                self.ctx.drop_sequence(seq)

    def _groups(self, branches: list[_Branch], shared: int) -> Iterator[list[_Branch]]:
        """Split branches so each group fits the branch slots and the shared context."""
        group: list[_Branch] = []
        used = shared
        for branch in branches:
            size = len(branch.tokens) - shared
            full = len(group) == self.ctx.config.max_branches
            if group and (full or used + size > self.ctx.config.n_ctx):
                yield group
                group, used = [], shared
            group.append(branch)
            used += size
        if group:
            yield group

    def _collect(self, readings: _Readings, group: list[_Branch], first_output: int) -> None:
        for i, branch in enumerate(group):
            logits = self.ctx.logits(first_output + i).astype(np.float64)
            n = len(branch.order)
            letters = logits[self.letter_ids[:n]]
            top = float(logits.max())
            log_total = top + np.log(np.exp(logits - top).sum())
            letter_log = letters.max() + np.log(np.exp(letters - letters.max()).sum())
            readings.probabilities.append(unpermute(_softmax(letters), branch.order))
            readings.letter_mass.append(float(np.exp(letter_log - log_total)))

    def _answers(
        self,
        request: DecisionRequest,
        branches: list[_Branch],
        readings: _Readings,
        cut: str | None,
    ) -> dict[str, Answer]:
        answers: dict[str, Answer] = {}
        for qid, question in request.questions.items():
            picked = [i for i, b in enumerate(branches) if b.question_id == qid]
            readout = Readout(
                model=self.model.path.name,
                model_sha256=self.model_sha256,
                prompt_version=self.prompt_version,
                prompt_hash=prompt_hash([branches[i].text for i in picked]),
                letter_mass=float(np.mean([readings.letter_mass[i] for i in picked])),
                permutations=sum(1 for i in picked if not branches[i].final
                                 and branches[i].shown == branches[picked[0]].shown),
                excerpt=cut,
                tokens=sum(len(branches[i].tokens) for i in picked),
            )
            probs = _combine(len(question.option_keys()), _group_readings(branches, readings, qid),
                             _final_reading(branches, readings, qid))
            answers[qid] = question.answer(probs.tolist(), readout=readout, calibrated=False)
        return answers


def _group_readings(branches: list[_Branch], readings: _Readings, qid: str
                    ) -> list[tuple[tuple[int, ...], np.ndarray]]:
    """Per option group of question ``qid`` (first round): the options shown and their
    probabilities within the group, averaged over the option orders."""
    groups: dict[tuple[int, ...], list[np.ndarray]] = {}
    for branch, p in zip(branches, readings.probabilities, strict=False):
        if branch.question_id == qid and not branch.final:
            groups.setdefault(branch.shown, []).append(p)
    return [(shown, np.mean(ps, axis=0)) for shown, ps in groups.items()]


def _final_reading(branches: list[_Branch], readings: _Readings, qid: str) -> np.ndarray | None:
    """The second round's probabilities over the finalists (one per group), None in one round."""
    finals = [p for branch, p in zip(branches, readings.probabilities, strict=False)
              if branch.question_id == qid and branch.final]
    return np.mean(finals, axis=0) if finals else None


def _combine(n: int, groups: list[tuple[tuple[int, ...], np.ndarray]],
             final: np.ndarray | None) -> np.ndarray:
    """Every option's probability: its group's finalist's, shared as its group's readout shares it."""
    if final is None:
        return groups[0][1]
    probs = np.zeros(n)
    for g, (shown, within) in enumerate(groups):
        probs[list(shown)] = final[g] * within
    return probs


def _softmax(logits: np.ndarray) -> np.ndarray:
    z = np.exp(logits - logits.max())
    return z / z.sum()


def _longest(branches: Sequence[_Branch]) -> int:
    return max(len(b.tokens) for b in branches)


def _shared_prefix(branches: Sequence[_Branch]) -> int:
    """Tokens every branch shares, leaving each at least one token of its own to read logits at."""
    first = branches[0].tokens
    return min(min(common_prefix(first, b.tokens), len(b.tokens) - 1) for b in branches)
