"""Labelling inputs: JSONL corpora read lazily with line-numbered errors, and questions files."""

import json
from pathlib import Path

import pytest

from cascade.corpus import BadLine, count_items, load_questions, read_corpus
from cascade.errors import CascadeError, CorpusError, RequestError


def ignore(bad: BadLine) -> None:
    """An on_bad for tests about what happens after skipping."""


def write_lines(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_items_come_with_ids_states_and_line_numbers(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "c.jsonl", [
        {"id": "e1", "text": "Where is my refund?", "label": "billing"},
        "",
        {"id": "e2", "text": {"amount": 120, "status": "failed"}},
        {"id": "e3", "text": ["a", "b"]},
    ])
    items = list(read_corpus(path))
    assert [(i.id, i.line) for i in items] == [("e1", 1), ("e2", 3), ("e3", 4)]
    assert items[1].state == {"amount": 120, "status": "failed"}
    assert count_items(path) == 3


def test_the_text_field_can_be_named(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "c.jsonl", [{"id": "e1", "body": "hello"}])
    assert [i.state for i in read_corpus(path, text_field="body")] == ["hello"]
    with pytest.raises(CorpusError, match=r"c.jsonl:1: item 'e1' has no 'text' field.*--text-field"):
        list(read_corpus(path))


BAD_LINES = [
    ('{"id": "e2", "text": "unterminated', r"not valid JSON"),
    ({"text": "no id"}, r"'id' must be a non-empty string; it is missing"),
    ({"id": 7, "text": "numeric id"}, r"'id' must be a non-empty string; got 7"),
    ({"id": "e2"}, r"item 'e2' has no 'text' field"),
    ({"id": "e2", "text": "   "}, r"item 'e2': 'text' is empty"),
    ({"id": "e2", "text": 3}, r"item 'e2': 'text' must be text or a JSON object/array; got number"),
    ({"id": "e1", "text": "again"}, r"duplicate id 'e1' \(first on line 1\)"),
    ('["e2", "a list"]', r"must be a JSON object"),
    ('{"id": "e2", "text": NaN}', r"not valid JSON \(NaN is not a JSON value\)"),
    # JSON lets a lone surrogate through; the tokenizer then raised a TypeError that lost the run
    ('{"id": "e2", "text": "refund \\ud800 please"}', r"item 'e2': 'text': a key or text holds a lone"),
    ('{"id": "e\\ud800", "text": "fine"}', r"'id': a key or text holds a lone"),  # a traceback in the store
    # a RecursionError traceback, --on-error skip or not
    ('{"id": "e2", "text": ' + "[" * 100_000 + "]" * 100_000 + "}", r"JSON nested too deeply to read"),
]


@pytest.mark.parametrize(("line", "message"), BAD_LINES)
def test_a_bad_line_stops_the_read_with_its_line_number(tmp_path: Path, line, message) -> None:
    path = write_lines(tmp_path / "c.jsonl", [{"id": "e1", "text": "fine"}, line])
    items = read_corpus(path)
    assert next(items).id == "e1"
    with pytest.raises(CorpusError, match=rf"c.jsonl:2: {message}.*--on-error skip") as caught:
        next(items)
    assert isinstance(caught.value, CascadeError) and isinstance(caught.value, ValueError)


def test_skip_mode_reports_every_bad_line_and_goes_on(tmp_path: Path) -> None:
    rows = [{"id": "e1", "text": "fine"}, *(line for line, _ in BAD_LINES), {"id": "e9", "text": "ok"}]
    path = write_lines(tmp_path / "c.jsonl", rows)
    bad: list[BadLine] = []
    items = list(read_corpus(path, on_error="skip", on_bad=bad.append))
    assert [i.id for i in items] == ["e1", "e9"]
    assert [b.line for b in bad] == list(range(2, 2 + len(BAD_LINES)))
    assert str(bad[0]).startswith(f"{path}:2: not valid JSON")


def test_skip_mode_needs_somewhere_to_report(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "c.jsonl", [{"id": "e1", "text": "fine"}])
    with pytest.raises(CorpusError, match="needs on_bad"):
        read_corpus(path, on_error="skip")
    with pytest.raises(CorpusError, match="on_error must be 'stop' or 'skip'; got 'ignore'"):
        read_corpus(path, on_error="ignore")  # type: ignore[arg-type]


@pytest.mark.parametrize("text", ["", "\n\n  \n"])
def test_an_empty_corpus_says_so(tmp_path: Path, text: str) -> None:
    path = tmp_path / "c.jsonl"
    path.write_text(text)
    with pytest.raises(CorpusError, match="is empty: no items to label"):
        list(read_corpus(path))


def test_a_corpus_of_only_bad_lines_has_no_items(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "c.jsonl", [{"id": "e1"}, {"id": "e2"}])
    with pytest.raises(CorpusError, match="no valid items: all 2 lines are bad"):
        list(read_corpus(path, on_error="skip", on_bad=ignore))


@pytest.mark.parametrize("text", [
    "id,text\ne1,hello\n",
    '[\n  {"id": "e1", "text": "hello"}\n]\n',
    "\xff\xfe not utf-8",
])
def test_a_file_that_is_not_jsonl_is_named_as_such(tmp_path: Path, text: str) -> None:
    path = tmp_path / "c.jsonl"
    path.write_bytes(text.encode("latin-1"))
    with pytest.raises(CorpusError, match=r"c.jsonl is not a JSONL corpus: line 1 is not JSON \("):
        list(read_corpus(path, on_error="skip", on_bad=ignore))


def test_a_missing_corpus_is_reported_before_reading(tmp_path: Path) -> None:
    with pytest.raises(CorpusError, match=r"corpus not found: .*missing\.jsonl"):
        read_corpus(tmp_path / "missing.jsonl")


QUESTIONS = {
    "urgent": {"type": "noul", "instructions": "Does this convey urgency?"},
    "team": {"type": "choice", "instructions": "Which team?",
             "criteria": {"billing": "Payments", "technical": "Bugs"}},
}


def test_questions_file_is_parsed_into_typed_questions(tmp_path: Path) -> None:
    path = tmp_path / "q.json"
    path.write_text(json.dumps({"questions": QUESTIONS}, indent=2))
    questions = load_questions(path)
    assert list(questions) == ["urgent", "team"]
    assert questions["team"].option_keys() == ["billing", "technical"]


def test_questions_file_errors_name_the_file_line_and_field(tmp_path: Path) -> None:
    bad = {**QUESTIONS, "severity": {"type": "score", "instructions": "How bad?", "criteria": ["x"]},
           "tone": {"type": "tone", "instructions": "?"}}
    path = tmp_path / "q.json"
    text = json.dumps({"questions": bad}, indent=2)
    path.write_text(text)
    def line_of(qid: str, field: str) -> int:
        """The line of the offending field's value, inside its own question."""
        start = text.index(f'"{qid}": {{')
        return text[: text.index(f'"{field}": ', start)].count("\n") + 1

    with pytest.raises(RequestError) as caught:
        load_questions(path)
    lines = str(caught.value).splitlines()
    assert lines[0].startswith(f"{path}:{line_of('severity', 'criteria')}: "
                               "questions.severity.criteria: a score question takes 2 to 10 levels")
    assert lines[1].startswith(f"{path}:{line_of('tone', 'type')}: questions.tone.type: "
                               "unknown type 'tone'")


@pytest.mark.parametrize(("text", "message"), [
    ('{"questions": {"a": {"type": "noul"', r"q.json:1: invalid JSON at column \d+"),
    ('{"questions": {\n"a": {"type": "noul", "instructions": "?"},\n"a": {"type": "noul"}}}',
     r"q.json:3: duplicate key 'a'"),
    ('{"state": "x", "questions": {}}', r"q.json:1: 'state' does not belong in a questions file"),
    ('{"questions": {}, "model": "m"}', r"q.json:1: unknown field 'model'"),
    ('["a"]', r"q.json: must be a JSON object"),
    ("{}", r"q.json: missing 'questions'"),
    ('{"questions": {}}', r"q.json:1: questions: is empty"),
    ('{"questions": ' + "[" * 100_000 + "]" * 100_000 + "}", r"q.json: JSON nested too deeply to read"),
])
def test_questions_file_shape_errors(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "q.json"
    path.write_text(text)
    with pytest.raises(RequestError, match=message):
        load_questions(path)


def test_a_missing_questions_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(RequestError, match=r"questions file not found: .*nope\.json"):
        load_questions(tmp_path / "nope.json")


def test_question_lines_are_found_by_structure_not_by_text_search(tmp_path: Path) -> None:
    """An option key that equals a later question's id must not take that question's line."""
    path = tmp_path / "q.json"
    path.write_text('{"questions": {\n'
                    '  "team": {"type": "choice", "instructions": "?", "criteria": {"tone": 1, "b": 2}},\n'
                    '  "tone": {"type": "mood", "instructions": "?"}}}')
    with pytest.raises(RequestError) as caught:
        load_questions(path)
    assert str(caught.value).splitlines() == [
        f"{path}:2: questions.team.criteria: option 'tone': description must be text, a JSON object, "
        "a JSON array or null; got number",
        f"{path}:3: questions.tone.type: unknown type 'mood'; allowed types: 'noul', 'choice', 'score'",
    ]
