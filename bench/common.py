"""Datasets and question sets the benchmarks share.

The datasets are read from ../shared/data beside the repository (never copied into it).
"""

from __future__ import annotations

import json
import resource
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"

SPAM: dict[str, Any] = {
    "spam": {"type": "noul", "instructions": "Is this message spam?",
             "criteria": {"true": "unsolicited advertising, scams or prize offers",
                          "false": "a personal or ordinary message"}},
}
TOPIC: dict[str, Any] = {
    "topic": {"type": "choice", "instructions": "Which section of a newspaper does this story belong to?",
              "criteria": {"world": "World news and politics", "sports": "Sports",
                           "business": "Business and economy", "scitech": "Science and technology"}},
}
STARS: dict[str, Any] = {
    "stars": {"type": "score", "instructions": "How many stars did the reviewer give the restaurant?",
              "criteria": ["1 star: terrible", "2 stars: poor", "3 stars: average",
                           "4 stars: good", "5 stars: excellent"]},
}
EXTRA: dict[str, Any] = {
    "urgent": {"type": "noul", "instructions": "Does the text convey urgency?"},
    "tone": {"type": "choice", "instructions": "What is the overall tone?",
             "criteria": {"positive": None, "neutral": None, "negative": None}},
    "formality": {"type": "score", "instructions": "How formal is the writing?",
                  "criteria": ["casual", "neutral", "formal"]},
    "audience": {"type": "choice", "instructions": "Who is the text mainly written for?",
                 "criteria": {"friend": "a friend or family member", "customer": "a customer",
                              "public": "the general public", "expert": "a specialist"}},
    "numbers": {"type": "noul", "instructions": "Does the text mention a number or a price?"},
}


def question_set(n: int) -> dict[str, Any]:
    """``n`` questions (1..8) mixing all three types, for fan-out benchmarks."""
    pool = {**TOPIC, **SPAM, **STARS, **EXTRA}
    if not 1 <= n <= len(pool):
        raise ValueError(f"n must be 1..{len(pool)}")
    return dict(list(pool.items())[:n])


def many_questions(n: int) -> dict[str, Any]:
    """``n`` questions for N beyond the pool: the pool repeated with distinct ids and wording."""
    pool = list(question_set(8).items())
    out = {}
    for i in range(n):
        qid, q = pool[i % len(pool)]
        q = dict(q, instructions=f"{q['instructions']} (variant {i // len(pool)})")
        out[f"{qid}_{i}"] = q
    return out


def read_rows(name: str, limit: int | None = None) -> list[dict[str, Any]]:
    path = SHARED_DATA / name
    if not path.is_file():
        raise SystemExit(f"dataset not found: {path} (../shared/data beside the repository)")
    rows = []
    with path.open(encoding="utf-8") as handle:
        for line in handle:
            rows.append(json.loads(line))
            if limit is not None and len(rows) >= limit:
                break
    return rows


def peak_rss_mib() -> float:
    """This process's peak resident set size so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@contextmanager
def placed_llama_defaults() -> Iterator[None]:
    """llama-cpp-python's high-level ``Llama`` built under cascade's extra-buffer policy.

    Its default model params turn llama.cpp's extra buffers on, which segfaults the first decode
    on Intel AMX Xeons (llama.cpp issue 20824); inside this block they follow
    ``cascade.readout.placement`` (off there, and wherever it turns them off).
    """
    import llama_cpp.llama_cpp as low

    from cascade.readout.placement import system_info, use_extra_buffers

    real = low.llama_model_default_params

    def placed() -> Any:
        params = real()
        params.use_extra_bufts = use_extra_buffers(None, system_info())[0]
        return params

    low.llama_model_default_params = placed
    try:
        yield
    finally:
        low.llama_model_default_params = real
