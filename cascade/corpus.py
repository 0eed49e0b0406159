"""Reading corpora: a JSONL corpus of states and a questions file.

Routing reads them (``cascade decide``) as much as labelling, training and calibration do, so
they live in the runtime package and the offline one imports them from here.

A corpus holds one JSON object per line, ``{"id": "e1", "text": "..."}``, where the text field
(named by the caller) is text or a JSON object/array, i.e. a System One state. A corpus can be
far larger than memory, so it is read lazily, and every bad line is reported with its file and
line number: a labelling run of hours must not die on line 812,344 with "KeyError: 'text'".

A questions file is the System One request minus its state, ``{"questions": {id: question}}``;
it is validated by ``parse_request`` so that its errors read exactly like a request's, prefixed
with the file and line.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Collection, Generator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel

from cascade.errors import CorpusError, RequestError
from cascade.questions import Question, State, parse_request, state_problem

OnError = Literal["stop", "skip"]
ON_ERROR: tuple[OnError, ...] = ("stop", "skip")
EXAMPLE_LINE = '{"id": "e1", "text": "Help! My payouts have been failing."}'
_PLACEHOLDER_STATE = "placeholder: states come from the corpus"
_WHITESPACE = re.compile(r"\s*")


@dataclass(frozen=True)
class CorpusItem:
    """One state to label; ``line`` is where it was read, for messages about it."""

    id: str
    state: State
    line: int


class BadLine(BaseModel):
    """A corpus line (or item) that could not be labelled, and why."""

    path: str
    line: int
    message: str
    item_id: str | None = None

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.message}"


def check_on_error(on_error: str) -> None:
    if on_error not in ON_ERROR:
        raise CorpusError(f"on_error must be 'stop' or 'skip'; got {on_error!r}")


def count_items(path: Path) -> int:
    """Non-blank lines: the progress total, without parsing (bad lines are counted too)."""
    with _open(Path(path)) as handle:
        return sum(1 for line in handle if line.strip())


def count_among(path: Path, text_field: str, ids: Collection[str]) -> int:
    """The corpus's items whose id is in ``ids``: a resumed run's items done. Not ``len(ids)``: a
    store holds ids the corpus may no longer have (an edited id), which made the count of items
    left go below 0. Bad lines are passed over: the run's own reading reports them."""
    if not ids:
        return 0
    return sum(1 for item in read_corpus(path, text_field, "skip", lambda _: None) if item.id in ids)


def read_corpus(
    path: Path,
    text_field: str = "text",
    on_error: OnError = "stop",
    on_bad: Callable[[BadLine], None] | None = None,
) -> Generator[CorpusItem, None, None]:
    """Yield the corpus items one by one; a bad line raises (stop) or goes to ``on_bad`` (skip).

    Raised whatever ``on_error`` says: a first line that is not JSON (the file is not JSONL, and
    skipping would skip every line) and a corpus without a single item. Arguments and the file
    are checked now; lines are read as the iterator is consumed.
    """
    check_on_error(on_error)
    if on_error == "skip" and on_bad is None:
        raise CorpusError("on_error='skip' needs on_bad, a callable that receives each skipped "
                          "BadLine (for example a list's append), so that no line vanishes unseen")
    if not isinstance(text_field, str) or not text_field:
        raise CorpusError(f"text_field must name the field holding each state; got {text_field!r}")
    path = Path(path)
    _open(path).close()
    return _read(path, text_field, on_bad if on_error == "skip" and on_bad else _raise)


def _open(path: Path) -> Any:
    try:
        return path.open("rb")
    except FileNotFoundError:
        raise CorpusError(f"corpus not found: {path}; pass a JSONL file with one item per "
                          f"line, like {EXAMPLE_LINE}") from None
    except OSError as exc:
        raise CorpusError(f"cannot read corpus {path}: {exc}") from exc


def _read(
    path: Path, text_field: str, report: Callable[[BadLine], None]
) -> Generator[CorpusItem, None, None]:
    seen: dict[str, int] = {}
    lines = bad = 0
    with _open(path) as handle:
        for number, raw in enumerate(handle, 1):
            if not raw.strip():
                continue
            lines += 1
            try:
                item = _parse_line(raw, number, text_field, seen)
            except _BadLine as exc:
                if isinstance(exc, _NotJson) and lines == 1:
                    raise CorpusError(f"{path} is not a JSONL corpus: line {number} is not JSON "
                                      f"({exc}); give one JSON object per line, like "
                                      f"{EXAMPLE_LINE}") from None
                bad += 1
                message = f"not valid JSON ({exc})" if isinstance(exc, _NotJson) else str(exc)
                report(BadLine(path=str(path), line=number, message=message))
                continue
            seen[item.id] = number
            yield item
    if not seen:
        raise _no_items(path, lines, bad)


class _BadLine(Exception):
    """Why one line is not an item; becomes a BadLine with the file and line number."""


class _NotJson(_BadLine):
    """The line does not parse; on a corpus' first line it means the file is not JSONL."""


def _parse_line(raw: bytes, number: int, field: str, seen: dict[str, int]) -> CorpusItem:
    try:
        row = json.loads(raw.decode("utf-8"), parse_constant=_refuse_constant)
    except (UnicodeDecodeError, json.JSONDecodeError, _NotJson) as exc:
        raise _NotJson(_why(exc)) from None
    except RecursionError:  # a traceback before, --on-error skip or not
        raise _BadLine("JSON nested too deeply to read") from None
    if not isinstance(row, dict):
        raise _BadLine(f"must be a JSON object like {EXAMPLE_LINE}; got {_kind(row)}")
    item_id = row.get("id")
    if not isinstance(item_id, str) or not item_id.strip():
        got = "it is missing" if "id" not in row else f"got {item_id!r}"
        raise _BadLine(f"'id' must be a non-empty string; {got}")
    if (problem := state_problem(item_id)) is not None:  # no store, hash or file takes it
        raise _BadLine(f"'id': {problem}")
    if item_id in seen:
        raise _BadLine(f"duplicate id {item_id!r} (first on line {seen[item_id]}); ids must be unique")
    return CorpusItem(item_id, _state(row, field, item_id), number)


def _state(row: dict[str, Any], field: str, item_id: str) -> State:
    if field not in row:
        raise _BadLine(f"item {item_id!r} has no {field!r} field (fields: {sorted(row)}); name the "
                       f"field holding the state with --text-field / text_field")
    state = row[field]
    if not isinstance(state, str | dict | list):
        raise _BadLine(f"item {item_id!r}: {field!r} must be text or a JSON object/array; "
                       f"got {_kind(state)}")
    if not (state.strip() if isinstance(state, str) else state):
        raise _BadLine(f"item {item_id!r}: {field!r} is empty; there is nothing to label")
    if (problem := state_problem(state)) is not None:  # JSON lets "\ud800" through; no tokenizer takes it
        raise _BadLine(f"item {item_id!r}: {field!r}: {problem}")
    return state


def _refuse_constant(name: str) -> Any:
    raise _NotJson(f"{name} is not a JSON value")


def _why(exc: Exception) -> str:
    if isinstance(exc, UnicodeDecodeError):
        return f"not UTF-8: {exc.reason} at byte {exc.start}"
    if isinstance(exc, json.JSONDecodeError):
        return f"{exc.msg} at column {exc.colno}"
    return str(exc)


def _kind(value: Any) -> str:
    kinds = ((bool, "boolean"), (int | float, "number"), (str, "text"), (list, "array"))
    return "null" if value is None else next((n for t, n in kinds if isinstance(value, t)), "object")


def _raise(bad: BadLine) -> None:
    raise CorpusError(f"{bad} (--on-error skip / on_error='skip' reports bad lines and goes on)")


def _no_items(path: Path, lines: int, bad: int) -> CorpusError:
    if not lines:
        return CorpusError(f"corpus {path} is empty: no items to label; give one JSON object per "
                           f"line, like {EXAMPLE_LINE}")
    return CorpusError(f"corpus {path} has no valid items: all {bad} lines are bad (reported above)")


def load_questions(path: Path) -> dict[str, Question]:
    """The questions of a questions file, validated as a request so every field error applies."""
    path = Path(path)
    text = _read_questions_text(path)
    data = _questions_json(path, text)
    try:
        questions = dict(parse_request({"state": _PLACEHOLDER_STATE, "questions": data["questions"]})
                         .questions)
    except RequestError as exc:
        problems = [_locate(path, text, problem) for problem in str(exc).splitlines()]
        raise RequestError("\n".join(problems)) from None
    slashed = [qid for qid in questions if "/" in qid]
    if slashed:  # a bundle keeps each question's head under "<id>/": found at train time before
        raise RequestError(f"{path}: question id {slashed[0]!r} holds a '/', which a bundle's heads cannot "
                           "be keyed by; rename it (labels, training and the bundle use these ids)")
    return questions


def _read_questions_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8-sig")
    except FileNotFoundError:
        raise RequestError(f"questions file not found: {path}; pass a JSON file like "
                           '{"questions": {"urgent": {"type": "noul", "instructions": '
                           '"Is this urgent?"}}}') from None
    except (OSError, UnicodeDecodeError) as exc:
        raise RequestError(f"cannot read questions file {path}: {exc}") from None


def _questions_json(path: Path, text: str) -> dict[str, Any]:
    """The file's top level: an object holding 'questions' and nothing else."""
    try:
        data = json.loads(text, object_pairs_hook=_unique_keys)
    except json.JSONDecodeError as exc:
        raise RequestError(f"{path}:{exc.lineno}: invalid JSON at column {exc.colno}: "
                           f"{exc.msg}") from None
    except _DuplicateKey as exc:
        raise RequestError(f"{path}:{_key_line(text, exc.key, 2)}: duplicate key {exc.key!r}; "
                           "each key may appear once (JSON would silently keep the last)") from None
    except RecursionError:
        raise RequestError(f"{path}: JSON nested too deeply to read") from None
    if not isinstance(data, dict):
        raise RequestError(f'{path}: must be a JSON object {{"questions": {{id: question}}}}; '
                           f"got {_kind(data)}")
    for key in data:
        if key != "questions":
            where = f"{path}:{_key_line(text, key, 1)}"
            if key == "state":
                raise RequestError(f"{where}: 'state' does not belong in a questions file; the "
                                   "states come from the corpus")
            raise RequestError(f"{where}: unknown field {key!r}; a questions file holds only "
                               "'questions'")
    if "questions" not in data:
        raise RequestError(f"{path}: missing 'questions', an object mapping question ids to "
                           "questions")
    return data


class _DuplicateKey(Exception):
    def __init__(self, key: str) -> None:
        self.key = key


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) < len(pairs):
        keys = [key for key, _ in pairs]
        raise _DuplicateKey(next(k for i, k in enumerate(keys) if k in keys[:i]))
    return obj


def _key_line(text: str, key: str, nth: int) -> int | str:
    """Line of the nth ``"key":`` in the text; '?' where escapes hide it (a hint, not a parse)."""
    pattern = re.escape(json.dumps(key, ensure_ascii=False)) + r"\s*:"
    found = list(re.finditer(pattern, text))
    return text.count("\n", 0, found[nth - 1].start()) + 1 if len(found) >= nth else "?"


def _field_line(text: str, field: str) -> int | None:
    """Line where the value of a dotted field path (``questions.dept.criteria``) starts in the
    (already valid) JSON text, walking objects key by key as deep as the path goes through them;
    None where not even its first key is found."""
    position, line = _skip(text, 0), None
    for part in field.split("."):
        if text[position] != "{":
            break
        keys = _walk(text, position)
        if part not in keys:
            break
        position = keys[part][1]
        line = text.count("\n", 0, position) + 1
    return line


def _walk(text: str, start: int) -> dict[str, tuple[int, int]]:
    """Key -> (where the key starts, where its value starts), for the JSON object at text[start]."""
    decoder = json.JSONDecoder()
    found: dict[str, tuple[int, int]] = {}
    i = _skip(text, start + 1)
    while text[i] != "}":
        key, end = decoder.raw_decode(text, i)
        value = _skip(text, _skip(text, end) + 1)
        found[key] = (i, value)
        _, end = decoder.raw_decode(text, value)
        i = _skip(text, end)
        if text[i] == ",":
            i = _skip(text, i + 1)
    return found


def _skip(text: str, i: int) -> int:
    match = _WHITESPACE.match(text, i)
    return match.end() if match else i


def _locate(path: Path, text: str, problem: str) -> str:
    """Prefix one parse_request problem line with the file and the line of its field."""
    line = _field_line(text, problem.split(": ", 1)[0])
    return f"{path}:{line}: {problem}" if line else f"{path}: {problem}"
