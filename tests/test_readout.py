"""The logit-readout scorer on the real llama.cpp: gemma-3-270m Q4_K_M and a tiny hybrid qwen35.

PATH_TOLERANCE is the measured spread between decode paths on gemma's quantized kernels (see
BENCHMARKS.md, `python -m bench.path_agreement`): over 288 real decisions the largest |dp| was
0.103 and the mean 0.016, so 0.15 leaves headroom; argmax must agree wherever the top two are more
than 2 x 0.15 apart. The tiny qwen35 is float32, where the paths agree to about 1e-6, so there the
tolerance is 1e-4 and any mapping or state-copy error shows.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from tinymodels import tiny_llama_path, tiny_qwen35_path

from cascade.answers import DecisionResponse
from cascade.errors import InputTooLongError, ModelError, RequestError
from cascade.hashing import file_sha256
from cascade.questions import parse_request
from cascade.readout.excerpt import HeadTailExcerpt
from cascade.readout.orders import balanced_orders
from cascade.readout.prompts import PROMPT_VERSION, PromptTemplate
from cascade.readout.scorer import Scorer
from distill.cli import main

PATH_TOLERANCE = 0.15
F32_TOLERANCE = 1e-4

STATE = (
    "Hi team, the invoice we received last week charges us twice for the annual licence. "
    "Please refund the duplicate payment before Friday, our finance audit starts Monday."
)
QUESTIONS = {
    "urgent": {"type": "noul", "instructions": "Does this message convey urgency?"},
    "team": {
        "type": "choice",
        "instructions": "Which team should handle this?",
        "criteria": {
            "billing": "Payments, invoicing, refunds",
            "technical": "Bugs and outages",
            "sales": "New contracts",
            "legal": "Contracts and compliance",
        },
    },
    "severity": {
        "type": "score",
        "instructions": "How severe is the problem?",
        "criteria": ["Minor", "Degraded", "Blocking"],
    },
    "spam": {"type": "noul", "instructions": "Is this message spam?"},
    "tone": {
        "type": "choice",
        "instructions": "What is the tone?",
        "criteria": {"polite": None, "neutral": None, "angry": None},
    },
    "length": {
        "type": "score",
        "instructions": "How long is the message?",
        "criteria": ["one line", "a paragraph", "several paragraphs", "a long document"],
    },
    "refund": {"type": "noul", "instructions": "Does the writer ask for money back?"},
    "language": {
        "type": "choice",
        "instructions": "Which language is it written in?",
        "criteria": {"en": "English", "de": "German", "fr": "French"},
    },
}


def request(n: int = len(QUESTIONS), state: object = STATE) -> object:
    return parse_request({"state": state, "questions": dict(list(QUESTIONS.items())[:n])})


def vectors(response: DecisionResponse) -> dict[str, np.ndarray]:
    return {q: np.array(list(a.probabilities.values())) for q, a in response.answers.items()}


def assert_close(a: DecisionResponse, b: DecisionResponse, tol: float) -> None:
    va, vb = vectors(a), vectors(b)
    assert va.keys() == vb.keys()
    for qid in va:
        assert np.abs(va[qid] - vb[qid]).max() <= tol, (qid, va[qid], vb[qid])
        margin = np.sort(vb[qid])[-1] - np.sort(vb[qid])[-2]
        if margin > 2 * tol:
            assert va[qid].argmax() == vb[qid].argmax(), qid


def test_probabilities_sum_to_one_for_every_type(gemma_scorer: Scorer) -> None:
    response = gemma_scorer.score(request())
    assert set(response.answers) == set(QUESTIONS)
    for answer in response.answers.values():
        assert sum(answer.probabilities.values()) == pytest.approx(1.0, abs=1e-9)
        assert 0.0 < answer.readout.letter_mass <= 1.0
        assert answer.calibrated is False
        assert answer.readout.prompt_version == PROMPT_VERSION
    assert response.usage.questions == len(QUESTIONS)


@pytest.mark.parametrize("n", range(1, 9))
def test_fanout_matches_one_fresh_prompt_per_question(gemma_scorer: Scorer, n: int) -> None:
    gemma_scorer.forget_head()
    fanout = gemma_scorer.score(request(n), path="fanout")
    fresh = gemma_scorer.score(request(n), path="fresh")
    assert fanout.usage.forward_passes == 3  # the head, the rest of the shared tokens, the branches
    assert fresh.usage.forward_passes == n
    assert fanout.usage.input_tokens < fresh.usage.input_tokens or n == 1
    assert_close(fanout, fresh, PATH_TOLERANCE)


HEADS = (STATE, "Hi team, our build server has been down since this morning and nobody can deploy.",
         "Dear support, please cancel my subscription at the end of this month.",
         "Our office moves to the new building next week; the phones will be off on Tuesday.")


def test_the_prompt_head_is_decoded_once_and_every_number_is_the_same_either_way(gemma_scorer: Scorer
                                                                                   ) -> None:
    """The head (the prompt before the state) is decoded in a batch of its own by the first
    request and copied by the next; decoded again or copied, the numbers are identical."""
    gemma_scorer.forget_head()
    responses = [gemma_scorer.score(request(3, state=state)) for state in HEADS]
    head = gemma_scorer.prompt_head
    assert [r.usage.forward_passes for r in responses] == [3, 2, 2, 2] and head >= 8
    gemma_scorer.forget_head()
    again = gemma_scorer.score(request(3, state=HEADS[3]))
    assert again.usage.forward_passes == 3
    assert again.usage.input_tokens - responses[3].usage.input_tokens == head
    assert_close(again, responses[3], 0.0)
    for response, state in zip(responses, HEADS, strict=True):
        assert_close(response, gemma_scorer.score(request(3, state=state), path="fresh"), PATH_TOLERANCE)


def test_options_first_prefills_the_block_once_and_reads_each_state_and_the_answer_line(
    gemma_path: Path
) -> None:
    scorer = Scorer(gemma_path, n_ctx=2048, max_branches=4, layout="options-first")
    plain = Scorer(gemma_path, n_ctx=2048, max_branches=4)

    def team(state: str) -> object:
        return parse_request({"state": state, "questions": {"team": QUESTIONS["team"]}})

    try:
        two = scorer.score(request(2, state=HEADS[0]))  # two questions: each prompt reads the state
        two_fresh = scorer.score(request(2, state=HEADS[0]), path="fresh")
        single = [scorer.score(team(state)) for state in HEADS]
        head = scorer.prompt_head
        fresh = scorer.score(team(HEADS[3]), path="fresh")
        state_first = plain.score(team(HEADS[3]))
        state_tokens = len(plain.model.tokenize(HEADS[3]))
    finally:
        scorer.close()
        plain.close()
    answer = single[3].answers["team"]
    assert answer.readout is not None and answer.readout.prompt_version == "readout-v1-options-first"
    assert state_first.answers["team"].readout.prompt_version == PROMPT_VERSION
    assert single[3].audit.prompt_template_sha256 != state_first.audit.prompt_template_sha256
    assert head > plain.prompt_head >= 8  # the question block is in the head
    with pytest.raises(ModelError, match="was closed"):
        plain.model.tokenize(HEADS[3])  # never a read of freed memory
    assert state_tokens < single[3].usage.input_tokens < state_tokens + 24  # the state, the answer line
    assert single[3].usage.input_tokens < state_first.usage.input_tokens - 40
    assert_close(single[3], fresh, PATH_TOLERANCE)
    assert_close(two, two_fresh, PATH_TOLERANCE)


def test_serial_matches_fanout(gemma_scorer: Scorer) -> None:
    gemma_scorer.forget_head()
    serial = gemma_scorer.score(request(), path="serial")
    gemma_scorer.forget_head()
    fanout = gemma_scorer.score(request(), path="fanout")
    assert serial.usage.input_tokens == fanout.usage.input_tokens
    assert serial.usage.forward_passes == 2 + len(QUESTIONS)
    assert_close(serial, fanout, PATH_TOLERANCE)


def test_permuted_scores_map_back_to_their_options(gemma_scorer: Scorer) -> None:
    """Order o of a question shows the same text as the question with its criteria reordered by o,
    so averaging those reordered questions by key must reproduce the permuted answer exactly."""
    team = QUESTIONS["team"]
    keys = list(team["criteria"])
    permuted = gemma_scorer.score(
        parse_request({"state": STATE, "questions": {"team": team}}), path="fresh", permutations=4
    ).answers["team"]
    assert permuted.readout.permutations == 4
    expected = dict.fromkeys(keys, 0.0)
    for order in balanced_orders(len(keys), 4):
        reordered = dict(team, criteria={keys[i]: team["criteria"][keys[i]] for i in order})
        single = gemma_scorer.score(
            parse_request({"state": STATE, "questions": {"team": reordered}}), path="fresh"
        ).answers["team"]
        for key in keys:
            expected[key] += single.probabilities[key] / 4
    for key in keys:
        assert permuted.probabilities[key] == pytest.approx(expected[key], abs=1e-6)


def test_permutations_share_one_prefill(gemma_scorer: Scorer) -> None:
    gemma_scorer.forget_head()
    response = gemma_scorer.score(request(4), permutations=3)
    assert response.usage.forward_passes == 3  # the head, the rest of the state, every branch
    perms = {q: a.readout.permutations for q, a in response.answers.items()}
    assert perms == {"urgent": 2, "team": 3, "severity": 3, "spam": 2}


def test_batches_larger_than_the_branch_slots_are_split(gemma_path: Path) -> None:
    small = Scorer(gemma_path, n_ctx=2048, max_branches=3)
    try:
        split = small.score(request())
        assert split.usage.forward_passes == 2 + 3  # the head and the rest, then 3 groups
        reference = small.score(request(), path="fresh")
    finally:
        small.close()
    assert_close(split, reference, PATH_TOLERANCE)


def test_over_long_input_is_refused_with_token_counts(gemma_path: Path) -> None:
    scorer = Scorer(gemma_path, n_ctx=256, max_branches=4)
    long_state = " ".join([STATE] * 12)
    try:
        too_long = r"needs (more than )?\d+ tokens \(the state alone \d+\).*holds 256"
        with pytest.raises(InputTooLongError, match=too_long):
            scorer.score(request(2, long_state))
        response = scorer.score(request(2, long_state), excerpt=HeadTailExcerpt(120))
        with pytest.raises(InputTooLongError, match=r"head_tail:(\d+)") as advised:
            scorer.score(request(2, long_state + " " + long_state))
        fits = int(re.search(r"head_tail:(\d+)", str(advised.value)).group(1))  # type: ignore[union-attr]
        assert scorer.score(request(2, long_state), excerpt=HeadTailExcerpt(fits)).answers  # the advice works
    finally:
        scorer.close()
    tiny = Scorer(gemma_path, n_ctx=32, max_branches=4)  # the prompt alone fills it: no excerpt can help
    try:
        with pytest.raises(InputTooLongError, match=r"no excerpt of the state fits: raise the context"):
            tiny.score(request(2, STATE), excerpt=HeadTailExcerpt(8))
    finally:
        tiny.close()
    for answer in response.answers.values():
        assert answer.readout.excerpt == "head_tail:120"
        assert sum(answer.probabilities.values()) == pytest.approx(1.0)


def test_short_input_records_no_excerpt(gemma_scorer: Scorer) -> None:
    response = gemma_scorer.score(request(1), excerpt=HeadTailExcerpt(120))
    assert response.answers["urgent"].readout.excerpt is None


def test_prompt_hash_follows_the_prompt(gemma_scorer: Scorer) -> None:
    a = gemma_scorer.score(request(2)).answers
    b = gemma_scorer.score(request(2, STATE + " Thanks.")).answers
    assert a["urgent"].readout.prompt_hash != b["urgent"].readout.prompt_hash
    again = gemma_scorer.score(request(2)).answers
    assert again["urgent"].readout.prompt_hash == a["urgent"].readout.prompt_hash


def test_json_states_are_scored(gemma_scorer: Scorer) -> None:
    state = {"from": "billing@example.com", "subject": "Refund", "body": STATE}
    response = gemma_scorer.score(request(3, state))
    assert sum(response.answers["team"].probabilities.values()) == pytest.approx(1.0)


def test_bad_arguments_are_refused(gemma_scorer: Scorer) -> None:
    with pytest.raises(RequestError, match="permutations must be at least 1"):
        gemma_scorer.score(request(1), permutations=0)
    with pytest.raises(RequestError, match=r"request must be a DecisionRequest .*; got dict"):
        gemma_scorer.score(request(1).model_dump())  # type: ignore[arg-type]
    with pytest.raises(RequestError, match="path must be one of"):
        gemma_scorer.score(request(1), path="parallel")  # type: ignore[arg-type]
    with pytest.raises(RequestError, match="head_tail:1024"):
        HeadTailExcerpt.parse("middle:5")
    # a misspelt template was read as a chat template of none: other numbers, the same prompt version
    with pytest.raises(RequestError, match="template must be 'auto', 'chat' or 'plain'; got 'Chat'"):
        Scorer(gemma_scorer.model.path, template="Chat")  # type: ignore[arg-type]
    with pytest.raises(RequestError, match="n_threads must be a whole number >= 1"):
        Scorer(gemma_scorer.model.path, n_threads=0)  # taken for "the free cores" before


def test_missing_or_invalid_model_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match=r"model file not found: .*nope\.gguf"):
        Scorer(tmp_path / "nope.gguf")
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf at all" * 100)
    with pytest.raises(ModelError, match=r"could not load .*junk\.gguf"):
        Scorer(junk)


@pytest.fixture(scope="module")
def qwen35(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_qwen35_path(tmp_path_factory.mktemp("models"))


def test_hybrid_fanout_serial_and_fresh_agree(qwen35: Path) -> None:
    scorer = Scorer(qwen35, n_ctx=1024, max_branches=3)
    try:
        fanout = scorer.score(request(), permutations=2)
        serial = scorer.score(request(), path="serial", permutations=2)
        fresh = scorer.score(request(), path="fresh", permutations=2)
        again = scorer.score(request(), permutations=2)
    finally:
        scorer.close()
    assert fanout.usage.forward_passes > 2, "groups must be split to exercise branch reuse"
    assert_close(fanout, fresh, F32_TOLERANCE)
    assert_close(serial, fresh, F32_TOLERANCE)
    assert_close(again, fanout, 0.0)


def test_a_hybrid_model_copies_its_prompt_head_whole_and_agrees_with_fresh(qwen35: Path) -> None:
    """Attention cells and recurrent state both come from the head sequence (never a rewind)."""
    scorer = Scorer(qwen35, n_ctx=1024, max_branches=3)
    try:
        cached = [scorer.score(request(3, state=state)) for state in HEADS]
        head = scorer.prompt_head
        for response, state in zip(cached, HEADS, strict=True):
            assert_close(response, scorer.score(request(3, state=state), path="fresh"), F32_TOLERANCE)
        again = scorer.score(request(3, state=HEADS[3]))  # the fresh path dropped the head: decoded again
    finally:
        scorer.close()
    assert [r.usage.forward_passes for r in cached] == [3, 2, 2, 2] and head >= 8
    assert again.usage.forward_passes == 3
    assert_close(again, cached[3], 0.0)


CITIES = {f"city{i}": f"the city numbered {i}" for i in range(40)}
MANY = {"type": "choice", "instructions": "Which city does the writer live in?", "criteria": CITIES}


def many_options(n: int = 40, **more: object) -> object:
    criteria = dict(list(CITIES.items())[:n])
    return parse_request({"state": "I moved to the city numbered 23 last year and love it.",
                          "questions": {"city": {**MANY, "criteria": criteria}, **more}})


def test_a_choice_of_more_options_than_letters_is_read_in_two_rounds(gemma_scorer: Scorer) -> None:
    """40 options: 3 groups (13, 14 and 13) in the first round, their winners in the second; the
    state prefilled once for both (4 passes: the prompt head, the rest of the prefix, round 1 with
    the noul branch, round 2)."""
    req = many_options(urgent=QUESTIONS["urgent"])
    gemma_scorer.forget_head()
    fanout = gemma_scorer.score(req)
    fresh = gemma_scorer.score(req, path="fresh")
    serial = gemma_scorer.score(req, path="serial")
    answer = fanout.answers["city"]
    assert list(answer.probabilities) == list(CITIES) and answer.choice in CITIES
    assert sum(answer.probabilities.values()) == pytest.approx(1.0, abs=1e-9)
    assert fanout.usage.forward_passes == 4 and fresh.usage.forward_passes == 3 + 1 + 1
    assert answer.readout.tokens == fresh.answers["city"].readout.tokens > 0
    assert_close(fanout, fresh, PATH_TOLERANCE)
    assert_close(serial, fanout, PATH_TOLERANCE)


def test_the_rounds_share_each_groups_reading_as_its_own_prompt_reads_it(gemma_scorer: Scorer) -> None:
    """Within a group, options keep the shares the group's prompt gave them (exactly: the fresh
    path reads that very prompt), and the group's total is its finalist's second-round probability."""
    rounds = gemma_scorer.score(many_options(20), path="fresh").answers["city"].probabilities
    first = dict(list(CITIES.items())[:10])  # 20 options: two groups of 10
    group = parse_request({"state": "I moved to the city numbered 23 last year and love it.",
                           "questions": {"g": {**MANY, "criteria": first}}})
    alone = gemma_scorer.score(group, path="fresh").answers["g"].probabilities
    total = sum(rounds[key] for key in first)
    for key in first:
        assert rounds[key] / total == pytest.approx(alone[key], abs=1e-9)
    assert 0 < total < 1


def test_rounds_never_rewind_a_hybrid_model(qwen35: Path) -> None:
    scorer = Scorer(qwen35, n_ctx=2048, max_branches=4)
    try:
        fanout = scorer.score(many_options(), permutations=2)
        fresh = scorer.score(many_options(), path="fresh", permutations=2)
    finally:
        scorer.close()
    assert fanout.answers["city"].readout.permutations == 2
    assert_close(fanout, fresh, F32_TOLERANCE)


def test_hybrid_memory_cannot_be_rewound(qwen35: Path) -> None:
    """The scorer only ever drops whole sequences; this model really refuses a partial seq_rm."""
    import llama_cpp

    scorer = Scorer(qwen35, n_ctx=256, max_branches=1)
    try:
        scorer.ctx.decode([(0, 0, scorer.model.tokenize("one two three four five six"))])
        mem = llama_cpp.llama_get_memory(scorer.ctx._ctx)
        assert not llama_cpp.llama_memory_seq_rm(mem, 0, 2, -1)
        response = scorer.score(request(3))
    finally:
        scorer.close()
    assert len(response.answers) == 3


def test_chat_template_ends_after_an_empty_think_block() -> None:
    qwen_like = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n"
        "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
        "{% else %}<think>\n{% endif %}{% endif %}"
    )
    text = PromptTemplate("chat", qwen_like).render("STATE", "QUESTION")
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert text.index("STATE") < text.index("QUESTION")


def test_model_without_single_token_letters_is_refused(tmp_path: Path) -> None:
    """A template whose answer cue ends in a space: " A" is one token, so appending "A" would
    re-tokenize the prompt's last token and the logits there would say nothing about "A"."""
    path = tiny_llama_path(tmp_path)
    Scorer(path, template="plain").close()
    bad = "{% for m in messages %}{{ m.content }}{% endfor %}Answer: "
    with pytest.raises(ModelError, match="not one token of its own"):
        Scorer(path, template="chat", chat_template=bad)


def test_cli_score_prints_the_response(gemma_path: Path, tmp_path: Path, capsys) -> None:
    req = tmp_path / "req.json"
    req.write_text(json.dumps({"state": STATE, "questions": dict(list(QUESTIONS.items())[:2])}))
    assert main(["score", "--model", str(gemma_path), "--request", str(req), "--n-ctx", "1024"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["answers"]) == {"urgent", "team"}
    # the System One wire shape clients type (tests/test_serve.py calls them), the rest under x_
    assert set(out) == {"model", "answers", "usage", "audit"} and out["model"] == gemma_path.name
    assert set(out["answers"]["urgent"]) == {"type", "noul", "x_calibrated", "x_readout"}
    # three passes: the prompt head, the rest of the shared tokens, the branches
    assert out["usage"]["output_tokens"] == 0 and out["usage"]["x_cascade"]["forward_passes"] == 3
    tokens = out["audit"]["input_tokens"]
    assert [a["x_readout"]["tokens"] for a in out["answers"].values()] == tokens
    assert sum(tokens) > out["usage"]["input_tokens"]  # the prefill is shared, counted once
    assert out["audit"]["model_hash"] == file_sha256(gemma_path)
    assert (out["audit"]["backend"], out["audit"]["precision"]) == ("llama.cpp cpu", "Q4_K_M")


def test_cli_reports_bad_requests_in_one_line(gemma_path: Path, tmp_path: Path, capsys) -> None:
    req = tmp_path / "req.json"
    req.write_text(json.dumps({"state": "", "questions": {}}))
    assert main(["score", "--model", str(gemma_path), "--request", str(req)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("RequestError: ")
    assert "state" in err and "Traceback" not in err
