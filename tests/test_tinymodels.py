"""The tiny GGUF models load in the real llama.cpp, decode, and tokenize like a Qwen vocabulary."""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import llama_cpp
import numpy as np
import pytest
from tinymodels import (
    LETTERS,
    LLAMA_SHAPE,
    QWEN35_SHAPE,
    silence_llama_logs,
    tiny_llama_path,
    tiny_qwen35_path,
    tiny_vocab,
    write_tiny_llama,
    write_tiny_qwen35,
)

PROMPT = "Does this convey urgency? Answer with yes or no.\nAnswer:"

_PATHS: dict[str, Callable[[Path], Path]] = {"qwen35": tiny_qwen35_path, "llama": tiny_llama_path}
_WRITERS: dict[str, Callable[..., Path]] = {"qwen35": write_tiny_qwen35, "llama": write_tiny_llama}


@dataclass
class _Session:
    """One loaded model with a 512-token, 4-sequence context, as the readout builds it."""

    name: str
    model: llama_cpp.llama_model_p
    ctx: llama_cpp.llama_context_p

    @property
    def vocab(self) -> llama_cpp.llama_vocab_p:
        return llama_cpp.llama_model_get_vocab(self.model)

    def tokenize(self, text: str) -> list[int]:
        data = text.encode("utf-8")
        buffer = (llama_cpp.llama_token * (len(data) + 8))()
        n = llama_cpp.llama_tokenize(self.vocab, data, len(data), buffer, len(buffer), False, True)
        assert n >= 0
        return list(buffer[:n])

    def detokenize(self, tokens: list[int]) -> str:
        ids = (llama_cpp.llama_token * len(tokens))(*tokens)
        text = ctypes.create_string_buffer(16 * len(tokens) + 16)
        n = llama_cpp.llama_detokenize(self.vocab, ids, len(tokens), text, len(text), False, True)
        assert n >= 0
        return text.raw[:n].decode("utf-8")

    def decode(self, tokens: list[int]) -> np.ndarray:
        """Decode ``tokens`` at positions 0.. in sequence 0; logits of the last token only."""
        batch = llama_cpp.llama_batch_init(len(tokens), 0, 1)
        try:
            for i, token in enumerate(tokens):
                batch.token[i] = token
                batch.pos[i] = i
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = 0
                batch.logits[i] = i == len(tokens) - 1
            batch.n_tokens = len(tokens)
            assert llama_cpp.llama_decode(self.ctx, batch) == 0
        finally:
            llama_cpp.llama_batch_free(batch)
        n_vocab = llama_cpp.llama_vocab_n_tokens(self.vocab)
        row = llama_cpp.llama_get_logits_ith(self.ctx, len(tokens) - 1)
        return np.ctypeslib.as_array(row, shape=(n_vocab,)).copy()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    silence_llama_logs()
    return tmp_path_factory.mktemp("tiny-models")


@pytest.fixture(scope="module", params=sorted(_PATHS))
def loaded_model(request: pytest.FixtureRequest, model_dir: Path) -> Iterator[tuple[str, object]]:
    params = llama_cpp.llama_model_default_params()
    params.n_gpu_layers = 0
    params.use_extra_bufts = False  # their AMX repack segfaults some Xeons (tests/buffer_guard.py)
    path = _PATHS[request.param](model_dir)
    model = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
    assert model, f"llama.cpp could not load {path}"
    yield request.param, model
    llama_cpp.llama_model_free(model)


@pytest.fixture
def session(loaded_model: tuple[str, llama_cpp.llama_model_p]) -> Iterator[_Session]:
    name, model = loaded_model
    params = llama_cpp.llama_context_default_params()
    params.n_ctx = 512
    params.n_seq_max = 4
    params.n_threads = params.n_threads_batch = 1
    ctx = llama_cpp.llama_init_from_model(model, params)
    assert ctx, f"llama.cpp could not create a context for the tiny {name} model"
    yield _Session(name, model, ctx)
    llama_cpp.llama_free(ctx)


@pytest.mark.parametrize("name", sorted(_WRITERS))
def test_same_seed_writes_the_same_file(name: str, tmp_path: Path) -> None:
    write = _WRITERS[name]
    first = write(tmp_path / "a.gguf", seed=3).read_bytes()
    assert write(tmp_path / "b.gguf", seed=3).read_bytes() == first
    assert write(tmp_path / "c.gguf", seed=4).read_bytes() != first


def test_vocab_holds_byte_tokens_merges_and_specials() -> None:
    vocab = tiny_vocab()
    assert len(set(vocab.tokens)) == len(vocab.tokens)
    assert vocab.tokens[:3] == ("!", '"', "#")
    assert {"Ġ", "Ċ", "ĠA", "(A", "Ġthe", "Answer"} <= set(vocab.tokens)
    assert vocab.merges[0] == "Ġ A"
    assert 300 <= len(vocab.tokens) <= 1024


def test_hyperparameters_reach_llama_cpp(session: _Session) -> None:
    shape = QWEN35_SHAPE if session.name == "qwen35" else LLAMA_SHAPE
    assert llama_cpp.llama_model_n_embd(session.model) == shape.n_embd
    assert llama_cpp.llama_model_n_layer(session.model) == shape.n_layer
    assert llama_cpp.llama_vocab_n_tokens(session.vocab) == len(tiny_vocab().tokens)
    assert llama_cpp.llama_model_is_hybrid(session.model) == (session.name == "qwen35")


def test_last_token_logits_are_finite_and_varied(session: _Session) -> None:
    logits = session.decode(session.tokenize(PROMPT))
    assert np.isfinite(logits).all()
    assert logits.std() > 1e-3


def test_context_changes_the_logits(session: _Session) -> None:
    """The readout is only testable if earlier tokens reach the last position's logits."""
    first = session.decode(session.tokenize("Is the customer angry? Answer:"))
    llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(session.ctx), True)
    second = session.decode(session.tokenize("Which team should handle this? Answer:"))
    assert np.abs(first - second).max() > 1e-3


@pytest.mark.parametrize("letter", LETTERS)
def test_option_letters_are_single_tokens(session: _Session, letter: str) -> None:
    vocab = tiny_vocab()
    assert session.tokenize(f" {letter}") == [vocab.id_of(f"Ġ{letter}")]
    assert session.tokenize(letter) == [vocab.id_of(letter)]
    assert session.tokenize(f"({letter}") == [vocab.id_of(f"({letter}")]


def test_chat_markers_are_single_control_tokens(session: _Session) -> None:
    tokens = session.tokenize("<|im_start|>user\nHelp!<|im_end|>")
    assert llama_cpp.llama_vocab_is_control(session.vocab, tokens[0])
    assert llama_cpp.llama_vocab_is_control(session.vocab, tokens[-1])
    assert session.detokenize(tokens[:1]) == "<|im_start|>"


def test_english_tokenizes_into_words_and_round_trips(session: _Session) -> None:
    tokens = session.tokenize(PROMPT)
    assert len(tokens) <= 14
    assert session.detokenize(tokens) == PROMPT


def test_tail_removal_only_works_without_recurrent_state(session: _Session) -> None:
    session.decode(session.tokenize(PROMPT)[:10])
    memory = llama_cpp.llama_get_memory(session.ctx)
    assert llama_cpp.llama_memory_seq_rm(memory, 0, 5, -1) == (session.name == "llama")
    assert llama_cpp.llama_memory_seq_rm(memory, 0, -1, -1)
    assert llama_cpp.llama_memory_seq_pos_max(memory, 0) == -1
