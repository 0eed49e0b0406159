"""Wire types: every malformed request is refused with its path, every valid one round-trips."""

import json
import math
import re
from typing import Any

import pytest
from jevcompat.validate import choice_confidence as reference_choice
from jevcompat.validate import score_confidence as reference_score
from pydantic import ValidationError

from cascade.answers import (
    Audit,
    ChoiceAnswer,
    DecisionResponse,
    NoulAnswer,
    Readout,
    ScoreAnswer,
    Usage,
    choice_confidence,
    score_confidence,
)
from cascade.errors import RequestError
from cascade.questions import (
    MAX_LEVELS,
    MAX_OPTIONS,
    MIN_LEVELS,
    MIN_OPTIONS,
    OPTION_LETTERS,
    ChoiceQuestion,
    DecisionRequest,
    NoulCriteria,
    NoulQuestion,
    ScoreQuestion,
    parse_request,
)

NOUL = {"type": "noul", "instructions": "Does this convey urgency?"}
CHOICE = {
    "type": "choice",
    "instructions": "Which team should handle this?",
    "criteria": {"billing": "Payments, invoicing, refunds", "technical": "Bugs, outages"},
}
SCORE = {
    "type": "score",
    "instructions": "How severe is the problem?",
    "criteria": ["Minor", "Degraded", "Blocking"],
}
EMAIL = "Help! My payouts have been failing for three days."


def request(**question: Any) -> dict[str, Any]:
    """A valid request whose one question 'q' is ``question``."""
    return {"state": EMAIL, "questions": {"q": question}}


def refused(data: Any, pattern: str) -> str:
    with pytest.raises(RequestError, match=pattern) as caught:
        parse_request(data)
    message = str(caught.value)
    assert "pydantic" not in message and "http" not in message
    return message


# --- refusals: request level ---


def test_invalid_json_names_line_and_column():
    refused('{"state": "x",\n "questions": }', r"^request: invalid JSON at line 2, column 15: ")


def test_nan_is_not_json():
    refused('{"state": NaN, "questions": {"q": {}}}', r"^request: invalid JSON: NaN is not")


def test_bytes_that_are_not_utf8():
    refused(b'{"state": "\xff"}', r"^request: not UTF-8")


@pytest.mark.parametrize("number", ["1e999", "-1e999", "1" * 4301])
def test_numbers_past_a_float_or_pythons_int_bound_are_refused(number):
    refused('{"state": {"n": ' + number + '}, "questions": {"q": {}}}', r"^request: invalid JSON: ")


@pytest.mark.parametrize("text, path", [('"\\ud800 hi"', "state"), ('{"\\udfff": 1}', "state"),
                                        ('{"a": ["x", "\\udc00"]}', r"state\.a\.1")])
def test_a_lone_surrogate_escape_is_refused_at_its_path(text, path):
    body = '{"state": ' + text + ', "questions": {"q": {}}}'
    refused(body, rf"^{path}: a key or text holds a lone surrogate")


@pytest.mark.parametrize("state, path, message", [
    ("refund \ud800 please", "", "a key or text holds a lone surrogate"),
    ({"a": ["x", "\udc00"]}, "a.1", "a key or text holds a lone surrogate"),
    ({"n": float("nan")}, "n", "the number nan is not a JSON value"),
    ({"n": float("inf")}, "n", "the number inf is not a JSON value"),
])
def test_a_request_built_in_python_is_held_to_what_json_text_could_hold(state, path, message):
    """parse_request of a dict (the library's path) took what its JSON path refuses, and the
    scorer then failed with a raw UnicodeEncodeError."""
    dotted = re.escape(f"state.{path}" if path else "state")
    refused({"state": state, "questions": {"q": NOUL}}, rf"^{dotted}: {message}")
    with pytest.raises(ValidationError, match=re.escape(f"{path}: {message}" if path else message)):
        DecisionRequest(state=state, questions={"q": NOUL})
    bad_question = {"q": {**NOUL, "instructions": "Urgent \ud800?"}}
    refused({"state": "fine", "questions": bad_question}, r"^questions\.q\.instructions: a key or text")


def test_a_surrogate_pair_is_one_character():
    text = '{"state": "\\ud83d\\ude00", "questions": {"q": ' + json.dumps(NOUL) + "}}"
    assert parse_request(text).state == "\U0001f600"


@pytest.mark.parametrize("text, kind", [("[1, 2]", "array"), ('"hi"', "text"), ("3", "number")])
def test_top_level_must_be_an_object(text, kind):
    refused(text, rf"^request: must be a JSON object with 'state' and 'questions'; got {kind}$")


def test_missing_state():
    refused({"questions": {"q": NOUL}}, r"^state: missing; give the text or JSON object/array")


@pytest.mark.parametrize("state", ["", "  \n\t", {}, []])
def test_empty_state(state):
    refused({"state": state, "questions": {"q": NOUL}}, r"^state: is empty; give ")


@pytest.mark.parametrize("state, kind", [(3, "number"), (2.5, "number"), (True, "boolean"),
                                         (None, "null")])
def test_state_of_wrong_kind(state, kind):
    refused({"state": state, "questions": {"q": NOUL}},
            rf"^state: must be text or a JSON object or array; got {kind}$")


def test_missing_questions():
    refused({"state": EMAIL}, r"^questions: missing; give an object mapping question ids")


def test_empty_questions():
    refused({"state": EMAIL, "questions": {}}, r"^questions: is empty; ask at least one")


def test_questions_must_be_an_object():
    refused({"state": EMAIL, "questions": [NOUL]}, r"^questions: must be an object .*; got array$")


@pytest.mark.parametrize("qid", ["", "   "])
def test_empty_question_id(qid):
    refused({"state": EMAIL, "questions": {qid: NOUL}}, r"^questions: question id '\s*' is empty")


def test_unknown_keys_are_ignored_as_system_one_servers_ignore_them():
    parsed = parse_request({**request(**NOUL, abstain_option=True), "temperature": 0, "model": "jev-latest"})
    assert parsed.questions["q"] == NoulQuestion(type="noul", instructions=NOUL["instructions"])
    assert parsed.model == "jev-latest"


def test_duplicate_top_level_key():
    refused('{"state": "a", "state": "b", "questions": {}}', r"^request: duplicate key 'state'$")


def test_every_problem_gets_its_own_line():
    message = refused({"state": 3, "questions": {"q": {"type": "noul"}}}, r"^state: ")
    assert message.splitlines()[1].startswith("questions.q.instructions: missing")


# --- refusals: question level ---


@pytest.mark.parametrize("question, kind", [(3, "number"), ("noul", "text"), ([NOUL], "array")])
def test_question_must_be_an_object(question, kind):
    refused({"state": EMAIL, "questions": {"q": question}},
            rf"^questions.q: must be a JSON object; got {kind}$")


def test_missing_type_lists_allowed_types():
    refused(request(instructions="Why?"),
            r"^questions.q.type: missing; allowed types: 'noul', 'choice', 'score'$")


def test_unknown_type_lists_allowed_types():
    refused(request(type="yesno", instructions="Why?"),
            r"^questions.q.type: unknown type 'yesno'; allowed types: 'noul', 'choice', 'score'$")


def test_question_id_named_like_a_type_keeps_its_path():
    refused({"state": EMAIL, "questions": {"choice": {**CHOICE, "criteria": {"a": "x"}}}},
            r"^questions.choice.criteria: a choice question takes")


def test_missing_instructions():
    refused(request(type="noul"), r"^questions.q.instructions: missing; give what the question")
    refused(request(type="noul", criteria={"true": None}), r"^questions.q.instructions: missing")


def test_criteria_that_describe_the_options_may_stand_without_instructions():
    """typesafe-sdk leaves instructions out when the criteria say what is asked."""
    noul = question({"type": "noul", "criteria": {"true": "The sender is angry"}})
    assert noul.instructions is None and noul.instructions_text() == "Which option applies?"
    assert question({"type": "choice", "criteria": {"a": "x", "b": None}}).option_keys() == ["a", "b"]


@pytest.mark.parametrize("instructions", ["", "  ", {}])
def test_blank_instructions(instructions):
    refused(request(type="score", instructions=instructions, criteria=["a", "b"]),
            r"^questions.q.instructions: is blank; ")


@pytest.mark.parametrize("instructions, kind", [(5, "number"), (True, "boolean")])
def test_instructions_of_wrong_kind(instructions, kind):
    refused(request(type="noul", instructions=instructions),
            rf"^questions.q.instructions: must be text or a JSON object or array; got {kind}$")


def test_instructions_may_be_a_json_array():
    assert question({**NOUL, "instructions": ["Is it urgent?", "Ignore tone"]}).instructions_text() == \
        '["Is it urgent?","Ignore tone"]'


def test_choice_needs_criteria():
    refused(request(type="choice", instructions="Which?"),
            r"^questions.q.criteria: missing; give an object mapping 2 to 255 option keys")


def test_score_needs_criteria():
    refused(request(type="score", instructions="How bad?"),
            r"^questions.q.criteria: missing; give an array of 2 to 10 level legends \(or an object")


def test_choice_criteria_must_be_an_object():
    refused(request(**{**CHOICE, "criteria": ["billing", "technical"]}),
            r"^questions.q.criteria: a choice question's criteria must be an object .*; got array$")


def test_score_criteria_must_be_an_array_or_an_object():
    refused(request(**{**SCORE, "criteria": "Minor, Major"}),
            r"^questions.q.criteria: a score question's criteria must be an array .*; got text$")


def test_score_levels_may_be_label_objects_or_one_object_of_labels():
    """jev-style sends ``{label, description}`` levels, avrik-sdk one object of labels."""
    levels = question({**SCORE, "criteria": [{"label": "Minor", "description": "cosmetic"},
                                             {"label": "Major"}, "Blocking"]})
    assert levels.option_texts() == ["Minor: cosmetic", "Major", "Blocking"]
    assert levels.answer([0.2, 0.3, 0.5]).legend == {"0": "Minor", "1": "Major", "2": "Blocking"}
    mapping = question({**SCORE, "criteria": {"Minor": "cosmetic", "Major": None}})
    assert mapping.option_texts() == ["Minor: cosmetic", "Major"]
    assert mapping.answer([0.6, 0.4]).legend == {"0": "Minor", "1": "Major"}


@pytest.mark.parametrize("criteria, kind", [("yes", "text"), (["yes", "no"], "array")])
def test_noul_criteria_must_be_an_object(criteria, kind):
    refused(request(**NOUL, criteria=criteria),
            rf"^questions.q.criteria: a noul question's criteria must be an object .*; got {kind}$")


def test_noul_criteria_take_only_true_and_false():
    refused(request(**NOUL, criteria={"true": "Urgent", "maybe": "Unsure"}),
            r"^questions.q.criteria: unknown key 'maybe'; .* optional 'true' and 'false'")


@pytest.mark.parametrize("count", [1, MAX_OPTIONS + 1])
def test_choice_option_count(count):
    criteria = {f"k{i}": None for i in range(count)}
    refused(request(**{**CHOICE, "criteria": criteria}),
            rf"^questions.q.criteria: a choice question takes 2 to 255 options; got {count}$")


@pytest.mark.parametrize("count", [1, MAX_LEVELS + 1])
def test_score_level_count(count):
    refused(request(**{**SCORE, "criteria": ["level"] * count}),
            rf"^questions.q.criteria: a score question takes 2 to 10 levels; got {count}$")


def test_duplicate_option_key():
    text = json.dumps({"state": EMAIL, "questions": {"dept": CHOICE}}).replace(
        '"technical"', '"billing"')
    refused(text, r"^questions.dept.criteria: duplicate option key 'billing'$")


def test_duplicate_key_inside_state_names_its_path():
    refused('{"state": [1, null, {"a": 1, "a": 2}], "questions": {}}',
            r"^state.2: duplicate key 'a'$")


@pytest.mark.parametrize("key", ["", " "])
def test_blank_option_key(key):
    refused(request(**{**CHOICE, "criteria": {key: "x", "other": "y"}}),
            r"^questions.q.criteria: option key '\s*' is empty")


@pytest.mark.parametrize("description", [3, True])
def test_option_description_of_wrong_kind(description):
    refused(request(**{**CHOICE, "criteria": {"billing": description, "technical": None}}),
            r"^questions.q.criteria: option 'billing': description must be text, a JSON object")


def test_level_legend_of_wrong_kind():
    refused(request(**{**SCORE, "criteria": ["Minor", 7]}),
            r"^questions.q.criteria: level 1 legend must be text")


def test_noul_description_of_wrong_kind():
    refused(request(**NOUL, criteria={"true": 1}), r"^questions.q.criteria.true: must be text")


def test_model_must_be_text():
    refused({**request(**NOUL), "model": 4}, r"^model: must be text; got number$")


# --- happy paths ---


def test_system_one_example_parses_from_text():
    text = json.dumps({"state": EMAIL, "questions": {"urgent": NOUL, "dept": CHOICE,
                                                      "severity": SCORE}})
    parsed = parse_request(text)
    assert parsed.state == EMAIL
    assert parsed.model is None
    assert [type(q) for q in parsed.questions.values()] == [NoulQuestion, ChoiceQuestion,
                                                             ScoreQuestion]
    assert parse_request(text.encode()) == parsed
    assert parse_request(parsed.model_dump_json()) == parsed


@pytest.mark.parametrize("state", [{"subject": "Payouts", "body": EMAIL}, [EMAIL, {"n": 2}]])
def test_json_state_is_kept_as_given(state):
    assert parse_request({"state": state, "questions": {"q": NOUL}}).state == state


def test_optional_model():
    assert parse_request({**request(**NOUL), "model": "qwen3.5-4b"}).model == "qwen3.5-4b"


def test_structured_instructions_render_as_compact_json():
    question = parse_request(request(**{**NOUL, "instructions": {"ask": "Urgent?", "lang": "é"}}))
    assert question.questions["q"].instructions_text() == '{"ask":"Urgent?","lang":"é"}'
    assert parse_request(request(**NOUL)).questions["q"].instructions_text() == NOUL["instructions"]


def test_choice_keys_keep_their_order_and_descriptions_of_each_kind_render():
    criteria = {"z": "Text", "a": {"team": "ops"}, "m": ["x", "ü"], "b": None}
    question = parse_request(request(**{**CHOICE, "criteria": criteria})).questions["q"]
    assert question.option_keys() == ["z", "a", "m", "b"]
    assert question.option_texts() == ["Text", '{"team":"ops"}', '["x","ü"]', None]


def test_choice_option_limits_are_the_apis_not_the_letters():
    """The Jev API's 255; a prompt letters 16 (A-P), and a readout reads more in rounds."""
    assert (MIN_OPTIONS, MAX_OPTIONS, len(OPTION_LETTERS)) == (2, 255, 16)
    for count in (MIN_OPTIONS, len(OPTION_LETTERS) + 1, MAX_OPTIONS):
        criteria = {f"k{i}": None for i in range(count)}
        assert len(parse_request(request(**{**CHOICE, "criteria": criteria}))
                   .questions["q"].option_keys()) == count


def test_score_keys_are_level_indices():
    for count in (MIN_LEVELS, MAX_LEVELS):
        question = parse_request(request(**{**SCORE, "criteria": [f"L{i}" for i in range(count)]}))
        assert question.questions["q"].option_keys() == [str(i) for i in range(count)]
    legends = parse_request(request(**{**SCORE, "criteria": ["Minor", {"x": 1}, None]}))
    assert legends.questions["q"].option_texts() == ["Minor", '{"x":1}', None]


def test_noul_criteria_are_optional():
    bare = parse_request(request(**NOUL)).questions["q"]
    assert bare.option_keys() == ["true", "false"]
    assert bare.option_texts() == [None, None]
    half = parse_request(request(**NOUL, criteria={"false": {"calm": True}})).questions["q"]
    assert half.option_texts() == [None, '{"calm":true}']


def test_models_validate_when_built_directly():
    question = NoulQuestion(type="noul", instructions="Urgent?", criteria=NoulCriteria(true="Yes"))
    request_ = DecisionRequest(state=EMAIL, questions={"q": question})
    assert parse_request(request_.model_dump()) == request_
    with pytest.raises(ValueError, match="a choice question takes"):
        ChoiceQuestion(type="choice", instructions="Which?", criteria={"only": None})


# --- answers ---

READOUT = Readout(model="qwen3.5-4b-q4_k_m.gguf", prompt_version="v1", prompt_hash="ab" * 32,
                  letter_mass=0.93, permutations=2, excerpt="head_tail:1024")
AUDIT = Audit(model_hash="cd" * 32, calibration_version="uncalibrated",
              prompt_template_sha256=["ef" * 32] * 3, allowed_token_set_hash=["01" * 32] * 3,
              input_tokens=[40, 41, 42], backend="llama.cpp cpu", precision="Q4_K_M")


def question(data: dict[str, Any]) -> Any:
    return parse_request(request(**data)).questions["q"]


def test_noul_answer():
    answer = question(NOUL).answer([0.8, 0.2], readout=READOUT, calibrated=True)
    assert isinstance(answer, NoulAnswer)
    assert answer.noul == pytest.approx(0.8)
    assert answer.probabilities == {"true": answer.noul, "false": 1.0 - answer.noul}
    assert answer.confidence == pytest.approx(0.6)  # as a two-option choice's: 2 * 0.8 - 1
    assert answer.calibrated and answer.readout == READOUT


def test_choice_answer_takes_argmax_and_first_on_ties():
    answer = question(CHOICE).answer([0.3, 0.7])
    assert isinstance(answer, ChoiceAnswer)
    assert (answer.choice, answer.confidence) == ("technical", pytest.approx(0.4))  # 2 * 0.7 - 1
    assert list(answer.probabilities) == ["billing", "technical"]
    assert question(CHOICE).answer([0.5, 0.5]).choice == "billing"
    assert not answer.calibrated and answer.readout is None


def test_score_answer_is_the_expected_level():
    answer = question(SCORE).answer([0.2, 0.3, 0.5])
    assert isinstance(answer, ScoreAnswer)
    assert answer.score == pytest.approx(0.3 + 2 * 0.5)
    assert answer.level == 2
    assert answer.legend == {"0": "Minor", "1": "Degraded", "2": "Blocking"}
    assert answer.probabilities == pytest.approx({"0": 0.2, "1": 0.3, "2": 0.5})
    assert question(SCORE).answer([0.4, 0.2, 0.4]).level == 0
    # the spread about the top level over a uniform one's: 1 - (0.1 * 2 + 0.2 * 1) / (2/3)
    assert question(SCORE).answer([0.1, 0.2, 0.7]).confidence == pytest.approx(0.4)
    assert answer.confidence == 0.0  # 0.7 / (2/3) is more spread than uniform's: floored at 0


def test_tiny_drift_is_renormalised():
    answer = question(SCORE).answer([0.2, 0.3, 0.5 + 5e-7])
    assert math.fsum(answer.probabilities.values()) == pytest.approx(1.0, abs=1e-12)


@pytest.mark.parametrize("probabilities, pattern", [
    ([0.5, 0.5], r"expected 3, one per option \['0', '1', '2'\]; got 2"),
    ([0.5, 0.5, 0.1], r"must sum to 1"),
    ([0.5, 0.6, -0.1], r"finite and >= 0; got -0.1"),
    ([0.5, float("nan"), 0.5], r"finite and >= 0; got nan"),
    ([0.5, float("inf"), 0.0], r"finite and >= 0; got inf"),
])
def test_bad_probabilities_are_refused(probabilities, pattern):
    with pytest.raises(ValueError, match=pattern):
        question(SCORE).answer(probabilities)


def test_confidence_is_the_formula_system_one_clients_read():
    """Chance-corrected for a choice, the ordinal spread for a score (TypeSafe's formulas, as
    jevcompat's reference implements them), each 0 for a uniform guess and 1 for certainty."""
    for probabilities in ([0.1, 0.6, 0.3], [0.2] * 5, [1.0, 0.0], [0.05, 0.45, 0.1, 0.2, 0.2],
                          [0.5, 0.0, 0.0, 0.5]):
        assert choice_confidence(probabilities) == pytest.approx(reference_choice(probabilities))
        assert score_confidence(probabilities) == pytest.approx(reference_score(probabilities))
    assert choice_confidence([0.1, 0.6, 0.3]) == pytest.approx(0.4)
    assert choice_confidence([0.2] * 5) == 0.0 and score_confidence([0.2] * 5) == 0.0
    assert choice_confidence([1.0, 0.0]) == 1.0 and score_confidence([0.0, 1.0, 0.0]) == 1.0
    for confidence in (choice_confidence, score_confidence):
        with pytest.raises(ValueError, match="empty"):
            confidence([])


def test_response_json_round_trip():
    answers = {
        "urgent": question(NOUL).answer([0.9, 0.1], readout=READOUT),
        "dept": question(CHOICE).answer([0.25, 0.75]),
        "severity": question({**SCORE, "criteria": ["Minor", {"x": [1]}, None]}).answer(
            [0.1, 0.6, 0.3], calibrated=True),
    }
    response = DecisionResponse(model="m", answers=answers, usage=Usage(
        questions=3, input_tokens=120, forward_passes=1, seconds=0.25), audit=AUDIT)
    again = DecisionResponse.model_validate_json(response.model_dump_json())
    assert again == response
    assert [type(a) for a in again.answers.values()] == [NoulAnswer, ChoiceAnswer, ScoreAnswer]
    legend = json.loads(response.model_dump_json())["answers"]["severity"]["legend"]
    assert legend == {"0": "Minor", "1": '{"x":[1]}', "2": "2"}


def test_the_wire_carries_what_system_one_clients_type_and_the_rest_under_x_keys():
    """avrik-sdk requires model, usage tokens and audit; typesafe-sdk rejects a score answer
    without confidence or with legend keys that are not level numbers; strict clients drop
    only keys they do not know, so the cascade's own fields go under x_."""
    answers = {"urgent": question(NOUL).answer([0.9, 0.1], readout=READOUT),
               "dept": question(CHOICE).answer([0.25, 0.75], calibrated=True),
               "severity": question(SCORE).answer([0.1, 0.6, 0.3])}
    wire = DecisionResponse(model="m", answers=answers, usage=Usage(input_tokens=7),
                            audit=AUDIT).model_dump(mode="json")
    assert list(wire) == ["model", "answers", "usage", "audit"]
    assert set(wire["answers"]["urgent"]) == {"type", "noul", "x_calibrated", "x_readout"}
    assert set(wire["answers"]["dept"]) == {"type", "choice", "probabilities", "confidence",
                                            "x_calibrated"}
    assert set(wire["answers"]["severity"]) == {"type", "score", "legend", "probabilities",
                                                "confidence", "x_calibrated"}
    assert list(wire["answers"]["severity"]["probabilities"]) == ["0", "1", "2"]
    assert wire["usage"] == {"input_tokens": 7, "output_tokens": 0, "x_cascade": {
        "questions": 0, "forward_passes": 0, "seconds": 0.0, "ran_on": {}, "tiers": {}}}
    assert wire["audit"] == AUDIT.model_dump()
