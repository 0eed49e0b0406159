"""The mid-layer readout: the tap reads the layer it claims and stops the graph there, on a plain
and on a hybrid model, the fan-out never rewinds a sequence, a stopped decode's logits are never
read, and the same question gets the same states alone, in a batch and asked again."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import llama_cpp
import numpy as np
import pytest
from tinymodels import LLAMA_SHAPE, QWEN35_SHAPE, silence_llama_logs, write_tiny_llama, write_tiny_qwen35

from cascade.errors import ModelError, RequestError
from cascade.questions import DecisionRequest, parse_request
from cascade.readout.layer_scorer import LayerScorer, LetterLens, normalized
from cascade.readout.layer_tap import LayerTap
from cascade.readout.llama import ContextConfig, LlamaContext, LlamaModel
from cascade.readout.scorer import Scorer

REQUEST = parse_request({
    "state": "The committee approved the budget after a long debate about roads and schools.",
    "questions": {
        "topic": {"type": "choice", "instructions": "Which section is this story from?",
                  "criteria": {"world": "World", "sports": "Sports", "business": "Business",
                               "scitech": "Science"}},
        "urgent": {"type": "noul", "instructions": "Is this urgent?"},
        "stars": {"type": "score", "instructions": "How positive is it?",
                  "criteria": ["awful", "poor", "fine", "good", "great"]},
    },
})
WRITERS = {"llama": (write_tiny_llama, LLAMA_SHAPE), "qwen35": (write_tiny_qwen35, QWEN35_SHAPE)}
LENS_TOLERANCE = 2e-4
"""Lens against the teacher's letters on a float32 model whose blocks above the layer are silent:
the two differ only by how the suffix is batched (its last token decoded on its own, reading the
others from float16 KV cells) and the lens's float64 arithmetic. Measured: 6e-5 on the plain
model, 6e-9 on the hybrid (whose one attention block is the silent one); one layer lower the
lens is 0.017-0.029 away."""


@pytest.fixture(scope="module", params=sorted(WRITERS))
def silent_top(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    """A tiny model whose last block is silent: (path, its block count)."""
    silence_llama_logs()
    write, shape = WRITERS[request.param]
    path = tmp_path_factory.mktemp(request.param) / f"{request.param}-silent-top.gguf"
    return write(path, silent=[shape.n_layer - 1]), shape.n_layer


def test_the_tier_reads_the_layer_it_claims(silent_top: tuple[Path, int]) -> None:
    """With the last block silent, the lens at the last but one layer IS the teacher's readout;
    one layer lower it is not, so a tap that read another layer would fail here."""
    path, n_layer = silent_top
    teacher = Scorer(path, n_ctx=1024, max_branches=3, n_threads=1)
    layers = LayerScorer(path, [n_layer - 2, n_layer - 1], n_ctx=1024, max_branches=3, n_threads=1)
    try:
        full = teacher.score(REQUEST)
        read = layers.states(REQUEST)
        lens = LetterLens(path, layers.letter_ids)
        for qid, question in REQUEST.questions.items():
            n = len(question.option_keys())
            expected = np.array(list(full.answers[qid].probabilities.values()))
            at_top = lens.probabilities(read.vectors[qid][n_layer - 1], n)
            below = lens.probabilities(read.vectors[qid][n_layer - 2], n)
            assert np.abs(at_top - expected).max() < LENS_TOLERANCE
            assert np.abs(below - expected).max() > 25 * LENS_TOLERANCE
            assert at_top.sum() == pytest.approx(1.0)
    finally:
        teacher.close()
        layers.close()


@pytest.fixture(scope="module")
def gemma_layers(gemma_path: Path) -> Iterator[LayerScorer]:
    scorer = LayerScorer(gemma_path, [6, 9], n_ctx=2048, max_branches=3, n_threads=1)
    yield scorer
    scorer.close()


def test_a_stopped_decode_stops_early_and_its_logits_are_never_read(gemma_layers: LayerScorer) -> None:
    with pytest.raises(ModelError, match="has no logits to read; use states"):
        gemma_layers.score(REQUEST)
    with pytest.raises(ModelError, match="has no logits"):
        gemma_layers.ctx.logits(0)
    with pytest.raises(ModelError, match="decode it without outputs"):
        gemma_layers.ctx.decode([(0, 0, [1, 2, 3])])
    read = gemma_layers.states(REQUEST)
    assert read.usage.forward_passes >= 2 and read.usage.input_tokens > 0
    assert "first 9 of 18 blocks" in read.usage.ran_on[gemma_layers.model.path.name]


def test_states_are_the_same_asked_again_and_within_tolerance_alone(gemma_layers: LayerScorer) -> None:
    """Asked again (the prompt head copied, not decoded) every number is the same; asked alone
    rather than beside the other questions, the batch shape moves the quantized model's states
    (measured here: 0.9-1.3% of the state's RMS; bound 3%), which is why the router asks this tier the
    batch its calibration read (``Tier.batch_sensitive``)."""
    first = gemma_layers.states(REQUEST)
    again = gemma_layers.states(REQUEST)
    alone = gemma_layers.states(DecisionRequest(state=REQUEST.state,
                                                questions={"topic": REQUEST.questions["topic"]}))
    for layer in (6, 9):
        for qid in REQUEST.questions:
            assert np.array_equal(first.vectors[qid][layer], again.vectors[qid][layer])
        moved = normalized(alone.vectors["topic"][layer]) - normalized(first.vectors["topic"][layer])
        assert 0 < np.sqrt(np.mean(moved ** 2)) < 0.03


def test_a_question_the_tier_cannot_read_in_one_prompt_is_refused(gemma_layers: LayerScorer) -> None:
    criteria = {f"o{i}": f"option {i}" for i in range(20)}
    many = parse_request({"state": "x", "questions": {"pick": {
        "type": "choice", "instructions": "Which?", "criteria": criteria}}})
    with pytest.raises(RequestError, match="has 20 options; a mid-layer tier reads one prompt of at most"):
        gemma_layers.states(many)


def test_a_layer_the_model_does_not_have_is_refused(gemma_path: Path) -> None:
    with pytest.raises(ModelError, match="has 18 blocks; a mid-layer tier runs fewer than all of them"):
        LayerScorer(gemma_path, [18], n_threads=1)


def test_a_graph_without_the_tapped_tensor_fails_loudly(gemma_path: Path) -> None:
    """A tap on a layer the graph never names (as a build that names them otherwise would)
    refuses the decode rather than read another tensor or nothing."""
    model = LlamaModel(gemma_path)
    tap = LayerTap([40])
    ctx = LlamaContext(model, ContextConfig(n_ctx=256, n_seq_max=2, n_threads=1), tap)
    try:
        with pytest.raises(ModelError, match=r"graph has no tensor 'l_out-39'"):
            ctx.decode([(0, 0, model.tokenize("Hello there"))], outputs=False)
    finally:
        ctx.close()
        model.close()


@pytest.mark.skipif(not llama_cpp.llama_supports_gpu_offload(), reason="needs a GPU build of llama.cpp")
def test_on_a_gpu_the_tap_reads_what_the_cpu_reads(gemma_path: Path) -> None:
    """Where the blocks run on a GPU, the tap copies the layer out of device memory after the
    scheduler synchronises: the states must be the CPU's within the backends' tolerance (the
    copy's cost is measured nowhere here: no GPU was lent)."""
    with pytest.raises(ModelError, match="a mid-layer tier runs on one device: 5 of 19 layers offloaded"):
        LayerScorer(gemma_path, [9], n_ctx=1024, n_gpu_layers=5)
    cpu = LayerScorer(gemma_path, [9], n_ctx=1024, max_branches=3, n_threads=1)
    gpu = LayerScorer(gemma_path, [9], n_ctx=1024, max_branches=3, n_gpu_layers=99)
    try:
        on_cpu, on_gpu = cpu.states(REQUEST), gpu.states(REQUEST)
        for qid in REQUEST.questions:
            moved = normalized(on_gpu.vectors[qid][9]) - normalized(on_cpu.vectors[qid][9])
            assert np.sqrt(np.mean(moved ** 2)) < 0.05
    finally:
        cpu.close()
        gpu.close()
