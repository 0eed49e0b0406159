"""Before a labelling run labels anything, its corpus is checked against the store's labels: an
item edited under an id the store has labels of is refused, for the run would count it "already
done" (or label its other questions on the new text beside answers to the old one). Labels made
before the store recorded texts get their corpus text's hash now, and are checked from here on
(``distill.store.texts``)."""

from __future__ import annotations

from pathlib import Path

from cascade.corpus import read_corpus
from distill.store import LabelStore
from distill.store.texts import checked, unrecorded


def check_texts(store: LabelStore, corpus: Path, text_field: str, record: bool = True) -> dict[str, str]:
    """Raise ``EditedItemsError`` naming the corpus's edited items; the hashes of labelled items
    that record none, recorded in ``store`` (``record``) or returned for the caller to record.
    Bad lines are passed over: the run's own reading reports them."""
    labelled = store.done_items(())
    if not labelled:
        return {}
    known = store.text_hashes()
    items = read_corpus(corpus, text_field, "skip", lambda _: None)
    missing = unrecorded(labelled, known, checked(store, items, corpus, known))
    if record and missing:
        store.record_texts(missing)
    return missing
