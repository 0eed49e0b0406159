"""The ``cascade`` command: parses arguments, calls the library, prints. No logic of its own.

Each subcommand is a module here with ``add_parser(subparsers)``, registered in ``COMMANDS``
(``serve`` is a package, ``serve/``: its flags are many, and a reader of ``cascade/serve/`` looks
for them there); the modules import the library lazily, so ``cascade --help`` starts fast.
Errors a user can fix (``CascadeError``) are printed as one ``Type: message`` line with exit
status 2; a traceback means a bug. This is the top of the stack, so it lives in ``distill``: it
calls offline work as well as the runtime, and ``cascade`` (which a user who only routes installs
alone) never imports it.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from types import FrameType

from cascade.errors import CascadeError
from cascade.private import redact_text
from distill.cli import (
    audit,
    calibrate,
    collected,
    decide,
    demo,
    evaluate,
    label,
    loop,
    promote,
    ray_config,
    retrain,
    roofline,
    score,
    serve,
    teacher_model,
    train,
)

Command = Callable[[argparse.Namespace], int]
COMMANDS = {"score": score.add_parser, "roofline": roofline.add_parser, "label": label.add_parser,
            "train": train.add_parser, "decide": decide.add_parser, "evaluate": evaluate.add_parser,
            "calibrate": calibrate.add_parser, "demo": demo.add_parser,
            "teacher-model": teacher_model.add_parser, "serve": serve.add_parser, "audit": audit.add_parser,
            "collected": collected.add_parser, "retrain": retrain.add_parser, "promote": promote.add_parser,
            "loop": loop.add_parser, "ray-config": ray_config.add_parser}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cascade",
        description="Tiered cascade decision router: answer typed questions about a state cheaply.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add_parser in COMMANDS.values():
        add_parser(sub)
    return parser


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the command runs as Ctrl-C is. Why: Python's default ended the
    process at once and silent (status 143), so a retrain or promotion stopped that way ran none of
    the clean-up a Ctrl-C runs, and said nothing. Commands that stop on their own terms
    (``label``'s ``distill.stopping``, ``serve``'s uvicorn) set their own handler over this one."""


def _terminated(signum: int, frame: FrameType | None) -> None:
    raise Terminated


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """``Terminated`` on SIGTERM while a command runs, the handler before restored after (a test
    calling ``main`` keeps its own); only the main thread can set one."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = signal.signal(signal.SIGTERM, _terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # argparse's own line, and where the command knows the likely slip (``hint``), it
        parser.error(f"unrecognized arguments: {' '.join(unknown)}{getattr(args, 'hint', '')}")
    run: Command = args.run
    try:
        with _sigterm_as_interrupt():
            return run(args)
    except CascadeError as exc:
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # a path given that cannot be written or read (a folder, a missing folder)
        print(f"{type(exc).__name__}: {redact_text(str(exc))}; check the paths given", file=sys.stderr)
        return 2
    except Terminated:
        print("terminated (SIGTERM)", file=sys.stderr)
        return 143
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
