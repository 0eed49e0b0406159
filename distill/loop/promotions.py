"""What a promotion leaves behind, and how it is made to stick: the decision record (one line of
``NAME.promotions.jsonl`` per gate, ``Promotion``) and the swap it decides (``cascade.serve.swap``
follows the serving path PATH).

A decision is carried out write-ahead, so that a run killed anywhere leaves nothing half-done that
the next run does not finish:

1. ``PATH.promote.pending.json`` gets the record (written whole, atomically);
2. the record is appended to the log as one line (one write, fsynced);
3. the serving path is swapped to what it decided (the candidate, or the serving bundle's copy a
   kept-aside gate refreshed), where it decided one;
4. the pending file is removed.

Each promotion of PATH holds ``PATH.promote.lock`` (``promoting``), so a hand-run ``cascade
promote`` beside ``cascade loop`` is refused in one line rather than swapping a bundle in that the
loop's gate then replaces unweighed. On taking it, a pending file a killed run left is finished
first: its line appended where missing, and the swap made where the serving path still serves the
bundle the gate weighed (one changed by hand since is never undone). A log's torn last line (a
kill or a full disk mid-write: no newline, not a whole record) is not a decision, and is cut before
the next line is appended; any other line that is not a record is refused, naming it.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ValidationError

from cascade.atomic import write_atomically
from cascade.bundle.manifest import MANIFEST_NAME, Bundle
from cascade.errors import CascadeError
from cascade.hashing import file_sha256
from cascade.locks import exclusive
from cascade.serve.swap import resolve
from distill.training.run import restore_interrupted, staged

LOG_SUFFIX = ".promotions.jsonl"
PREVIOUS_SUFFIX = ".previous"


class PromotionBusyError(CascadeError, RuntimeError):
    """Another promotion of this serving path is running, or the path changed under one."""


class PromotionsLogError(CascadeError, ValueError):
    """A line of the promotions log, other than a torn last one, is not a decision record."""


class BundleVersion(BaseModel):
    """Which bundle: its name, folder, manifest hash and calibration version."""

    name: str
    path: str
    manifest_sha256: str
    calibration_version: str

    @classmethod
    def of(cls, bundle: Bundle) -> BundleVersion:
        return cls(name=bundle.manifest.name, path=str(bundle.directory.resolve()),
                   manifest_sha256=file_sha256(bundle.directory / MANIFEST_NAME),
                   calibration_version=bundle.manifest.calibration.version())


class Gate(BaseModel):
    """The figures a promotion is decided on: both bundles certified on the same held-out items,
    ``items`` of the candidate's certifying part and ``evaluated`` of its evaluation part
    (``certified_on`` "held-out"; a record written before 2026-12-07 says "certifying": the
    evaluation items were weighed by the rule but certified nothing), at ``target`` and
    ``certificate_delta`` each (half of what attempt ``attempt`` against this serving bundle may
    spend of ``delta``: ``distill.loop.gate``); ``excluded``: held-out items of the candidate the
    serving bundle trained on. ``serving_share`` and ``candidate_share``: the
    shares the certified thresholds keep (answers the cheap tiers keep, per question in ``shares``
    and averaged). ``rule``: the choosing rule; ``serving_plugin`` and ``candidate_plugin`` the
    plug-in shares it compares (averaged over the questions and the ``band`` of targets),
    ``difference`` theirs and ``lower_bound`` its one-sided ``1 - alpha`` paired bootstrap bound
    over ``resamples``; promoted only where it is above 0. ``serving_before``: the share the serving
    bundle's own thresholds (those it served until this gate) keep of the same items, averaged as
    ``serving_share`` is. ``evidence_after``: where a drift alarm refuted the serving bundle's
    certificate (or one before it), only items labelled after it were weighed, and ``set_aside``
    held-out items labelled before it were not."""

    target: float
    delta: float
    certificate: str
    items: int
    excluded: int
    evaluated: int = 0
    serving_share: float
    candidate_share: float
    shares: dict[str, dict[str, float]]
    rule: str = "certified-share"
    attempt: int = 1
    certificate_delta: float | None = None
    alpha: float | None = None
    resamples: int | None = None
    serving_plugin: float | None = None
    candidate_plugin: float | None = None
    difference: float | None = None
    lower_bound: float | None = None
    band: tuple[float, ...] | None = None
    certified_on: Literal["certifying", "held-out"] = "certifying"
    serving_before: float | None = None
    evidence_after: str | None = None
    set_aside: int = 0

    def weighed(self) -> str:
        """How many held-out items the rule weighed, of which parts."""
        if not self.evaluated:
            return f"{self.items}"
        return f"{self.items} certifying and {self.evaluated} evaluation"

    def certified(self) -> str:
        """How many held-out items both certificates rest on, of which parts."""
        return self.weighed() if self.certified_on == "held-out" else f"{self.items} certifying"


Refresh = Literal["kept-nothing", "keeps-more"]
"""Why a kept-aside gate's serving bundle took the thresholds the gate certified for it: its own kept
nothing, or they were a gate's and kept fewer of the items weighed."""


class Promotion(BaseModel):
    """One decision, as the promotions log keeps it."""

    at: str
    promoted: bool
    serving: BundleVersion
    candidate: BundleVersion
    gate: Gate
    reason: str
    previous: str | None = None
    refreshed: str | None = None
    refresh: Refresh | None = None


class Unfinished(BaseModel):
    """A decision being carried out (``PATH.promote.pending.json``): the record and its log."""

    log: str
    record: Promotion


def promotions_log(serving: Path) -> Path:
    """The log beside what ``--bundle`` names: ``models/support`` -> ``models/support.promotions.jsonl``."""
    return _beside(serving, LOG_SUFFIX)


def _beside(serving: Path, suffix: str) -> Path:
    serving = Path(os.path.abspath(serving))
    return serving.parent / f"{serving.name}{suffix}"


def records(log: Path) -> list[Promotion]:
    """Every decision the log holds, oldest first (none where there is no log; a torn last line
    skipped)."""
    if not Path(log).is_file():
        return []
    try:
        text = Path(log).read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise PromotionsLogError(f"{log} is not a promotions log (not UTF-8 text): give the log "
                                 "`cascade promote` writes, or a path where none is yet") from None
    lines = text.splitlines()
    found = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            found.append(Promotion.model_validate_json(line))
        except ValidationError as exc:
            if number == len(lines) and not text.endswith("\n"):
                continue  # torn: cut before the next append
            raise PromotionsLogError(f"line {number} of {log} is not a promotion record "
                                     f"({exc.errors()[0]['msg']}); it is written by `cascade promote` "
                                     "alone: restore it, or delete that line (the attempt count "
                                     "against the serving bundle then restarts lower)") from None
    return found


def latest_promotion(log: Path) -> Promotion | None:
    """The last promotion the log records (refusals skipped), or None: what a server serves."""
    return next((record for record in reversed(records(log)) if record.promoted), None)


def decided_on(log: Path, candidate: Path) -> Promotion | None:
    """The gate's logged decision on ``candidate``, if it made one."""
    target = str(Path(candidate).resolve())
    return next((record for record in reversed(records(log)) if record.candidate.path == target), None)


@contextmanager
def promoting(serving: Path) -> Iterator[Promotion | None]:
    """Hold ``PATH.promote.lock`` (or raise PromotionBusyError naming its holder), first finishing
    what a killed run left pending; yields that decision, None where there was none."""
    lock = _beside(serving, ".promote.lock")

    def busy(holder: str) -> PromotionBusyError:
        return PromotionBusyError(f"another promotion of {serving} is running (pid {holder}, holding "
                                  f"{lock}): a `cascade promote` or a `cascade loop`'s gate; wait for it "
                                  "to finish, then weigh the candidate against what serves then")

    with exclusive(lock, busy):
        yield _finish(serving)


def writable_log(log: Path) -> Path:
    """``log`` as an absolute path, checked before any gate's work: a writable regular file, or
    none yet in a writable folder. Why: a log that could not be written failed after the pending file
    named it, and every later promotion then failed finishing it; a relative path was finished
    against whatever folder the next run started in; and a device (``/dev/full``) read as an empty
    log, so the gate ran as a first attempt."""
    path = Path(os.path.abspath(log))
    if path.exists() and not path.is_file():
        raise PromotionsLogError(f"the promotions log {log} is not a regular file; move it aside (or give "
                                 "`cascade promote --log` a file path)")
    if path.exists():
        writable = os.access(path, os.W_OK)
    else:  # not made here: a refused promotion leaves no empty log behind
        writable = path.parent.is_dir() and os.access(path.parent, os.W_OK | os.X_OK)
    if not writable:
        raise PromotionsLogError(f"cannot write the promotions log {log}: its folder must exist and be "
                                 "writable (`cascade promote --log` takes another file)")
    return path


def carry_out(serving: Path, log: Path, record: Promotion) -> None:
    """Log ``record`` and make the swap it decides, write-ahead (see the module); the caller holds
    ``promoting``. Refused, with nothing logged, where PATH no longer serves the bundle weighed."""
    if _serving_sha(serving) != record.serving.manifest_sha256:
        raise PromotionBusyError(f"{serving} changed while the gate weighed {record.serving.path}: "
                                 "nothing was logged or swapped; run the gate again")
    pending = _beside(serving, ".promote.pending.json")
    write_atomically(pending, Unfinished(log=str(log), record=record).model_dump_json() + "\n")
    _append(log, record)
    _serve(serving, record)
    pending.unlink()


def _finish(serving: Path) -> Promotion | None:
    pending = _beside(serving, ".promote.pending.json")
    if not pending.is_file():
        return None
    try:
        unfinished = Unfinished.model_validate_json(pending.read_text(encoding="utf-8"))
        log, record = Path(unfinished.log), unfinished.record
        if not any(logged.model_dump_json() == record.model_dump_json() for logged in records(log)[-1:]):
            _append(log, record)
        _serve(serving, record)
    except (OSError, ValueError, PromotionsLogError) as exc:  # ValueError: ValidationError, not UTF-8
        why = exc.errors()[0]["msg"] if isinstance(exc, ValidationError) else str(exc)
        raise PromotionsLogError(f"{pending} holds a decision an earlier promotion of {serving} left "
                                 f"unfinished, and finishing it failed ({why}); mend what it names, or "
                                 "delete that file (its decision then stays unlogged, and its swap "
                                 "unmade where it was not made)") from None
    pending.unlink()
    return record


def _serve(serving: Path, record: Promotion) -> None:
    """Swap PATH to what ``record`` decided, unless it serves that already, or serves neither it
    nor the bundle the gate weighed (changed by hand: never undone)."""
    target = Path(record.refreshed) if record.refreshed else Path(record.candidate.path) \
        if record.promoted else None
    restore_interrupted(Path(os.path.abspath(serving)))
    if target is None or not (target / MANIFEST_NAME).is_file():
        return
    now = _serving_sha(serving)
    if now == file_sha256(target / MANIFEST_NAME) or now != record.serving.manifest_sha256:
        return
    _swap(Path(serving), resolve(Path(serving)), target)


def _serving_sha(serving: Path) -> str:
    return file_sha256(resolve(Path(serving)) / MANIFEST_NAME)


def _append(log: Path, record: Promotion) -> None:
    """One line, in one write, fsynced, after cutting a torn last line (no newline) a kill left."""
    _cut_torn(log)
    descriptor = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    with os.fdopen(descriptor, "wb") as handle:
        handle.write((record.model_dump_json() + "\n").encode("utf-8"))
        handle.flush()
        os.fsync(handle.fileno())


def _cut_torn(log: Path) -> None:
    """A last line without its newline is ended where it is a whole record (an edit that dropped
    the newline: ``records`` counts it, so it must stay), and cut where it is not (torn)."""
    if not log.is_file() or log.stat().st_size == 0:
        return
    with log.open("rb+") as handle:
        content = handle.read()
        if content.endswith(b"\n"):
            return
        start = content.rfind(b"\n") + 1
        try:
            Promotion.model_validate_json(content[start:])
        except ValidationError:
            handle.truncate(start)
            return
        handle.write(b"\n")


def replaced_at(path: Path, serving_dir: Path) -> Path:
    """Where ``_swap`` leaves the bundle it replaces: known before the swap, so that a refresh,
    logged before it swaps, names it."""
    if path.is_symlink() or path.is_file():
        return serving_dir
    return serving_dir.parent / f"{serving_dir.name}{PREVIOUS_SUFFIX}"


def _swap(path: Path, serving_dir: Path, candidate_dir: Path) -> None:
    """Serve the candidate from ``path``, the replaced bundle left where ``replaced_at`` says. A
    link or pointer file is replaced in one rename; a folder gets the candidate copied over it (its
    old contents kept as NAME.previous beside it)."""
    if path.is_symlink() or path.is_file():
        target = os.path.relpath(candidate_dir.resolve(), path.absolute().parent)
        fresh = path.with_name(f".{path.name}.promoting")
        fresh.unlink(missing_ok=True)
        if path.is_symlink():
            fresh.symlink_to(target, target_is_directory=True)
        else:
            fresh.write_text(target + "\n", encoding="utf-8")
        os.replace(fresh, path)
        return
    previous = replaced_at(path, serving_dir)
    shutil.rmtree(previous, ignore_errors=True)
    shutil.copytree(serving_dir, previous)
    with staged(serving_dir) as stage:
        shutil.copytree(candidate_dir, stage, dirs_exist_ok=True)
