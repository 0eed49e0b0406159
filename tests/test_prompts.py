"""Prompt layout of questions with more options than one prompt letters (16): the option groups
and the blocks a readout reads, which the cost model prices and the audit hashes."""

from __future__ import annotations

import pytest

from cascade.cost.pricing import TierCost, TierPricing
from cascade.questions import OPTION_LETTERS, parse_request
from cascade.readout.prompts import (
    FINALISTS_HEADING,
    LAYOUTS,
    PROMPT_VERSION,
    PromptTemplate,
    layout_of,
    letters_sha256,
    option_groups,
    plan_layout,
    prompt_version,
    question_block,
    question_blocks,
    template_sha256,
)


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


def test_options_first_puts_the_question_and_options_before_the_state_and_the_answer_line_after() -> None:
    question = choice(3)
    block = question_block(question, [0, 1, 2])
    template = PromptTemplate("plain")
    text = template.render("THE STATE", block, "options-first")
    ask, cue = block.rsplit("\n", 1)
    assert text.index(ask) < text.index("Evidence:\nTHE STATE") < text.index(cue)
    assert text.endswith(f"{cue}\n\nAnswer:") and cue.startswith("Answer with one letter")
    for layout in LAYOUTS:  # the head is what every prompt of the run starts with, up to the state
        head = template.head(block, layout)
        assert template.render("THE STATE", block, layout).startswith(head + "THE STATE")
    assert template.head(block, "state-first") == template.head()
    assert (layout_of(prompt_version("options-first")), layout_of(PROMPT_VERSION)) == (
        "options-first", "state-first")
    assert layout_of("readout-v0") is None
    assert template_sha256(question, prompt_version("options-first")) != template_sha256(question)


def test_the_planner_puts_the_options_first_only_where_one_prompt_reads_an_item() -> None:
    small, big = choice(4), choice(40)
    assert plan_layout([small], 1)[0] == "options-first"
    assert plan_layout([small], 2)[0] == "state-first"  # two option orders: two prompts
    assert plan_layout([small, choice(3)], 1)[0] == "state-first"
    layout, why = plan_layout([big], 1)  # three groups and the finalists
    assert layout == "state-first" and why.startswith("state-first: 4 prompts per item")


def test_options_first_is_priced_without_its_block_but_with_its_answer_line() -> None:
    question = choice(4)
    words = lambda texts: [len(t.split()) for t in texts]  # noqa: E731
    kinds = {layout: TierPricing(TierCost(0.0, 1.0), words, fanout=True, template=PromptTemplate("plain"),
                                 layout=layout) for layout in LAYOUTS}
    state_first, options_first = kinds["state-first"], kinds["options-first"]
    assert options_first.prompt_tokens("a b c") == state_first.prompt_tokens("a b c")
    assert options_first.suffix_tokens("q", question) == 5  # "Answer with one letter (A-D)."
    assert state_first.suffix_tokens("q", question) == len(question_block(question, range(4)).split())
