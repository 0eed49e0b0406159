"""The site's benchmark summary (benchmarks/index.md), made at build time from BENCHMARKS.md.

BENCHMARKS.md, at the repository root, is the one table of every benchmark's claim and result.
This mkdocs hook puts its text in place of the site page's body, its links moved from the
repository root to the page's folder, so the two cannot disagree on a row.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

PAGE = "benchmarks/index.md"
SOURCE = Path(__file__).resolve().parents[2] / "BENCHMARKS.md"
_DOCS_LINK = re.compile(r"\]\(docs/([^)]*)\)")


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    """The summary page's body is BENCHMARKS.md; every other page passes unchanged."""
    if page.file.src_uri != PAGE:
        return markdown
    return site_summary(SOURCE.read_text(encoding="utf-8"))


def site_summary(benchmarks: str) -> str:
    """BENCHMARKS.md's text with its links into docs/ made relative to docs/benchmarks/."""
    return _DOCS_LINK.sub(lambda m: f"]({_from_benchmarks(m.group(1))})", benchmarks)


def _from_benchmarks(target: str) -> str:
    """A docs/-relative link target as seen from a page in docs/benchmarks/."""
    if target.startswith("benchmarks/"):
        return target.removeprefix("benchmarks/")
    return f"../{target}"
