"""The flags of every command that calls a System One URL teacher (``--teacher URL``): the model
name its requests carry and where its key comes from, and the key source they give."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

from cascade.teachers.keys import UPSTREAM_KEY_VARIABLE
from distill.cli.values import positive_seconds

if TYPE_CHECKING:
    from cascade.teachers.keys import KeySource



def add_endpoint_arguments(group: argparse._ArgumentGroup, what: str = "upstream") -> None:
    """--upstream-model, --upstream-key-env, --upstream-key-file; ``what`` names the URL teacher
    in their help (the upstream a server calls, the endpoint a command labels through)."""
    group.add_argument("--upstream-model", metavar="NAME",
                       help=f"the model name each request to the {what} carries, where it requires one "
                       "(default: none)")
    group.add_argument("--upstream-key-env", default=UPSTREAM_KEY_VARIABLE, metavar="VAR",
                       help=f"environment variable holding the {what}'s key (default "
                       f"{UPSTREAM_KEY_VARIABLE})")
    group.add_argument("--upstream-key-file", type=Path, metavar="PATH",
                       help=f"file holding the {what}'s key, re-read when it changes (wins over the "
                       "variable)")


def add_timeout_argument(group: argparse._ArgumentGroup) -> None:
    """--upstream-timeout of an offline command: a teacher behind a URL may be a 4B model on a
    busy card, so one answer may take far longer than a server's callers wait (8 s)."""
    group.add_argument("--upstream-timeout", type=positive_seconds, default=60.0, metavar="S",
                       help="seconds to wait for one answer (default 60); a call with its retries gets twice")


class Timeouts(TypedDict):
    read_timeout: float
    deadline: float


def timeouts(args: argparse.Namespace) -> Timeouts:
    """The ``UpstreamSettings`` timeouts ``--upstream-timeout`` gives."""
    return {"read_timeout": args.upstream_timeout, "deadline": 2 * args.upstream_timeout}


def key_source(args: argparse.Namespace) -> KeySource:
    from cascade.teachers.keys import KeySource

    return KeySource(env=args.upstream_key_env, file=args.upstream_key_file)


def url_argument(text: str) -> str:
    """A ``--teacher`` that can only be a URL (a GGUF teacher is the file its bundle pins)."""
    scheme, sep, rest = text.partition("://")
    if not sep or scheme.lower() not in ("http", "https"):
        from cascade.private import redact_url

        raise argparse.ArgumentTypeError(f"{redact_url(text)!r} is not an http(s)://.../v1/systemone URL; "
                                         "a GGUF teacher is timed from the file the bundle pins")
    return f"{scheme.lower()}://{rest}"
