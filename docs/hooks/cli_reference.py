"""The manual's CLI reference (reference/cli.md), rendered from the ``cascade`` argument parser.

A mkdocs hook: at build time it renders every subcommand's usage, description, options and
examples from ``distill.cli.build_parser()``, the parser ``cascade --help`` prints from, so the
page cannot drift from the command line. ``render_cli_reference`` is separate from the hook so
that a test can check, without mkdocs, that the page names every subcommand and every flag.
"""

from __future__ import annotations

import argparse
import html
import re
from collections.abc import Callable
from typing import Any

PAGE = "reference/cli.md"
WIDTH = 80  # the widest code line the theme's content column shows uncut (docs/install.md: measured)
_MARKDOWN_SPECIAL = re.compile(r"([\\`*_\[\]])")
_WORD = re.compile(r"""(?:'[^']*'|"[^"]*"|\S)+""")  # a quoted string is one word


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    """Append the generated reference to the CLI page; every other page passes unchanged."""
    if page.file.src_uri != PAGE:
        return markdown
    from distill.cli import build_parser  # imported at build time: the parser as it is now

    return markdown + render_cli_reference(build_parser())


def render_cli_reference(parser: argparse.ArgumentParser) -> str:
    """Markdown for every subcommand of ``parser``, in the order ``--help`` lists them."""
    subcommands = _subcommands(parser)
    summaries = {choice.dest: choice.help or "" for choice in subcommands._choices_actions}
    sections = [_render_subcommand(name, sub, summaries.get(name, ""))
                for name, sub in subcommands.choices.items()]
    return "\n".join(sections)


def _subcommands(parser: argparse.ArgumentParser) -> argparse._SubParsersAction:
    """The parser's subcommand action: the reference is one section per subcommand."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action
    raise ValueError(f"{parser.prog} has no subcommands to document")


def _render_subcommand(name: str, sub: argparse.ArgumentParser, summary: str) -> str:
    """One subcommand: its one-line summary, usage, description, options by group, examples."""
    parts = [f"## `{sub.prog}`", "", _prose(summary), "", _fence(_usage(sub)), ""]
    parts += [_render_text(sub.description or ""), ""]
    formatter = _formatter(sub)
    for group in sub._action_groups:
        shown = [a for a in group._group_actions if a.help != argparse.SUPPRESS]
        if shown:
            parts += [f"**{_prose(group.title or '')}**", ""]
            parts += [_render_action(formatter, a) for a in shown] + [""]
    parts += _render_old_spellings(sub)
    if sub.epilog:
        parts += [_render_text(sub.epilog), ""]
    return "\n".join(parts)


def _usage(sub: argparse.ArgumentParser) -> str:
    """The usage lines ``--help`` prints, wrapped to the page's width."""
    formatter = _formatter(sub)
    formatter.add_usage(sub.usage, sub._actions, sub._mutually_exclusive_groups)
    return formatter.format_help().rstrip()


def _formatter(sub: argparse.ArgumentParser) -> argparse.HelpFormatter:
    """The subcommand's own formatter class (as ``--help`` uses), at the page's width."""
    make: Callable[..., argparse.HelpFormatter] = sub.formatter_class
    return make(prog=sub.prog, width=WIDTH)


def _render_action(formatter: argparse.HelpFormatter, action: argparse.Action) -> str:
    """One list item: each spelling with its argument, then the help with its defaults filled."""
    spellings = ", ".join(f"`{s}`" for s in _invocations(formatter, action))
    text = _prose(formatter._expand_help(action)) if action.help else ""
    return f"- {spellings}: {text}" if text else f"- {spellings}"


def _invocations(formatter: argparse.HelpFormatter, action: argparse.Action) -> list[str]:
    """``--flag ARG`` for each option string (or the positional's name), as ``--help`` writes it."""
    if not action.option_strings:
        return [formatter._get_default_metavar_for_positional(action)]
    if action.nargs == 0:
        return list(action.option_strings)
    metavar = formatter._get_default_metavar_for_optional(action)
    args = formatter._format_args(action, metavar)
    return [f"{s} {args}" for s in action.option_strings]


def _render_old_spellings(sub: argparse.ArgumentParser) -> list[str]:
    """Flags hidden from ``--help`` (old spellings kept for one release), named with their new one."""
    hidden = [a for a in sub._actions if a.option_strings and a.help == argparse.SUPPRESS]
    if not hidden:
        return []
    lines = ["**Old spellings** (still taken for one release, with a warning; not shown by "
             "`--help`)", ""]
    for action in hidden:
        old = ", ".join(f"`{s}`" for s in action.option_strings)
        new = getattr(action, "new", None)
        lines.append(f"- {old}: use `{new}`" if new else f"- {old}")
    return [*lines, ""]


def _render_text(text: str) -> str:
    """A raw description or epilog: its laid-out blocks (lists, examples) kept as they are in a
    text block, its plain paragraphs as prose."""
    blocks = []
    for paragraph in re.split(r"\n\s*\n", text.strip()):
        laid_out = paragraph.lower().startswith("example") or any(
            line.startswith(" ") for line in paragraph.splitlines())
        blocks.append(_fence(paragraph) if laid_out else _prose(paragraph))
    return "\n\n".join(blocks)


def _prose(text: str) -> str:
    """Help text as one markdown paragraph, every character shown as typed."""
    joined = " ".join(text.split())
    return _MARKDOWN_SPECIAL.sub(r"\\\1", html.escape(joined, quote=False))


def _fence(text: str) -> str:
    """A text code block, as a terminal shows it, each line cut to the page's width."""
    shell = text.lstrip().lower().startswith("example")
    lines = [piece for line in text.rstrip().splitlines() for piece in _fit(line, shell)]
    return "```text\n" + "\n".join(lines) + "\n```"


def _fit(line: str, shell: bool) -> list[str]:
    """``line`` broken between words (a quoted string is one word) into lines of at most WIDTH,
    each continuation indented 4 more. In an example each break ends with `` \\`` so that the
    command still runs when copied, and a comment goes on as a comment."""
    if len(line) <= WIDTH:
        return [line]
    indent = " " * (len(line) - len(line.lstrip()))
    pieces: list[str] = []
    current, in_comment = indent, False
    for word in _WORD.findall(line):
        suffix = " \\" if shell and not in_comment else ""
        if current.strip() and len(current) + 1 + len(word) + len(suffix) > WIDTH:
            pieces.append(current + suffix)
            current = indent + ("    # " if shell and in_comment else "    ") + word
        else:
            current = f"{current} {word}" if current.strip() else current + word
        in_comment = in_comment or (shell and word.startswith("#"))
    return [*pieces, current]
