"""Which items a labelling run takes (distill.labelling.selection), and a run that is asked to stop."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
from pydantic import ValidationError

from cascade.errors import CorpusError
from distill.labelling.selection import Selection, select_ids


def _corpus(path: Path, n: int = 100) -> Path:
    # sorted by label, as exports often are: "the first N" would all be one class
    rows = [{"id": f"e{i:03d}", "text": f"message {i}", "label": "a" if i < 80 else "b"} for i in range(n)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows) + "not json\n")
    return path


def test_limit_takes_the_first_n_and_everything_takes_none(tmp_path: Path) -> None:
    corpus = _corpus(tmp_path / "c.jsonl")
    assert select_ids(corpus, "text", Selection()) is None
    assert select_ids(corpus, "text", Selection(limit=3)) == ["e000", "e001", "e002"]


def test_a_sample_is_seeded_and_keeps_each_gold_share(tmp_path: Path) -> None:
    corpus = _corpus(tmp_path / "c.jsonl")
    chosen = select_ids(corpus, "text", Selection(sample=10, seed=7, gold_field="label"))
    assert chosen is not None and len(chosen) == 10 and chosen == sorted(chosen)  # corpus order
    assert Counter("a" if int(i[1:]) < 80 else "b" for i in chosen) == {"a": 8, "b": 2}
    assert chosen == select_ids(corpus, "text", Selection(sample=10, seed=7, gold_field="label"))
    assert chosen != select_ids(corpus, "text", Selection(sample=10, seed=8, gold_field="label"))
    plain = select_ids(corpus, "text", Selection(sample=10, seed=7))
    assert plain is not None and len(plain) == 10
    assert select_ids(corpus, "text", Selection(sample=500)) == [f"e{i:03d}" for i in range(100)]


def test_bad_selections_are_refused_with_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match=r"give limit .* or sample .*, not both"):
        Selection(limit=3, sample=3)
    with pytest.raises(ValidationError):
        Selection(sample=0)
    with pytest.raises(CorpusError, match=r"no row of .* has the gold field 'stars'"):
        select_ids(_corpus(tmp_path / "c.jsonl"), "text", Selection(sample=5, gold_field="stars"))
