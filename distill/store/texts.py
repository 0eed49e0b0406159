"""The text each label answered. A label is keyed by its item's id, so an item edited under the
same id kept the answer to its old text: a resumed labelling run counted it "already done", and
training paired the new text with the old answer, silently.

Each label row keeps the sha256 of its item's state (``text_sha256``, a column a store made
before it gets on its next write, NULL until then). Whatever reads a corpus against a store's
labels (labelling, training, calibration, evaluation, retraining) passes the corpus through
``checked``, which refuses an item whose state differs from the one its labels answered. Labels
made before the column existed carry no hash; a labelling run records their corpus text's hash
the first time it reads them (``unrecorded``), and checks them from then on.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Protocol

from cascade.corpus import CorpusItem
from cascade.questions import State
from distill.store.backend import Backend
from distill.store.records import StoreMismatchError

COLUMN = "text_sha256"
SHOWN = 3
"""Edited items a refusal names (with their lines); the rest are counted."""


class EditedItemsError(StoreMismatchError):
    """Corpus items whose state differs from the one their stored labels answered."""


class Hashed(Protocol):
    """A store as ``checked`` reads it (``LabelStore``, which imports this module)."""

    @property
    def path(self) -> object: ...

    def text_hashes(self) -> dict[str, str]: ...


def state_sha256(state: State) -> str:
    """sha256 of a state in canonical JSON (keys sorted), so that the same content read from two
    files, or through a Ray row's round trip, hashes the same."""
    canonical = json.dumps(state, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def add_column(db: Backend) -> None:
    """Inside the writer's opening transaction: the column, on a store made before it."""
    if COLUMN not in db.columns("labels"):
        db.execute(f"ALTER TABLE labels ADD COLUMN {COLUMN} TEXT")


def stored_hashes(db: Backend) -> dict[str, str]:
    """item id -> the hash its labels recorded (none in a store made before the column)."""
    if COLUMN not in db.columns("labels"):
        return {}
    rows = db.execute(f"SELECT item_id, {COLUMN} FROM labels WHERE {COLUMN} IS NOT NULL")
    return {item: sha for item, sha in rows}


def record_hashes(db: Backend, hashes: Mapping[str, str]) -> None:
    """Inside a transaction: ``hashes`` on the labels of each item that has none yet."""
    db.executemany(f"UPDATE labels SET {COLUMN} = ? WHERE item_id = ? AND {COLUMN} IS NULL",
                   [(sha, item) for item, sha in hashes.items()])


def checked(store: Hashed, items: Iterable[CorpusItem], corpus: Path | str,
            known: Mapping[str, str] | None = None) -> Iterator[CorpusItem]:
    """``items`` as they come; once they are all read, ``EditedItemsError`` if any of them differs
    from the text its labels in ``store`` answered (every edited item is found, not the first).
    ``known``: the store's ``text_hashes``, where the caller has read them already."""
    known = store.text_hashes() if known is None else known
    edited: list[CorpusItem] = []
    for item in items:
        sha = known.get(item.id)
        if sha is not None and sha != state_sha256(item.state):
            edited.append(item)
        yield item
    if edited:
        raise edited_error(edited, corpus, store.path)


def unrecorded(labelled: set[str], known: Mapping[str, str], items: Iterable[CorpusItem]) -> dict[str, str]:
    """The hashes of the ``labelled`` items among ``items`` whose labels record none yet."""
    return {item.id: state_sha256(item.state) for item in items
            if item.id in labelled and item.id not in known}


def edited_error(edited: list[CorpusItem], corpus: Path | str, store: object) -> EditedItemsError:
    shown = ", ".join(f"{item.id!r} (line {item.line})" for item in edited[:SHOWN])
    more = f" and {len(edited) - SHOWN} more" if len(edited) > SHOWN else ""
    return EditedItemsError(
        f"{len(edited)} item(s) of {corpus} changed since the teacher labelled them: {shown}{more}. "
        f"Their labels in {store} answer the old text, and are not answers to the new one. Give an "
        "edited item a new id, restore its text, or label into a new --store")
