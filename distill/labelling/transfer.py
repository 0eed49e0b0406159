"""Labels in and out of a store as JSONL: an import of labels made elsewhere (gold labels, another
machine's run), and an export in the same format."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, BinaryIO, Literal

from pydantic import BaseModel

from cascade.atomic import write_atomically
from cascade.questions import Question, state_problem
from distill.store import LabelStore, StoreError, check_probabilities, conflict_message

IMPORT_BATCH_ITEMS = 500
_Pending = dict[str, dict[str, tuple[list[int], dict[str, float]]]]
"""An import's rows: item -> question -> (line numbers of identical rows, probabilities)."""


class ImportSummary(BaseModel):
    """What an import did; ``errors`` holds (line number, message) for every skipped row."""

    rows: int = 0
    imported: int = 0
    skipped: int = 0
    errors: list[tuple[int, str]] = []

    def _fail(self, path: Path, line: int, message: str, on_error: str, rows: int = 1) -> None:
        """Raise with file and line in stop mode; count and remember the row in skip mode."""
        if on_error == "stop":
            raise StoreError(f"{path}:{line}: {message} (or import with --on-error skip / on_error='skip')")
        self.skipped += rows
        self.errors.append((line, message))



def import_labels(
    store: LabelStore,
    path: Path,
    questions: Mapping[str, Question],
    on_error: Literal["stop", "skip"] = "stop",
) -> ImportSummary:
    """Load labels made elsewhere (gold labels, another machine's run) from JSONL.

    Rows are ``{"id", "question", "answer"}`` (one-hot) or ``{"id", "question",
    "probabilities"}``; with both (as exported), the answer must be a most probable key. Every
    row is checked before anything is written; items then go in batches of IMPORT_BATCH_ITEMS.
    A row contradicting a stored label is only found while writing, so in stop mode earlier
    batches stay committed; re-running after a fix is safe, as identical rows are no-ops.
    """
    if on_error not in ("stop", "skip"):
        raise StoreError(f"on_error must be 'stop' or 'skip', got {on_error!r}")
    store.bind_questions(questions)
    try:
        lines = Path(path).read_bytes().splitlines()
    except OSError as exc:
        raise StoreError(f"cannot read labels to import: {exc}") from exc
    summary = ImportSummary()
    pending: _Pending = {}
    for number, line in enumerate(lines, 1):
        if line.strip():
            summary.rows += 1
            try:
                _add_pending(pending, number, *_parse_row(line, questions))
            except StoreError as exc:
                summary._fail(path, number, str(exc), on_error)
    _write_pending(store, path, pending, summary, on_error)
    summary.errors.sort()
    return summary


def _parse_row(line: bytes, questions: Mapping[str, Question]) -> tuple[str, str, dict[str, float]]:
    try:
        row = json.loads(line.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise StoreError(f"not UTF-8 ({exc.reason} at byte {exc.start})") from None
    except json.JSONDecodeError as exc:
        raise StoreError(f"not valid JSON ({exc.msg} at column {exc.colno})") from None
    except RecursionError:
        raise StoreError("JSON nested too deeply to read") from None
    allowed = ("id", "question", "answer", "probabilities")
    if not isinstance(row, dict) or set(row) - set(allowed):
        raise StoreError(f"a row must be a JSON object with only the fields {allowed}")
    if (problem := state_problem(row)) is not None:  # a lone surrogate in an id: no store takes it
        raise StoreError(problem)
    item, qid = row.get("id"), row.get("question")
    if not isinstance(item, str) or not item:
        raise StoreError(f"'id' must be a non-empty string, got {item!r}")
    if not isinstance(qid, str) or qid not in questions:
        raise StoreError(f"unknown question {qid!r}; known: {sorted(questions)}")
    question = questions[qid]
    if "probabilities" in row:
        probs = _soft_labels(row["probabilities"], question)
        if "answer" in row and probs.get(_as_key(row["answer"])) != max(probs.values()):
            raise StoreError(f"'answer' {row['answer']!r} is not a most probable option")
        return item, qid, probs
    if "answer" in row:
        key = _answer_key(row["answer"], question)
        return item, qid, {k: float(k == key) for k in question.option_keys()}
    raise StoreError("a row needs 'answer' or 'probabilities'")


def _soft_labels(probs: Any, question: Question) -> dict[str, float]:
    keys = question.option_keys()
    if not isinstance(probs, dict) or sorted(probs) != sorted(keys):
        shown = sorted(probs) if isinstance(probs, dict) else probs
        raise StoreError(f"'probabilities' keys must be exactly {keys}, got {shown!r}")
    checked = check_probabilities(probs, "'probabilities'")
    return {k: checked[k] for k in keys}


def _answer_key(answer: Any, question: Question) -> str:
    """The option a hard label names, strictly typed: noul bool, choice key, score level int."""
    keys = question.option_keys()
    if question.type == "noul" and isinstance(answer, bool):
        return _as_key(answer)
    if question.type == "choice" and answer in keys:
        return str(answer)
    if question.type == "score" and type(answer) is int and 0 <= answer < len(keys):
        return str(answer)
    allowed = {"noul": "true or false", "choice": f"one of {keys}",
               "score": f"an integer level 0..{len(keys) - 1}"}[question.type]
    raise StoreError(f"'answer' for a {question.type} question must be {allowed}, got {answer!r}")


def _as_key(answer: Any) -> str:
    """Option key of an exported answer, whichever type export inferred for it."""
    return ("true" if answer else "false") if isinstance(answer, bool) else str(answer)


def _add_pending(pending: _Pending, number: int, item: str, qid: str, probs: dict[str, float]) -> None:
    """Group rows by item; a repeated identical row is fine, a contradicting one is not."""
    lines, first = pending.setdefault(item, {}).setdefault(qid, ([], probs))
    if first != probs:
        raise StoreError(f"contradicts line {lines[0]} for item {item!r}, question {qid!r}")
    lines.append(number)


def _write_pending(
    store: LabelStore, path: Path, pending: _Pending, summary: ImportSummary, on_error: str
) -> None:
    items = list(pending)
    for start in range(0, len(items), IMPORT_BATCH_ITEMS):
        batch = items[start : start + IMPORT_BATCH_ITEMS]
        conflicts = store.put_many({item: {q: probs for q, (_, probs) in pending[item].items()}
                                    for item in batch})
        for item in batch:
            for qid, (lines, _) in pending[item].items():
                if qid in conflicts.get(item, []):
                    message = conflict_message(item, [qid])
                    summary._fail(path, lines[0], message, on_error, len(lines))
                else:
                    summary.imported += len(lines)


def export_labels(store: LabelStore, path: Path) -> int:
    """Write every label in the import format; returns the number of rows.

    Written whole or not at all (``cascade.atomic``: a temporary file beside ``path``, fsynced and
    renamed, removed on an error), readable by its owner alone as the store is.
    """
    count = 0

    def rows(out: BinaryIO) -> None:
        nonlocal count
        for label in store.iter_labels():
            probs = label.probabilities
            row = {"id": label.item_id, "question": label.question_id,
                   "answer": _answer_value(probs), "probabilities": probs}
            out.write((json.dumps(row) + "\n").encode("utf-8"))
            count += 1

    write_atomically(Path(path), rows)
    return count


def _answer_value(probs: dict[str, float]) -> bool | int | str:
    """The argmax key (first on ties), typed by its keys: "true"/"false" noul, "0".."N-1" score.

    The store does not keep question types; import maps any of these back to its key.
    """
    key, keys = max(probs, key=probs.__getitem__), set(probs)
    if keys == {"true", "false"}:
        return key == "true"
    return int(key) if keys == {str(i) for i in range(len(keys))} else key
