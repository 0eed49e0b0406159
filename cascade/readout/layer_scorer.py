"""The mid-layer tier: the teacher's own prompts, run through its first L blocks only.

It answers from the teacher's layer-L state at each question's answer position (the prompt's last
token), at about L/N of a teacher pass: every decode stops at L (``cascade.readout.layer_tap``).
The prompts and the fan-out are the teacher's (``cascade.readout.scorer``); the answer positions
are decoded one token per branch in a batch of their own. Two readers: ``head`` (a softmax head
per question, trained on the teacher's labels) and ``lens`` (the logit lens, no training). A
question of more than 16 options is not asked of this tier. Details: docs/mid-layer.md.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import gguf
import numpy as np

from cascade.answers import DecisionResponse, Usage
from cascade.errors import ModelError, RequestError
from cascade.heads import SoftmaxHead
from cascade.questions import OPTION_LETTERS, DecisionRequest, Question
from cascade.readout.excerpt import HeadTailExcerpt
from cascade.readout.layer_tap import LayerTap
from cascade.readout.llama import ContextConfig, LlamaContext
from cascade.readout.placement import ExtraBuffers, Placement
from cascade.readout.scorer import DecodePath, Scorer, _Branch, _shared_prefix
from cascade.readout.turns import one_at_a_time


def normalized(states: np.ndarray) -> np.ndarray:
    """States scaled to unit root mean square per row: what a head reads.

    The residual stream grows with depth (to hundreds on gemma), so raw states would make one C
    penalise every layer differently; the model's own final norm divides by the same RMS.
    """
    states = np.asarray(states, dtype=np.float64)
    return states / np.sqrt(np.mean(states * states, axis=-1, keepdims=True) + 1e-12)


@dataclass
class LayerStates:
    """Per question, per layer: the state at the question's answer position; and what it took."""

    vectors: dict[str, dict[int, np.ndarray]]
    usage: Usage
    cut: str | None


class LayerScorer(Scorer):
    """The teacher's prompts, decoded through its first ``layers`` blocks (the deepest one stops
    every decode); reads states, never logits."""

    def __init__(self, model_path: str | Path, layers: Sequence[int], n_ctx: int = 4096,
                 max_branches: int = 16, n_threads: int | None = None, n_gpu_layers: int = 0,
                 template: Literal["auto", "chat", "plain"] = "auto",
                 extra_buffers: ExtraBuffers | None = None) -> None:
        self.tap = LayerTap(layers)
        super().__init__(model_path, n_ctx=n_ctx, max_branches=max_branches, n_threads=n_threads,
                         n_gpu_layers=n_gpu_layers, template=template, extra_buffers=extra_buffers)
        problem = self._unsupported(n_gpu_layers)
        if problem:
            self.close()
            raise ModelError(f"{Path(model_path).name}: {problem}")

    def _unsupported(self, n_gpu_layers: int) -> str | None:
        """Why this model cannot be read to the tap's layers as placed, or None.

        Part of the blocks on a GPU is refused: llama.cpp's scheduler then runs the graph as
        splits, one per device, and the tap's stop ends only the split it falls in, so the later
        ones would still run the blocks above L and the tier would cost what the teacher costs.
        """
        n_layer, deepest = self.model.n_layer, self.tap.layers[-1]
        if deepest >= n_layer:
            return f"has {n_layer} blocks; a mid-layer tier runs fewer than all of them, not {deepest}"
        if 0 < n_gpu_layers <= n_layer:
            return (f"a mid-layer tier runs on one device: {n_gpu_layers} of {n_layer + 1} layers "
                    "offloaded would split the graph, and the blocks above the tapped one would still "
                    "run; offload all (--gpu-layers 99) or none")
        return None

    @classmethod
    def placed_at(cls, model_path: str | Path, layers: Sequence[int], place: Placement,
                  max_branches: int = 16, template: Literal["auto", "chat", "plain"] = "auto"
                  ) -> LayerScorer:
        """A layer scorer where ``place`` says (as ``Scorer.placed``)."""
        return cls(model_path, layers, n_ctx=place.n_ctx or 4096, max_branches=max_branches,
                   n_threads=place.threads, n_gpu_layers=place.gpu_layers or 0, template=template,
                   extra_buffers=place.extra_buffers)

    def _context(self, config: ContextConfig) -> LlamaContext:
        return LlamaContext(self.model, config, self.tap)

    @property
    def ran_on(self) -> str:
        return f"{super().ran_on}, first {self.tap.layers[-1]} of {self.model.n_layer} blocks"

    def score(self, request: DecisionRequest, path: DecodePath = "fanout", permutations: int = 1,
              excerpt: HeadTailExcerpt | None = None) -> DecisionResponse:
        raise ModelError(f"{self.model.path.name} is decoded to block {self.tap.layers[-1]} only, "
                         "so it has no logits to read; use states()")

    @one_at_a_time
    def states(self, request: DecisionRequest, excerpt: HeadTailExcerpt | None = None) -> LayerStates:
        """Every question's layer states at its answer position, one option order."""
        for qid, question in request.questions.items():
            if len(question.option_keys()) > self.letters_per_prompt:
                raise RequestError(f"question {qid!r} has {len(question.option_keys())} options; a "
                                   f"mid-layer tier reads one prompt of at most "
                                   f"{self.letters_per_prompt} per question")
        started = time.perf_counter()
        calls, tokens = self.ctx.decode_calls, self.ctx.decoded_tokens
        branches, _, cut, _ = self._branches(request, 1, excerpt)
        shared = _shared_prefix(branches)
        self.head.prefill(branches[0].tokens[:shared], [b.head for b in branches], self._tokens)
        vectors: dict[str, dict[int, np.ndarray]] = {}
        for group in self._groups(branches, shared):
            for branch, rows in zip(group, self._read_group(group, shared), strict=True):
                vectors[branch.question_id] = rows
        usage = Usage(questions=len(request.questions), input_tokens=self.ctx.decoded_tokens - tokens,
                      forward_passes=self.ctx.decode_calls - calls,
                      seconds=time.perf_counter() - started, ran_on={self.model.path.name: self.ran_on})
        return LayerStates(vectors, usage, cut)

    def _read_group(self, group: list[_Branch], shared: int) -> list[dict[int, np.ndarray]]:
        """The branches' suffixes but their last tokens, then the last tokens alone (tapped)."""
        seqs = range(1, len(group) + 1)
        for seq in seqs:
            self.ctx.copy_sequence(0, seq)
        rest = [(seq, shared, b.tokens[shared:-1]) for seq, b in zip(seqs, group, strict=True)
                if len(b.tokens) - shared > 1]
        if rest:
            self.ctx.decode(rest, outputs=False)
        self.tap.arm()
        self.ctx.decode([(seq, len(b.tokens) - 1, b.tokens[-1:]) for seq, b in zip(seqs, group, strict=True)],
                        outputs=False)
        rows = self.tap.take()
        for seq in seqs:
            self.ctx.drop_sequence(seq)
        for layer, got in rows.items():
            if len(got) != len(group):
                raise ModelError(f"internal: block {layer} gave {len(got)} rows for {len(group)} branches")
        return [{layer: rows[layer][i] for layer in rows} for i in range(len(group))]


class LetterLens:
    """The logit lens: the model's final norm, then its output rows of the option letters."""

    def __init__(self, model_path: str | Path, letter_ids: np.ndarray) -> None:
        reader = gguf.GGUFReader(str(model_path))
        tensors = {t.name: t for t in reader.tensors}
        arch = _field(reader, "general.architecture")
        eps = _field(reader, f"{arch}.attention.layer_norm_rms_epsilon")
        self.eps = float(eps) if eps is not None else 1e-6
        if "output_norm.weight" not in tensors:
            raise ModelError(f"{Path(model_path).name} has no output_norm.weight: no lens to read")
        if "output_norm.bias" in tensors:
            raise ModelError(f"{Path(model_path).name} ends in a layer norm with a bias; the lens "
                             "reads RMS-norm models (llama, qwen, gemma)")
        self.norm = _rows(tensors["output_norm.weight"], None).reshape(-1)
        output = tensors.get("output.weight", tensors.get("token_embd.weight"))
        if output is None:
            raise ModelError(f"{Path(model_path).name} has neither output.weight nor token_embd.weight")
        self.rows = _rows(output, np.asarray(letter_ids))

    def probabilities(self, state: np.ndarray, n_options: int) -> np.ndarray:
        """Softmax over the first ``n_options`` letters' logits at ``state``."""
        h = np.asarray(state, dtype=np.float64)
        h = h / np.sqrt(np.mean(h * h) + self.eps) * self.norm
        logits = self.rows[:n_options] @ h
        z = np.exp(logits - logits.max())
        return z / z.sum()


def _field(reader: gguf.GGUFReader, key: str) -> str | float | None:
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def _rows(tensor: gguf.ReaderTensor, ids: np.ndarray | None) -> np.ndarray:
    """A tensor's rows ``ids`` (all: None) as float64, dequantized."""
    data = tensor.data if ids is None else tensor.data[ids]
    return np.asarray(gguf.quants.dequantize(np.asarray(data), tensor.tensor_type), dtype=np.float64)


Reader = Literal["head", "lens"]


class LayerAnswers:
    """Turns layer states into option probabilities: a head per question, or the lens."""

    def __init__(self, layer: int, heads: Mapping[str, SoftmaxHead] | None = None,
                 lens: LetterLens | None = None) -> None:
        if (heads is None) == (lens is None):
            raise ModelError("internal: a mid-layer tier reads with heads or with the lens, one of them")
        self.layer, self.heads, self.lens = layer, dict(heads or {}), lens

    def can_answer(self, qid: str, question: Question) -> bool:
        if self.lens is not None:
            return len(question.option_keys()) <= len(OPTION_LETTERS)
        return qid in self.heads

    def probabilities(self, qid: str, question: Question, vectors: Mapping[int, np.ndarray]) -> np.ndarray:
        state = vectors[self.layer]
        if self.lens is not None:
            return self.lens.probabilities(state, len(question.option_keys()))
        return self.heads[qid].predict_proba(normalized(state)[None, :])[0]
