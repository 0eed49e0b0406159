"""The default demo's figures come from one file (docs/figures/demo.json, written by
``bench.demo_figures --run``): every page that shows them shows exactly what it renders."""

from __future__ import annotations

import pytest

from bench.demo_figures import PAGES, ROOT, blocks, load, render, rewrite


@pytest.mark.parametrize("page", sorted(PAGES))
def test_every_page_shows_the_demo_figures_the_file_holds(page: str) -> None:
    figures = load()
    found = blocks((ROOT / page).read_text(encoding="utf-8"))
    assert [kind for kind, _ in found] == [PAGES[page]], f"{page}: one {PAGES[page]} block of demo figures"
    [(kind, body)] = found
    assert body == render(kind, figures), (f"{page} shows other demo figures than docs/figures/demo.json: "
                                           "run `python -m bench.demo_figures --write`")


def test_a_changed_figure_changes_every_block_and_rewriting_is_stable() -> None:
    figures = load()
    other = figures.model_copy(update={"encoder_share": figures.encoder_share + 0.01})
    for kind in ("table", "run", "row"):
        assert render(kind, other) != render(kind, figures)
    page = (ROOT / "README.md").read_text(encoding="utf-8")
    assert rewrite(page, figures) == page
    assert f"{other.encoder_share:.1%}" in rewrite(page, other)
