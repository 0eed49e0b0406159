"""Teacher label store: one interface (``LabelStore``), two backends. A path is a SQLite file, the
embedded default; a ``postgresql://`` URL is a PostgreSQL database, for writers on many machines
(the postgres extra). Both keep each item's labels in one transaction, lose and duplicate nothing
under kill -9, bind a store to one teacher, check its schema version on open, and let a labelling
run resume; see docs/stores.md for what each promises.
"""

from distill.store.core import CLAIM_LEASE_S, LabelStore, has_labels, removed_on_failure
from distill.store.location import StoreLocation, StoreURL, is_url, store_location
from distill.store.places import exists as store_exists
from distill.store.records import (
    SCHEMA_VERSION,
    SUM_TOLERANCE,
    TEACHER_FIELDS,
    InputPolicy,
    Label,
    StoreError,
    StoreMismatchError,
    StoreUnavailableError,
    Teacher,
    check_probabilities,
    conflict_message,
)

__all__ = [
    "CLAIM_LEASE_S",
    "SCHEMA_VERSION",
    "SUM_TOLERANCE",
    "TEACHER_FIELDS",
    "InputPolicy",
    "Label",
    "LabelStore",
    "StoreError",
    "StoreLocation",
    "StoreMismatchError",
    "StoreURL",
    "StoreUnavailableError",
    "Teacher",
    "check_probabilities",
    "conflict_message",
    "has_labels",
    "is_url",
    "removed_on_failure",
    "store_exists",
    "store_location",
]
