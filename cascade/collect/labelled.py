"""A state the teacher answered, as a server keeps it: what an audit and an escalation share.

Both are teacher labels of one served state, stored under an id of their own and tagged with the
calibration the thresholds came from; they differ in how the state was chosen (a uniform sample,
or the cascade's doubt), which decides what each may be used for.
"""

from __future__ import annotations

import hashlib
import json

from pydantic import BaseModel, Field

from cascade.questions import State


class LabelledState(BaseModel):
    """``item_id``: unique per record, ``state``, ``calibration_version``, ``at`` (seconds since the
    epoch), and per question the teacher's distribution by option key (``teacher``), with the
    sha256 of the prompt it read where known (``prompt_hashes``). ``inclusion``: the probability
    the state was kept, the share asked for times its survival of the random drops of the full
    queues it met on the way to the store (``cascade.deferral``), so that estimators can weight
    it by its inverse; None in records written before it was kept."""

    item_id: str
    state: State
    calibration_version: str
    at: float
    teacher: dict[str, dict[str, float]]
    prompt_hashes: dict[str, str] = {}
    inclusion: float | None = Field(default=None, gt=0, le=1)

    @property
    def state_sha256(self) -> str:
        """The state's content hash: the same state kept twice is one observation."""
        return hashlib.sha256(json.dumps(self.state, sort_keys=True).encode()).hexdigest()
