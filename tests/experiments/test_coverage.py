"""`tomerge backbones`: the coverage table of the installed diffusers' model classes.

The committed page docs/backbones/coverage.md is what the command prints (for the diffusers it names), and every
class it lists as merged is still merged, by the same backbone, with at least its strategies. The strategies
column is checked against ``tomerge.apply`` itself: every merged class is built on the meta device from its
default config (no weights are allocated) and each registered strategy, caching schedule and a sample of the
compositions is applied; it attaches exactly when the table lists it, else raises the reason the table gives, and the
blocks the adapter finds are the block kinds and sublayers the table shows. A few classes' listings are written out by
hand, `wan_vace`'s refused caching included.
"""

from __future__ import annotations

import inspect
import json
import re
from importlib.metadata import entry_points

import pytest
import torch

import tomerge
from tomerge.experiments import cli
from tomerge.registry import backbone_class
from tomerge.experiments.sources.coverage import (NOT_DECLARED, NOT_MERGED, PAGE, REGENERATE, composition, coverage,
                                                 default_ratio, markdown, model_classes, refused_groups)
from helpers import ROOT



def builtin(group: str) -> list[str]:
    """The names tomerge itself registers (the page is made without plugins; tests may register more)."""
    return sorted({ep.name for ep in entry_points(group=group) if getattr(ep.dist, "name", None) == "tomerge"})


@pytest.fixture(scope="module")
def table():
    return coverage(builtin("tomerge.backbones"), builtin("tomerge.strategies"))


@pytest.fixture(scope="module")
def page() -> str:
    return (ROOT / PAGE).read_text()


def page_version(page: str) -> str:
    return re.search(r"model classes of diffusers (\S+) tomerge merges", page).group(1)


def page_merged(page: str) -> dict[str, tuple[str, set[str]]]:
    """class -> (backbone, strategies) of the page's "Merged" table."""
    section = page.split("## Merged\n", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 9 and cells[0].startswith("`"):
            rows[cells[0].strip("`")] = (cells[1].strip("`"), set(cells[3].split(", ")) - {""})
    return rows


def test_the_page_is_what_the_command_prints(table, page):
    import diffusers

    if page_version(page) != diffusers.__version__:
        pytest.skip(f"{PAGE} is made with diffusers {page_version(page)}, {diffusers.__version__} is installed: "
                    f"regenerate it with `{REGENERATE}`")
    assert page == markdown(table), f"{PAGE} is out of date: regenerate it with `{REGENERATE}`"


def test_every_class_merged_on_the_page_is_still_merged_with_its_strategies(table, page):
    merged = page_merged(page)
    assert len(merged) == int(re.search(r"(\d+) of \d+ classes are merged", page).group(1)) >= 12
    now = {row.model_class: row for row in table.rows}
    for name, (backbone, strategies) in merged.items():
        assert name in now, f"{name} is no model class of the installed diffusers"
        assert now[name].backbone == backbone, f"{name}: merged by {backbone!r} on the page, now {now[name].backbone!r}"
        lost = strategies - set(now[name].strategies)
        assert not lost, f"{name} ({backbone}): {sorted(lost)} no longer run"


def test_the_rows_are_the_diffusers_model_classes_and_the_unet(table):
    import diffusers
    import diffusers.models.transformers as transformers
    from diffusers.models.modeling_utils import ModelMixin

    exported = {name for name, value in inspect.getmembers(transformers, inspect.isclass) if issubclass(value, ModelMixin)}
    assert [row.model_class for row in table.rows] == sorted(exported | {"UNet2DConditionModel"})
    assert "DualTransformer2DModel" not in exported  # an nn.Module only, part of Versatile Diffusion's UNet
    assert table.diffusers_version == diffusers.__version__
    for row in table.rows:
        assert (row.backbone is None) == (row.reason is not None), row
        if row.backbone is None:
            assert row.reason == NOT_MERGED.get(row.model_class, NOT_DECLARED) and row.strategies == ()
    # every reason is for a class of this diffusers that no adapter merges (a stale reason would hide nothing)
    assert set(NOT_MERGED) <= exported and not {row.model_class for row in table.merged} & set(NOT_MERGED)
    assert ("native_dit", "not a diffusers model class") in table.other_backbones


@pytest.mark.parametrize("backbone", [name for name in builtin("tomerge.backbones") if backbone_class(name).model_class])
def test_strategies_listed_are_exactly_those_apply_attaches(table, backbone):
    """On a meta-device model of the backbone's class (its default config: the released size, no memory): every
    strategy listed attaches and detaches, every other one raises NotImplementedError (no received-attention probe
    in some block kind); the blocks found are the table's kinds with their sublayers."""
    row = next(row for row in table.merged if row.backbone == backbone)
    try:
        with torch.device("meta"):
            model = model_classes()[row.model_class]()
    except (TypeError, ValueError) as err:
        pytest.skip(f"{row.model_class} does not build from its default config ({err}); its family tests build it")
    refused = dict(row.refused)
    # every strategy and caching schedule; the compositions of each caching schedule with its first and last strategy
    compositions = {c: dict(merge=m, ratio=default_ratio(m)) for c in table.caching for m in table.strategies[::10]
                    if composition(c, m) in table.compositions}
    cells = [*((name, dict(ratio=default_ratio(name))) for name in (*table.strategies, *table.caching)),
             *((composition(c, options["merge"]), options) for c, options in compositions.items())]
    for cell, options in cells:
        name = cell.split("(", 1)[0]
        if cell in (*row.strategies, *row.caching, *row.compositions):
            handle = tomerge.apply(model, name, **options)
            kinds: dict[str, tuple[str, ...]] = {}
            for block in handle._blocks:
                kinds.setdefault(block.kind, tuple(dict.fromkeys(p.sublayer for p in block.points)))
            assert kinds == {k.kind: k.sublayers for k in row.kinds}, cell
            handle.remove()
        else:
            with pytest.raises(NotImplementedError, match=re.escape(refused[cell])):
                tomerge.apply(model, name, **options)
        assert "_tomerge_handle" not in model.__dict__, cell


#: ``wan_vace``'s reason for the schedules that skip whole blocks, written out.
VACE_REFUSED = ("backbone 'wan_vace' cannot skip its 'vace' blocks: they return a new hint beside the control tokens, "
                "not the new value of an input, so a skipped call has no residual to add")
STEP_LEVEL = ["block_cache", "first_block_cache", "fora", "taylorseer"]
MERGING = ["cached_detail", "facility_location", "fresh_tokens", "idm", "sdtm", "sdtm_paper", "sdtm_release", "ssm",
           "toma", "toma_release", "tomesd"]


def test_the_listing_of_a_few_classes_is_what_apply_runs_and_refuses(table, capsys):
    rows = {row.model_class: row for row in table.merged}
    assert table.caching == ("block_cache", "first_block_cache", "fora", "taylorseer", "toca")
    assert list(table.strategies) == MERGING
    every_composition = tuple(f"{c}(merge={m})" for c in STEP_LEVEL for m in MERGING)
    assert table.compositions == every_composition  # toca takes no merge=
    for name in ("DiTTransformer2DModel", "FluxTransformer2DModel", "WanTransformer3DModel"):
        row = rows[name]
        assert (list(row.strategies), row.caching, row.compositions, row.refused) == \
            (MERGING, table.caching, every_composition, ()), name
    vace = rows["WanVACETransformer3DModel"]
    assert (list(vace.strategies), vace.caching, vace.compositions) == (MERGING, ("toca",), ())
    assert vace.refused == (*((c, VACE_REFUSED) for c in STEP_LEVEL), *((c, VACE_REFUSED) for c in every_composition))
    assert refused_groups(vace) == [(", ".join(STEP_LEVEL + [f"{c}(merge=*)" for c in STEP_LEVEL]), VACE_REFUSED)]
    # the JSON and the text line say the same
    assert cli.main(["backbones", "--json"]) == 0
    objects = {o["class"]: o for o in map(json.loads, capsys.readouterr().out.splitlines())}
    assert objects["WanVACETransformer3DModel"]["caching"] == ["toca"]
    assert objects["WanVACETransformer3DModel"]["refused"]["fora(merge=tomesd)"] == VACE_REFUSED
    built_in = [c for c in objects["DiTTransformer2DModel"]["compositions"]  # plugins other tests registered: left out
                if c.split("(merge=")[1].rstrip(")") in MERGING]
    assert built_in == list(every_composition)
    assert objects["DiTTransformer2DModel"]["refused"] == {}
    assert cli.main(["backbones"]) == 0
    lines = capsys.readouterr().out.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("WanVACETransformer3DModel "))
    assert "strategies: all  caching: toca  compositions: none" in lines[at]
    assert lines[at + 1] == (f"    refused block_cache, first_block_cache, fora, taylorseer, block_cache(merge=*), "
                             f"first_block_cache(merge=*), fora(merge=*), taylorseer(merge=*): {VACE_REFUSED}")


def test_a_class_without_a_probe_refuses_what_needs_received_attention_with_the_reason(monkeypatch):
    """PixArt with its probe taken away: the strategies, caching schedule and compositions that need received
    attention are refused, each with the reason apply gives."""
    adapter = backbone_class("pixart")
    monkeypatch.setattr(adapter, "probed_kinds", classmethod(lambda cls: frozenset()))
    row = next(row for row in coverage(["pixart"], builtin("tomerge.strategies")).merged)
    needs = ["fresh_tokens", "idm", "sdtm", "sdtm_paper"]  # sdtm_release: idm(variant="streak"), no attention
    reason = ("backbone 'pixart' cannot record received attention in its 'ada_norm_single' blocks (no probe is declared for "
              "their attention: docs/backbones/adding-a-family.md)")
    assert list(row.strategies) == [m for m in MERGING if m not in needs]
    assert row.caching == ("block_cache", "first_block_cache", "fora", "taylorseer")
    assert row.compositions == tuple(f"{c}(merge={m})" for c in STEP_LEVEL for m in MERGING if m not in needs)
    assert row.refused == (*((m, reason) for m in needs), ("toca", reason),
                           *((f"{c}(merge={m})", reason) for c in STEP_LEVEL for m in needs))
    assert refused_groups(row) == [(", ".join([*needs, "toca", *(f"{c}(merge={m})" for c in STEP_LEVEL for m in needs)]),
                                    reason)]


def test_the_command_prints_a_line_json_or_the_page(capsys, table):
    assert cli.main(["backbones"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"{len(table.merged)} of {len(table.rows)} model classes of diffusers "
                               f"{table.diffusers_version} are merged by tomerge")
    wan = next(line for line in lines if line.startswith("WanTransformer3DModel "))
    assert wan.split()[1:3] == ["wan", "3-D"] and "RoPE wan; cross-attention" in wan
    assert cli.main(["backbones", "--json"]) == 0
    objects = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [o["class"] for o in objects] == [row.model_class for row in table.rows]
    for o in objects:
        assert {"class", "backbone", "strategies", "reason", "diffusers"} <= set(o)
        assert o["diffusers"] == table.diffusers_version and (o["backbone"] is None) == (o["reason"] is not None)
    flux = next(o for o in objects if o["class"] == "FluxTransformer2DModel")
    assert flux["backbone"] == "flux" and flux["grid_dims"] == 2 and "tomesd" in flux["strategies"]
    assert [k["kind"] for k in flux["kinds"]] == ["double", "single"] and all(k["probe"] for k in flux["kinds"])
    assert cli.main(["backbones", "--markdown"]) == 0
    assert capsys.readouterr().out.startswith("# Backbone coverage\n")
