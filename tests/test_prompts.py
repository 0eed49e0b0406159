"""Prompt layout of questions with more options than one prompt letters (16): the option groups
and the blocks a readout reads, which the cost model prices and the audit hashes."""

from __future__ import annotations

import pytest

from cascade.pricing import TierCost, TierPricing
from cascade.prompts import (
    FINALISTS_HEADING,
    letters_sha256,
    option_groups,
    question_block,
    question_blocks,
    template_sha256,
)
from cascade.questions import OPTION_LETTERS, parse_request


def choice(n: int) -> object:
    criteria = {f"k{i}": f"option {i}" for i in range(n)}
    question = {"type": "choice", "instructions": "Which?", "criteria": criteria}
    return parse_request({"state": "x", "questions": {"q": question}}).questions["q"]


@pytest.mark.parametrize("n", [2, 16, 17, 31, 32, 33, 100, 254, 255])
def test_option_groups_split_the_options_in_order_into_at_most_16_of_at_most_16(n: int) -> None:
    groups = option_groups(n)
    assert [i for group in groups for i in group] == list(range(n))
    assert len(groups) <= len(OPTION_LETTERS) and max(map(len, groups)) <= len(OPTION_LETTERS)
    assert max(map(len, groups)) - min(map(len, groups)) <= 1
    assert (len(groups) == 1) == (n <= len(OPTION_LETTERS))


def test_group_sizes_no_prompt_can_letter_are_refused() -> None:
    for size in (1, 17):
        with pytest.raises(ValueError, match="a prompt letters 2 to 16 options"):
            option_groups(20, size)
    with pytest.raises(ValueError, match="make 50 finalists"):
        option_groups(100, 2)
    with pytest.raises(ValueError, match="at most 16 options; got 17"):
        question_block(choice(17), range(17))


def test_a_big_question_reads_each_groups_block_and_the_finalists() -> None:
    assert question_blocks(choice(16)) == [question_block(choice(16), range(16))]
    blocks = question_blocks(choice(40))
    assert len(blocks) == 4 and all(FINALISTS_HEADING not in b for b in blocks[:3])
    assert FINALISTS_HEADING in blocks[3] and "A. k0: option 0" in blocks[3]
    assert "A. k13: option 13" in blocks[1]  # groups of 13, 14 and 13


def test_the_cost_model_prices_every_block_and_the_audit_hashes_them() -> None:
    words = TierPricing(TierCost(0.0, 1.0), lambda texts: [len(t.split()) for t in texts], fanout=True)
    assert words.suffix_tokens("q", choice(40)) == sum(len(b.split()) for b in question_blocks(choice(40)))
    assert template_sha256(choice(40)) != template_sha256(choice(39))
    assert letters_sha256(choice(40)) != letters_sha256(choice(39))
