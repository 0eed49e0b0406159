"""The loop as one command (``cascade loop``): watch the label store, retrain after every N new
teacher labels, run the promotion gate, log each decision.

Everything it keeps lives beside the serving path PATH (what ``cascade serve --bundle`` follows):

- ``PATH.loop.lock``: held (``fcntl.flock``, exclusive, non-blocking) for the loop's whole life,
  so a second loop on PATH is refused and a retrain is never started twice; the kernel lets go of
  it however the loop dies.
- ``PATH.loop.json``: the state (the label count at the last retrain, the attempt counter, and the
  candidate being made), written atomically before and after each retrain, so a killed loop
  restarts where it was.
- ``PATH.versions/v-NNNN``: one folder per candidate; a promoted one is what PATH then names.
- ``PATH.loop.jsonl``: one line per decision (promoted, kept aside, failed, discarded), beside
  the gate's own ``PATH.promotions.jsonl``.

Teacher labels are counted as the store's audits, escalations and collected requests: rows are
only ever appended, so the count at the last retrain is a mark that new labels are counted from.
A candidate recorded as being made when the loop starts was cut short by a kill: if the gate
logged a decision on it, the loop takes that decision; otherwise it is removed unfinished and
never promoted (unless PATH already names it, which only a finished promotion makes happen).
"""

from __future__ import annotations

import os
import re
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, ValidationError

from cascade.atomic import write_atomically
from cascade.bundle.manifest import Bundle
from cascade.encoder.onnx_encoder import Encoder
from cascade.errors import CascadeError, StoreUnavailable
from cascade.locks import exclusive
from cascade.serve.swap import resolve
from distill.loop.promote import promote
from distill.loop.promotions import decided_on, promoting, promotions_log
from distill.loop.retrain import evidence_beside, retrain_bundle
from distill.options import CorpusInput, RunOptions
from distill.store import LabelStore, StoreLocation
from distill.training.finetune import FinetuneConfig
from distill.training.run import restore_interrupted

VERSION = re.compile(r"v-(\d+)")
Outcome = Literal["promoted", "kept aside", "failed", "discarded"]


class LoopStateError(CascadeError, ValueError):
    """PATH.loop.json is not a loop's state: damaged or written by hand."""


class LoopBusyError(CascadeError, RuntimeError):
    """Another loop holds the lock of this serving path."""


class Pending(BaseModel):
    """A candidate being made: its folder and the label counts its retrain started from."""

    candidate: str
    seen: dict[str, int]


class LoopState(BaseModel):
    """What a restarted loop needs: the label count at the last retrain, the last attempt's
    number, and the candidate in the making (None between retrains)."""

    mark: int = Field(default=0, ge=0)
    attempts: int = Field(default=0, ge=0)
    pending: Pending | None = None


class Decision(BaseModel):
    """One line of the loop log: what was seen, the candidate, what became of it and why."""

    at: str
    attempt: int
    seen: dict[str, int]
    new: int
    candidate: str
    outcome: Outcome
    reason: str
    serving: str | None = None


@dataclass(frozen=True)
class LoopPaths:
    """The loop's files beside the serving path (see the module)."""

    serving: Path

    def beside(self, suffix: str) -> Path:
        path = Path(os.path.abspath(self.serving))
        return path.parent / f"{path.name}{suffix}"

    @property
    def lock(self) -> Path:
        return self.beside(".loop.lock")

    @property
    def state(self) -> Path:
        return self.beside(".loop.json")

    @property
    def log(self) -> Path:
        return self.beside(".loop.jsonl")

    @property
    def versions(self) -> Path:
        return self.beside(".versions")


@dataclass(frozen=True)
class RetrainSettings:
    """What each retrain is given, as ``cascade retrain`` takes it."""

    corpus: CorpusInput | None = None
    finetune: FinetuneConfig | None = None
    target: float | None = None
    delta: float | None = None
    calibrate_on: str = "all"
    teacher_items: int = 0
    run: RunOptions | None = None
    encoder: Encoder | None = None


def teacher_labels(store: LabelStore) -> dict[str, int]:
    """The store's teacher-labelled rows by stream: cheap counts, read on every poll."""
    return {"audits": store.audit_count(), "escalations": store.escalation_count(),
            "collected": store.traffic_count()}


@contextmanager
def loop_lock(paths: LoopPaths) -> Iterator[None]:
    """Hold PATH.loop.lock, or raise LoopBusyError naming the process that holds it."""
    def busy(holder: str) -> LoopBusyError:
        return LoopBusyError(f"another `cascade loop` (pid {holder}) is watching {paths.serving} (it "
                             f"holds {paths.lock}); stop it first, or give another --bundle")

    with exclusive(paths.lock, busy):
        yield


class Loop:
    """One serving path's loop: ``step`` looks at the store once and retrains where due; the
    caller holds ``loop_lock`` around it."""

    def __init__(self, serving: Path, store: StoreLocation | str, every: int, settings: RetrainSettings,
                 say: Callable[[str], None] = print) -> None:
        self.paths, self.store, self.every = LoopPaths(serving), store, every
        self.settings, self.say = settings, say
        self.state = self._load()

    def _load(self) -> LoopState:
        if not self.paths.state.is_file():
            return LoopState()
        try:
            return LoopState.model_validate_json(self.paths.state.read_text(encoding="utf-8"))
        except (ValidationError, UnicodeDecodeError) as exc:
            why = exc.errors()[0]["msg"] if isinstance(exc, ValidationError) else "not UTF-8 text"
            raise LoopStateError(f"{self.paths.state} is not a loop's state ({why}); "
                                 "`cascade loop` alone writes it: restore it, or delete it (the loop "
                                 "then counts every teacher label as new and retrains at its first "
                                 "poll)") from None

    def _save(self) -> None:
        write_atomically(self.paths.state, self.state.model_dump_json(indent=2) + "\n")

    def recover(self, why: str = "the loop was stopped") -> Decision | None:
        """Settle a candidate a killed loop (or a store outage: ``why``) left in the making: the
        gate's decision where it logged one (its swap finished where cut short:
        ``promotions.promoting``), else the folder removed unfinished (never promoted)."""
        with promoting(self.paths.serving):
            pending = self.state.pending
            if pending is None:
                return None
            decided = decided_on(promotions_log(self.paths.serving), Path(pending.candidate))
        if decided is None and not self._serves(Path(pending.candidate)):
            _remove_unfinished(Path(pending.candidate))
            decision = self._decision(pending, "discarded", f"{why} while making this candidate; it was "
                                      "removed unfinished and is made again when due")
            self.state.pending = None
        else:
            promoted = decided is None or decided.promoted
            reason = decided.reason if decided else "the serving path names it"
            decision = self._decision(pending, "promoted" if promoted else "kept aside", reason)
            self.state.mark, self.state.pending = sum(pending.seen.values()), None
        self._record(decision)
        self._save()
        return decision

    def step(self, now: bool = False) -> Decision | None:
        """Count the store's teacher labels; where ``every`` are new since the mark (or ``now``),
        retrain, promote and log the decision. None where nothing was due."""
        with LabelStore.open_existing(self.store) as store:
            seen = teacher_labels(store)
            new = sum(seen.values()) - self.state.mark
            if new < self.every and not now:
                self.say(f"{new} new teacher labels since the last retrain ({_counts(seen)}); retrains at "
                         f"{self.every}")
                return None
            self.state.attempts = self._next_version()
            pending = Pending(candidate=str(self.paths.versions / f"v-{self.state.attempts:04d}"), seen=seen)
            self.state.pending = pending
            self._save()
            decision = self._retrain_and_promote(store, pending)
        self._record(decision)  # before the state moves on: a record that fails is made again on restart
        self.state.mark, self.state.pending = sum(seen.values()), None
        self._save()
        return decision

    def _retrain_and_promote(self, store: LabelStore, pending: Pending) -> Decision:
        """One attempt; a refusal a user can act on (too little held-out evidence, say) is a
        decision too, so the loop waits for N more labels rather than retrying every poll."""
        s, candidate = self.settings, Path(pending.candidate)
        try:
            serving = Bundle.load(resolve(self.paths.serving))
            retrain_bundle(serving, store, candidate, s.corpus, finetune=s.finetune, target=s.target,
                           delta=s.delta, calibrate_on=s.calibrate_on, run=s.run, encoder=s.encoder,
                           teacher_items=s.teacher_items)
            record = promote(self.paths.serving, candidate, store, run=s.run, encoder=s.encoder,
                             log=promotions_log(self.paths.serving))
        except StoreUnavailable:  # not a decision: the attempt is settled and made again when it answers
            raise
        except (CascadeError, OSError) as exc:  # OSError: a full disk, a path that is a file
            again = f"tried again after {self.every} more teacher labels, or at once by a loop run with --now"
            return self._decision(pending, "failed", f"{type(exc).__name__}: {exc} ({again})")
        return self._decision(pending, "promoted" if record.promoted else "kept aside", record.reason)

    def _next_version(self) -> int:
        """The next attempt's number, the NNNN of PATH.versions/v-NNNN: past both the attempt
        counter and any folder there (a lost state file must never make a retrain write over the
        bundle serving)."""
        taken = [int(m.group(1)) for p in self.paths.versions.glob("v-*") if (m := VERSION.fullmatch(p.name))]
        return max([self.state.attempts, *taken]) + 1

    def _serves(self, candidate: Path) -> bool:
        try:
            return resolve(self.paths.serving) == candidate.resolve()
        except CascadeError:
            return False

    def _decision(self, pending: Pending, outcome: Outcome, reason: str) -> Decision:
        try:
            serving: str | None = str(resolve(self.paths.serving))
        except CascadeError:
            serving = None
        at = datetime.now(timezone.utc).isoformat(timespec="seconds")
        new = sum(pending.seen.values()) - self.state.mark
        return Decision(at=at, attempt=self.state.attempts, seen=pending.seen, new=new,
                        candidate=pending.candidate, outcome=outcome, reason=reason, serving=serving)

    def _record(self, decision: Decision) -> None:
        with self.paths.log.open("a", encoding="utf-8") as handle:
            handle.write(decision.model_dump_json() + "\n")
        said = decision.reason if decision.reason.startswith(decision.outcome) else \
            f"{decision.outcome}: {decision.reason}"  # the gate's reason names its decision
        self.say(f"attempt {decision.attempt}: {decision.new} new teacher labels ({_counts(decision.seen)}); "
                 f"{decision.candidate}: {said}")


def watch(serving: Path, store: StoreLocation | str, every: int, settings: RetrainSettings, *,
          poll: float = 60.0, once: bool = False, now: bool = False,
          say: Callable[[str], None] = print) -> list[Decision]:
    """Hold the lock, settle what a killed loop left, then step every ``poll`` seconds (once
    only with ``once``; the first step retrains whatever the count with ``now``); returns the
    decisions made (a caller of ``once`` reads them). A serving path that names no bundle is
    refused before anything is written beside it (a mistyped --bundle)."""
    _check_serving(Path(serving))
    with loop_lock(LoopPaths(serving)), ExitStack() as served:
        loop = Loop(serving, store, every, settings, say)
        held = _lock_served(serving, served, None)
        decisions = [d for d in [loop.recover()] if d is not None]
        while True:
            held = _lock_served(serving, served, held)
            decision = _step(loop, poll, once, now)
            now = False
            decisions += [decision] if decision is not None else []
            if once:
                return decisions
            time.sleep(poll)


def _lock_served(serving: Path, served: ExitStack, held: Path | None) -> Path | None:
    """Hold the loop lock of the folder ``serving`` names now (where it is a link or a pointer
    file), as a loop given that folder itself holds it: a loop on a link and one on its folder each
    held their own lock, and retrained and gated the same bundle at once, each counting its own
    attempts. Moved on to the folder a promotion swapped in; None where ``serving`` is the folder."""
    try:
        folder = resolve(Path(serving))
    except CascadeError:
        return held  # a swap in progress or a damaged pointer: the step says so
    if folder == Path(os.path.abspath(serving)) or folder == held:
        return held
    served.close()  # the folder served before: another loop may take it now
    served.enter_context(loop_lock(LoopPaths(folder)))
    return folder


def _check_serving(serving: Path) -> None:
    """Refuse a serving path that names no bundle (one a kill left mid-swap is put back first)."""
    if Path(os.path.abspath(serving)).parent.is_dir():
        restore_interrupted(Path(os.path.abspath(serving)))
    try:
        resolve(serving)
    except CascadeError as exc:
        raise CascadeError(f"{exc}. `cascade loop --bundle` takes the path `cascade serve --bundle` "
                           "serves, and retrains from the bundle it names") from None


def _step(loop: Loop, poll: float, once: bool, now: bool = False) -> Decision | None:
    """One step; a store that cannot be reached now (a PostgreSQL server restarting) is said and
    tried again at the next poll, an attempt it cut short settled as a killed loop's would be."""
    try:
        return loop.step(now)
    except StoreUnavailable as exc:
        if once:
            raise
        loop.say(f"the store is unavailable ({exc}); looking again in {poll:g} s")
        return loop.recover("the store became unavailable")


def _remove_unfinished(candidate: Path) -> None:
    """A killed retrain's candidate folder, the states it was training on
    (``retrain.evidence_beside``), the serving bundle's refreshed copy its gate may have begun
    (``CANDIDATE.serving``: swapped in only after the gate logged it, so never served here), and the
    staging folders its training left beside it (``distill.training.run.staged``: removed
    only by a later run of the same name, and a discarded candidate's name is never used again)."""
    shutil.rmtree(candidate, ignore_errors=True)
    shutil.rmtree(candidate.with_name(f"{candidate.name}.serving"), ignore_errors=True)
    evidence_beside(candidate).unlink(missing_ok=True)
    for stale in candidate.parent.glob(f".{candidate.name}.training-*"):
        shutil.rmtree(stale, ignore_errors=True)
    for lock in (".training.lock", ".retrain.lock"):
        (candidate.parent / f".{candidate.name}{lock}").unlink(missing_ok=True)


def _counts(seen: dict[str, int]) -> str:
    return ", ".join(f"{n} {stream}" for stream, n in seen.items())
