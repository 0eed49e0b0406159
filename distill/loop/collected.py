"""Collected traffic in a label store: the sink a pass-through writes to, and the reader a trainer
calls.

A pass-through (``cascade serve --teacher URL --collect S``) appends every request it keeps to the
store's ``traffic`` table (``distill.store.traffic``), whole: the client's ids, its questions, the
upstream's distributions and identity. A trainer needs something else: each distinct question
once (by content, whatever id clients gave it), each state once, and only questions asked often
enough to learn a head from. ``census`` counts them; ``training_set`` writes what ``cascade
train`` reads (questions file, corpus, and the labels into the same store, bound to the same
teacher); ``collected`` reads the raw items for any other reader (a retrain).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import threading
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from cascade.collect.record import CollectedItem
from cascade.errors import CascadeError
from cascade.private import private_text
from cascade.questions import Question
from cascade.serve.matching import content_key
from distill.store import (
    LabelStore,
    StoreLocation,
    StoreMismatchError,
    StoreUnavailableError,
    Teacher,
    store_exists,
    store_location,
)

DEFAULT_MIN_COUNT = 50
"""Asked fewer times than this, a question gets no head: too few labels to learn or certify from."""


class StoreTraffic:
    """A ``cascade.collect.collector.Sink`` of collected items on the label store at ``path``:
    opened at the first item, bound to the teacher that item's answer named (an existing store
    must hold that teacher's labels). An item from another teacher raises
    ``StoreMismatchError``: the collector then stops, since a store never mixes two teachers'
    answers. A store that cannot be reached now is let go, and the collector's retry opens it
    again."""

    def __init__(self, path: StoreLocation | str) -> None:
        self.path = store_location(path)
        self._store: LabelStore | None = None
        self._lock = threading.Lock()

    def append(self, item: CollectedItem) -> None:
        teacher = Teacher.of_endpoint(item.identity)
        with self._lock:
            if self._store is None:
                self._store = LabelStore(self.path, teacher, any_thread=True)
            elif self._store.teacher != teacher:
                raise StoreMismatchError(
                    f"the upstream now answers as {item.identity.describe()}, and the store {self.path} "
                    f"holds the answers of {self._store.teacher.model!r} ({self._store.teacher.identity}); "
                    "a store never mixes two teachers")
            try:
                self._store.put_traffic(item)
            except StoreUnavailableError:  # the connection may be gone: the next try opens anew
                with contextlib.suppress(Exception):
                    self._store.close()
                self._store = None
                raise

    def count(self) -> int:
        if not store_exists(self.path):
            return 0
        with LabelStore.open_existing(self.path) as store:
            return store.traffic_count()

    def close(self) -> None:
        with self._lock:
            if self._store is not None:
                self._store.close()
                self._store = None


def collected(path: StoreLocation | str) -> Iterator[CollectedItem]:
    """Every collected item in the store at ``path``, in the store's order."""
    with LabelStore.open_existing(path) as store:
        position = 0
        while page := store.traffic_after(position):
            position = page[-1][0]
            yield from (item for _, item in page)


@dataclass
class CollectedQuestion:
    """One distinct question (by content): ``id`` its name in a bundle (the id clients used most,
    made unique), how often it was asked, and under which ids."""

    id: str
    question: Question
    count: int = 0
    ids: Counter[str] = field(default_factory=Counter)


@dataclass(frozen=True)
class Census:
    """The questions asked often enough to get a head (``heads``), the rest with their counts,
    each list most asked first, and how many items and distinct states were read."""

    heads: list[CollectedQuestion]
    rest: list[CollectedQuestion]
    items: int
    states: int


def census(items: Iterator[CollectedItem] | list[CollectedItem], min_count: int = DEFAULT_MIN_COUNT
           ) -> Census:
    """Count each distinct question by content, once per distinct state that asked it."""
    found: dict[tuple[object, ...], CollectedQuestion] = {}
    seen: set[tuple[str, tuple[object, ...]]] = set()
    states: set[str] = set()
    n = 0
    for item in items:
        n += 1
        states.add(item.state_sha256)
        for qid, question in item.parsed_questions().items():
            key = content_key(question)
            entry = found.setdefault(key, CollectedQuestion("", question))
            entry.ids[qid] += 1
            if (item.state_sha256, key) not in seen:
                seen.add((item.state_sha256, key))
                entry.count += 1
    ranked = sorted(found.values(), key=lambda q: (-q.count, q.ids.most_common(1)[0][0]))
    _name(ranked)
    return Census([q for q in ranked if q.count >= min_count], [q for q in ranked if q.count < min_count],
                  n, len(states))


def _name(questions: list[CollectedQuestion]) -> None:
    """Each question's id: the one clients used most, with a content hash where two share it."""
    taken: set[str] = set()
    for entry in questions:
        best = entry.ids.most_common(1)[0][0]
        if best in taken:
            best = _suffixed(best, entry.question)
        taken.add(best)
        entry.id = best


def _suffixed(qid: str, question: Question) -> str:
    return f"{qid}_{hashlib.sha256(repr(content_key(question)).encode()).hexdigest()[:8]}"


def _unlike_stored(store: LabelStore, heads: list[CollectedQuestion]) -> None:
    """A head whose id the store's labels answer in another wording (clients changed the question
    under its id) gets its content hash after the id: its labels would otherwise sit beside the old
    wording's, and train the new question on both."""
    for head in heads:
        try:
            store.check_questions({head.id: head.question})
        except StoreMismatchError:
            head.id = _suffixed(head.id, head.question)


def item_id(state_sha256: str) -> str:
    """A collected state's corpus id: its content hash, so a state asked twice is one item."""
    return f"traffic:{state_sha256[:24]}"


def training_set(path: StoreLocation | str, out: Path, min_count: int = DEFAULT_MIN_COUNT) -> Census:
    """Write what ``cascade train`` reads from the traffic collected in the store at ``path``:
    ``out/questions.json`` (the questions asked at least ``min_count`` times), ``out/corpus.jsonl``
    (each distinct state once, as ``{"id", "text"}``), and each state's first collected answer to
    each such question as a label in the same store. Returns the census (the rest with counts)."""
    items = list(collected(path))
    found = census(items, min_count)
    if not found.heads:  # an empty questions file and corpus, then "next: cascade train" on them
        raise CascadeError(f"no question of the {found.items} request(s) collected in {path} was asked "
                           f"{min_count} times or more: there is nothing to train a head on; collect more "
                           "traffic, or lower --min-count")
    with LabelStore.open_existing(path) as opened:
        _unlike_stored(opened, found.heads)
    by_key = {content_key(q.question): q for q in found.heads}
    labels: dict[str, dict[str, dict[str, float]]] = {}
    texts: dict[str, object] = {}
    for item in items:
        ident = item_id(item.state_sha256)
        for qid, question in item.parsed_questions().items():
            head = by_key.get(content_key(question))
            if head is not None and qid in item.answers:
                labels.setdefault(ident, {}).setdefault(head.id, item.answers[qid])
                texts.setdefault(ident, item.state)
    out.mkdir(mode=0o700, parents=True, exist_ok=True)
    questions = {q.id: q.question.model_dump(mode="json", exclude_none=True) for q in found.heads}
    text = json.dumps({"questions": questions}, indent=2, ensure_ascii=False)  # as `cascade train` reads
    (out / "questions.json").write_text(text + "\n", encoding="utf-8")
    with private_text(out / "corpus.jsonl") as corpus:  # the collected states: customer text
        for ident, state in texts.items():
            corpus.write(json.dumps({"id": ident, "text": state}, ensure_ascii=False) + "\n")
    if labels:
        with LabelStore.open_existing(path) as opened:
            teacher = opened.teacher
        with LabelStore(path, teacher) as store:
            store.bind_questions({head.id: head.question for head in found.heads})
            store.put_many(labels)
    return found
