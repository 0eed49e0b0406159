"""Stopping a long run cleanly: the first Ctrl-C or SIGTERM says so at once and ends the run after
the item in hand (its labels committed), a second Ctrl-C or SIGTERM ends it at once: a run held
by a store that stopped answering (no item ends) is then ended by a job scheduler's second signal
too, not only at a terminal."""

from __future__ import annotations

import signal
import sys
import threading
from types import FrameType, TracebackType


class StopRequest:
    """Installs the handlers for the ``with`` block (main thread only; elsewhere it is inert)."""

    def __init__(self, what: str = "this item") -> None:
        self.what = what
        self.requested: str | None = None  # the signal's name, once one came
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]

    @property
    def exit_status(self) -> int:
        """A stopped command's exit status, as a shell reports a process a signal ended: 128 plus
        the signal's number (130 for Ctrl-C, 143 for SIGTERM; 130 where none came, a bare
        KeyboardInterrupt)."""
        return 128 + signal.Signals[self.requested or "SIGINT"].value

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.requested is not None:
            raise KeyboardInterrupt
        self.requested = name
        print(f"\n{name}: stopping after {self.what} (its labels are committed); Ctrl-C or SIGTERM "
              "again stops now", file=sys.stderr, flush=True)
