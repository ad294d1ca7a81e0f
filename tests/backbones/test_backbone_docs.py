"""The family pages of docs/backbones agree with the adapters they describe.

Which classes are merged is said in one place: the generated docs/backbones/coverage.md
(``tests/experiments/test_coverage.py``) and, for the classes no adapter merges yet, the table "Families not covered" of
adding-a-family.md, checked here; a family page never says it. A family page's adapters, model classes, block classes
and merge-point tables (``| sublayer | module | ... |``) are those of the registered adapters it names (their
declarations, for the declared ones).
"""

from __future__ import annotations

import re
from importlib.metadata import entry_points

import pytest

from tomerge.backbones._declared import DeclaredAdapter
from helpers import ROOT

DOCS = ROOT / "docs" / "backbones"
FAMILY_PAGES = sorted(p.name for p in DOCS.glob("*.md") if p.name not in ("coverage.md", "adding-a-family.md"))


def registered() -> dict[str, type]:
    """Class name -> class of every registered backbone adapter."""
    classes = (ep.load() for ep in entry_points(group="tomerge.backbones"))
    return {cls.__name__: cls for cls in classes}


def names(text: str, pattern: str) -> set[str]:
    """The backticked identifiers of ``text`` matching ``pattern``."""
    return {name for name in re.findall(r"`(\w+)`", text) if re.fullmatch(pattern, name)}


def page_adapters(text: str) -> list[type]:
    adapters = registered()
    named = names(text, r"\w+Adapter")
    assert named and named <= set(adapters), f"adapters named that are not registered: {named - set(adapters)}"
    return [adapters[name] for name in sorted(named)]


def test_no_family_page_says_what_is_not_covered():
    for name in FAMILY_PAGES:
        text = (DOCS / name).read_text()
        assert "not covered" not in text, f"{name}: coverage.md and adding-a-family.md say what is not covered"


def test_the_families_not_covered_are_merged_by_no_adapter():
    section = (DOCS / "adding-a-family.md").read_text().split("## Families not covered\n", 1)[1].split("\n## ", 1)[0]
    classes = {re.search(r"\(`(\w+)`\)", line).group(1) for line in section.splitlines()
               if line.startswith("| ") and "(`" in line.split("|")[1]}
    merged = {cls.model_class for cls in registered().values()}
    assert classes and not classes & merged


@pytest.mark.parametrize("name", FAMILY_PAGES)
def test_a_family_page_names_its_adapters_models_and_blocks(name):
    """The opening paragraphs (before the first section) name registered adapters, the model classes those adapters
    merge and the block classes they find."""
    text = (DOCS / name).read_text()
    adapters = page_adapters(text)
    opening = text.split("\n## ", 1)[0]
    models = names(opening, r"[A-Z]\w*Model")
    assert models <= {cls.model_class for cls in adapters} | {"Transformer2DModel"}, name  # the UNet's stages
    blocks = names(opening, r"[A-Z]\w*Block")
    assert blocks <= {block for cls in adapters for block in cls.block_names}, name


def merge_point_rows(text: str) -> list[tuple[str | None, str, list[str]]]:
    """``(kind or None, sublayer, module paths)`` of every row of the page's ``| sublayer | module |`` tables."""
    rows, header = [], None
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else None
        if cells is None:
            header = None
        elif header is None:
            header = cells if "sublayer" in cells and "module" in cells else []
        elif header and not set(cells[0]) <= set("-"):
            row = dict(zip(header, cells))
            paths = [p for p in re.findall(r"`([\w.]+)`", row["module"]) if p[:1].islower()]
            rows.append((row.get("kind"), row["sublayer"].strip('`"'), paths))
    return rows


@pytest.mark.parametrize("name", FAMILY_PAGES)
def test_a_family_page_merge_points_are_the_declared_sites(name):
    text = (DOCS / name).read_text()
    declared = [cls for cls in page_adapters(text) if issubclass(cls, DeclaredAdapter)]
    if not declared:
        pytest.skip(f"{name}: a hand-written adapter (its tests check its merge points)")
    sites = {(kind.name, site.sublayer, site.path) for cls in declared for kind in cls.kinds for site in kind.sites}
    rows = merge_point_rows(text)
    assert rows, name
    for kind, sublayer, paths in rows:
        assert paths, (name, kind, sublayer)
        for path in paths:
            assert any(s[1:] == (sublayer, path) and kind in (None, s[0]) for s in sites), (name, kind, sublayer, path)
