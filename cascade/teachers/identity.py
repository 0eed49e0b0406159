"""Who answers at an upstream URL: its identity as its answers state it, and a watch over it.

A certificate holds only for the teacher it was made against, so a URL teacher is known by what
its answers say of themselves: the ``model`` they name, and where the server sends an audit, its
``model_hash``, ``calibration_version`` and each question's ``prompt_template_sha256``. None of
it is proof (avrik-server's ``model_hash`` is the ``repo@revision`` its operator declared, not a
hash of the weights: ../shared/notes/upstreams.md), so every field that is sent is compared, and
a per-question template hash catches a prompt change that a name would not.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

from pydantic import BaseModel, ConfigDict

from cascade.errors import TeacherChangedError

_FIELDS = ("model", "model_hash", "calibration_version")


class EndpointIdentity(BaseModel):
    """What an upstream's answers say of their teacher. ``templates`` maps a question id (as the
    caller asked it) to the upstream's ``prompt_template_sha256`` for it. A field left None is one
    the upstream does not send, or one an expectation does not state."""

    model_config = ConfigDict(frozen=True, extra="forbid", protected_namespaces=())

    model: str | None = None
    model_hash: str | None = None
    calibration_version: str | None = None
    templates: dict[str, str] = {}

    def changes(self, seen: EndpointIdentity) -> list[str]:
        """What ``seen`` says differently from this identity, one phrase per field: only the
        fields this one states are compared (a field it leaves None is not known, so not a
        change), and template hashes only of the questions both name."""
        found = [f"{name} {getattr(self, name)!r} is now {getattr(seen, name)!r}"
                 for name in _FIELDS
                 if getattr(self, name) is not None and getattr(seen, name) != getattr(self, name)]
        found += [f"question {qid!r}'s prompt_template_sha256 {sha[:12]}... is now "
                  f"{seen.templates[qid][:12]}..."
                  for qid, sha in self.templates.items()
                  if qid in seen.templates and seen.templates[qid] != sha]
        return found

    def merged(self, seen: EndpointIdentity) -> EndpointIdentity:
        """This identity with what ``seen`` adds: the fields it left None, templates of new
        questions. Call it only where ``changes(seen)`` is empty."""
        filled = {name: getattr(self, name) if getattr(self, name) is not None else getattr(seen, name)
                  for name in _FIELDS}
        return EndpointIdentity(**filled, templates={**seen.templates, **self.templates})

    def describe(self) -> str:
        """One line naming the identity, for messages and logs."""
        parts = [f"{name} {getattr(self, name)!r}" for name in _FIELDS if getattr(self, name) is not None]
        if self.templates:
            parts.append(f"{len(self.templates)} template hash(es)")
        return ", ".join(parts) or "no identity sent"


def identity_of(model: object, audit: Mapping[str, object] | None, qids: list[str]) -> EndpointIdentity:
    """The identity one upstream answer states: ``model``, and from its ``audit`` (None where it
    sends none) the hashes; ``qids`` are the answers' question ids in the order the audit lists
    its per-question ``prompt_template_sha256`` (the response's order)."""
    audit = audit or {}
    templates = audit.get("prompt_template_sha256")
    per_question: dict[str, str] = {}
    if isinstance(templates, list) and len(templates) == len(qids):
        per_question = {qid: str(sha) for qid, sha in zip(qids, templates, strict=True)}
    return EndpointIdentity(model=_text(model), model_hash=_text(audit.get("model_hash")),
                            calibration_version=_text(audit.get("calibration_version")),
                            templates=per_question)


def _text(value: object) -> str | None:
    return value if isinstance(value, str) and value else None


class IdentityWatch:
    """Checks every answer of one upstream against its teacher's identity, loudly.

    ``expected``: the identity a bundle or store holds (None: not known). The first answer pins
    what it states beside the expectation; every later answer must agree with the pinned identity,
    so a model swapped behind the same URL is caught at its first answer. Thread-safe: answers
    arrive from concurrent calls.
    """

    def __init__(self, url: str, expected: EndpointIdentity | None = None) -> None:
        self.url = url
        self.expected = expected
        self.pinned: EndpointIdentity | None = None
        self._lock = threading.Lock()

    def check(self, seen: EndpointIdentity) -> None:
        """Raise ``TeacherChangedError`` naming what changed when ``seen`` is another teacher."""
        with self._lock:
            held = self.pinned or self.expected
            changed = held.changes(seen) if held is not None else []
            if held is not None and changed:
                what = "the teacher this cascade was certified against" if self.pinned is None else \
                    "the teacher it answered as before"
                error = TeacherChangedError(
                    f"the upstream {self.url} is no longer {what} ({held.describe()}): "
                    f"{'; '.join(changed)}. Its answers are refused; point at that teacher again, "
                    "or recalibrate against this one")
                error.changes = tuple(changed)
                raise error
            self.pinned = held.merged(seen) if held is not None else seen

    def reset(self) -> None:
        """Expect nothing: the next answer pins the identity it states. A server calls it once it
        has voided the certificate of the teacher that changed (every answer then comes from the
        upstream, marked), so that the new teacher's answers are taken, and a later change of
        that one is caught again."""
        with self._lock:
            self.expected = self.pinned = None
