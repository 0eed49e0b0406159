"""A running server takes a promoted bundle: the file contract, and the watch that follows it.

The contract between ``cascade promote`` (which writes it) and ``cascade serve --bundle PATH``
(which reads it). ``PATH`` is one of:

- a bundle folder (``manifest.json`` inside);
- a symbolic link to one, which a promotion replaces in one rename
  (``ln -s v2 PATH.tmp && mv -T PATH.tmp PATH``);
- a pointer file: a text file whose first line names the bundle folder, relative to the file's
  own folder, which a promotion replaces in one rename (write ``PATH.tmp``, rename it to ``PATH``).

The server resolves ``PATH`` when it starts, and again on SIGHUP and every ``interval`` seconds.
When it resolves to another folder, or the folder's ``manifest.json`` has another sha256 (a
bundle recalibrated in place), the new bundle is loaded beside the one serving, then swapped in:
new requests go to it, requests in flight finish on the old one, and none is refused. A bundle
that fails to load is logged once and the old one keeps serving; it is tried again once ``PATH``
changes again. One whose audit store cannot be reached now (a PostgreSQL server restarting: its
drift watch must read the audits before it serves) has not failed: it is tried again at later
looks, spaced by ``cascade.backoff``'s pauses up to ``STORE_WAIT``, until the store answers.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from cascade.backoff import Backoff
from cascade.errors import CascadeError, StoreUnavailable
from cascade.hashing import file_sha256

log = logging.getLogger("cascade.serve")
MANIFEST = "manifest.json"
DEFAULT_INTERVAL = 2.0
"""Seconds between two looks at ``--bundle``: a promotion serves within this plus one load."""
STORE_WAIT = 60.0
"""Longest pause between two loads of a bundle waiting for its audit store (each load reads the
models again, so the pauses grow)."""


@dataclass(frozen=True)
class Version:
    """A bundle as served: its folder (links resolved) and its manifest's sha256."""

    directory: Path
    manifest_sha256: str


def resolve(path: Path) -> Path:
    """The bundle folder ``path`` names (a folder, a link to one, or a pointer file)."""
    path = Path(path)
    target = path
    if path.is_file():
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except UnicodeDecodeError:
            raise CascadeError(f"{path} is not a bundle: not a folder, a link to one, nor a pointer file "
                               "naming one (it is not text)") from None
        named = lines[0].strip() if lines else ""
        if not named:
            raise CascadeError(f"the bundle pointer file {path} is empty; its first line must name a "
                               "bundle folder (relative to the file's folder)")
        target = path.parent / named
    if not (target / MANIFEST).is_file():
        via = f" (named by {path})" if target != path else ""
        raise CascadeError(f"no bundle at {target}{via}: no {MANIFEST}; give a folder that cascade train "
                           "wrote, a link to one, or a file naming one")
    return target.resolve()


def version_of(path: Path) -> Version:
    directory = resolve(path)
    return Version(directory, file_sha256(directory / MANIFEST))


class BundleWatch:
    """Looks at ``path`` every ``interval`` seconds (0: only when ``poke``d, as SIGHUP does) and
    calls ``swap`` with each new version, on its own thread; ``swap`` raising leaves the version
    it was given as failed until ``path`` changes again."""

    def __init__(self, path: Path, current: Version, swap: Callable[[Version], None],
                 interval: float = DEFAULT_INTERVAL) -> None:
        self.path, self.current, self.swap, self.interval = Path(path), current, swap, interval
        self.failed: Version | None = None
        self.swaps = self.failures = 0
        self._store_down = Backoff(max(interval, 1.0), STORE_WAIT)
        self._retry_at = 0.0  # while a bundle waits for its audit store
        self._unreadable = False
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="cascade-bundle-watch", daemon=True)
        self._thread.start()

    def poke(self) -> None:
        """Look now (SIGHUP)."""
        self._wake.set()

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.interval if self.interval > 0 else None)
            self._wake.clear()
            if not self._stop.is_set():
                self.check()

    def check(self) -> bool:
        """Swap in ``path``'s bundle if it is a new version; whether it did."""
        try:
            version = version_of(self.path)
        except (OSError, CascadeError) as exc:  # a promotion caught halfway, or a removed folder
            if not self._unreadable:  # said once, until it reads again
                log.warning("bundle watch: cannot read %s (%s); still serving %s", self.path, exc,
                            self.current.directory)
            self._unreadable = True
            return False
        self._unreadable = False
        if version in (self.current, self.failed) or time.monotonic() < self._retry_at:
            return False
        try:
            self.swap(version)
        except StoreUnavailable as exc:
            self._waits(version, exc)
            return False
        except Exception as exc:
            self.failed, self.failures = version, self.failures + 1
            log.error("bundle watch: the bundle at %s did not load (%s: %s); still serving %s",
                      version.directory, type(exc).__name__, exc, self.current.directory)
            return False
        self.current, self.failed, self.swaps = version, None, self.swaps + 1
        self._store_down.succeeded()
        self._retry_at = 0.0
        return True

    def _waits(self, version: Version, exc: StoreUnavailable) -> None:
        """``version`` could not start for want of its audit store: said once, tried again later."""
        first = self._store_down.since is None
        wait = self._store_down.failed()
        self._retry_at = time.monotonic() + wait
        if first:
            when = (f"in {wait:g} s, then at pauses growing to {STORE_WAIT:g} s" if self.interval > 0
                    else "at the next SIGHUP")
            log.warning("bundle watch: the bundle at %s waits for its audit store (%s); still serving %s; "
                        "tried again %s", version.directory, exc, self.current.directory, when)
