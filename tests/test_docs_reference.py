"""The manual's generated reference and its code blocks (issue 42 Must 3).

The CLI reference page is rendered at build time by a mkdocs hook from the ``cascade`` parser;
these tests call the hook's generator directly (no mkdocs run) and check it names every
subcommand and every flag, so that a flag added or renamed later is on the page. The API page
must name every public name, and no fenced code line in docs/ may be wider than the page shows.
"""

from __future__ import annotations

import argparse
import importlib.util
import re
from pathlib import Path
from types import ModuleType

import pytest

import cascade
from distill.cli import build_parser

DOCS = Path(__file__).resolve().parents[1] / "docs"
CODE_WIDTH = 80
"""Characters a code line may hold: what mkdocs-material's content column shows without cutting
(measured in headless Chromium: 80.2 monospace characters at window widths 1280-2560, 86 at
1024, where the table of contents folds away)."""
FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})")


def _hook(name: str) -> ModuleType:
    """A docs/hooks module, loaded by path as mkdocs loads it."""
    spec = importlib.util.spec_from_file_location(name, DOCS / "hooks" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def _names_flag(page: str, flag: str) -> bool:
    """Whether ``flag`` is on the page as an inline code spelling (`--flag` or `--flag ARG`)."""
    return re.search(rf"`{re.escape(flag)}[ `]", page) is not None


def _wide_code_lines(markdown: str) -> list[str]:
    """Lines inside fenced code blocks wider than CODE_WIDTH, the fence's indent not counted."""
    wide, fence, indent = [], "", 0
    for line in markdown.splitlines():
        match = FENCE.match(line)
        if match and (not fence or match.group(2).startswith(fence)):
            fence, indent = ("", 0) if fence else (match.group(2), len(match.group(1)))
        elif fence and len(line.rstrip()) - indent > CODE_WIDTH:
            wide.append(line)
    return wide


def test_cli_reference_names_every_subcommand_and_flag() -> None:
    parser = build_parser()
    page = _hook("cli_reference").render_cli_reference(parser)
    missing = []
    for name, sub in _subcommands(parser).items():
        if f"## `{sub.prog}`" not in page:
            missing.append(f"subcommand {name}")
        section = page.split(f"## `{sub.prog}`", 1)[-1].split("\n## ", 1)[0]
        missing += [f"{name} {flag}" for action in sub._actions for flag in action.option_strings
                    if not _names_flag(section, flag)]
    assert not missing, f"the CLI reference leaves out: {missing}"


def test_cli_reference_renders_help_hidden_flags_and_examples() -> None:
    """On a parser made here: help with its default filled in, markdown characters escaped, a
    hidden old spelling named with its new one, and an example line kept within the page."""
    parser = argparse.ArgumentParser(prog="tool")
    sub = parser.add_subparsers(dest="command").add_parser(
        "run", help="run *it*", epilog="example: tool run " + "--share 0.5 " * 12)
    new = sub.add_argument("--share", type=float, default=0.02, help="the share (default %(default)s)")
    old = sub.add_argument("--fraction", dest="share", help=argparse.SUPPRESS)
    old.new = new.option_strings[0]  # type: ignore[attr-defined]  # as distill.cli.renamed marks one
    page = _hook("cli_reference").render_cli_reference(parser)
    assert "- `--share SHARE`: the share (default 0.02)" in page
    assert "run \\*it\\*" in page
    assert "- `--fraction`: use `--share`" in page
    assert _wide_code_lines(page) == []
    assert "tool run --share 0.5" in page and " \\\n" in page  # cut with a shell continuation


def test_generated_cli_reference_fits_the_page() -> None:
    page = _hook("cli_reference").render_cli_reference(build_parser())
    assert _wide_code_lines(page) == []


def test_api_reference_documents_every_public_name() -> None:
    page = (DOCS / "reference" / "api.md").read_text(encoding="utf-8")
    documented = {line.split(".")[-1].strip() for line in page.splitlines() if line.startswith(":::")}
    assert sorted(set(cascade.__all__) - documented) == []


def test_benchmarks_page_links_resolve_from_its_folder() -> None:
    summary = _hook("benchmarks_summary").site_summary(
        "| [a](docs/benchmarks/scorer.md#x) | [b](docs/guarantee.md) | [c](https://e.org/docs/y.md) |")
    assert summary == "| [a](scorer.md#x) | [b](../guarantee.md) | [c](https://e.org/docs/y.md) |"


@pytest.mark.parametrize("page", sorted(DOCS.rglob("*.md")), ids=lambda p: str(p.relative_to(DOCS)))
def test_no_code_line_wider_than_the_page(page: Path) -> None:
    wide = _wide_code_lines(page.read_text(encoding="utf-8"))
    assert not wide, f"{len(wide)} code lines over {CODE_WIDTH} characters, first: {wide[0]!r}"


def test_the_width_check_finds_a_wide_line_in_a_nested_block() -> None:
    fitting, wide = "x" * CODE_WIDTH, "y" * (CODE_WIDTH + 1)
    nested = f"- item\n\n    ```bash\n    {fitting}\n    {wide}\n    ```\n"
    assert _wide_code_lines(nested) == ["    " + wide]


def test_no_link_out_of_the_repository() -> None:
    linked = [str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")
              if re.search(r"\]\((\.\./)*\.\./shared", p.read_text(encoding="utf-8"))]
    assert linked == []
