"""The first command that reads a corpus against labels that record no text (imported labels, or
labels made before stores recorded texts) records the texts they answer, so that an edit made
after it is caught (``distill.store.texts``): trust on first reading, which labelling does for the
labels it finds, and training and a retrain do for the rest."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path

from cascade.corpus import CorpusItem
from distill.store.core import LabelStore
from distill.store.records import StoreError
from distill.store.texts import checked, unrecorded

log = logging.getLogger("cascade.store")


def read_recorded(store: LabelStore, items: Iterable[CorpusItem], corpus: Path | str) -> list[CorpusItem]:
    """``items``, checked (``checked``), with the hashes of those whose labels record none
    recorded now through a writer of their own. A store that cannot be written (a read-only
    mount) is said in one line, and read as it is."""
    known = store.text_hashes()
    read = list(checked(store, items, corpus, known))
    missing = unrecorded(store.done_items(()), known, read)
    if missing:
        try:
            with LabelStore(store.path, store.teacher) as writer:
                writer.record_texts(missing)
        except StoreError as exc:
            log.warning("the texts of %d labelled items were not recorded (%s): a later edit to them is "
                        "not caught", len(missing), exc)
    return read
