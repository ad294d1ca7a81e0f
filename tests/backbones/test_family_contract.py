"""The family contract: the checks every declared adapter passes, run over every row of ``helpers.families.FAMILIES``
(a random-weight diffusers model of each family, built from its release's configuration, reduced; the builders are
in ``helpers.image_families`` and ``helpers.video_families``), and the registry's backbones against those rows.

Per row: the adapter finds the transformer and its blocks in order; ratio 0 and ``remove()`` are bit-identical to
the unpatched model; ratio 0.5 is finite, of the right shape, and merges every block on the row's grid; the blocks
at ratio 0.5 cost what the unpatched blocks cost on half the tokens; a permutation "merge" (slots = all tokens,
reordered per sample) gives the unpatched output, which holds only if every slot carries its token's rotary position
(and, as a control, a permutation without the RoPE gather does not); a batch equals its samples alone (float64);
grids with leftover rows (and frames) merge; merging runs under ``torch.inference_mode``. What only one family does is
in the file named after its adapter module (test_<module>.py); every strategy and schedule on every backbone is in
test_every_strategy_on_every_backbone.py, the received-attention probes in test_probes.py.

Adding a family: its builder, inputs and Family row in ``helpers/image_families.py`` or ``helpers/video_families.py``
(the contract then runs on it), and its own quirks in tests/backbones/test_<module>.py.
"""

from __future__ import annotations

import ast
import math
import types
from pathlib import Path

import pytest
import torch

import tomerge
from tomerge.backbones._declared import DeclaredAdapter
from tomerge.registry import backbone_class
from helpers.families import BACKBONE_ROWS, FAMILIES
from helpers.family import (ALL_SUBLAYERS, Permute, check_batch_as_close_as_unpatched, check_batch_equals_samples,
                            check_bit_identical, check_flops, check_inference_mode, check_odd_grid_merges,
                            check_permutation_is_exact, run, without_rope)

# Mochi's RoPE runs under torch.autocast(float32), which diffusers calls on the CPU too.
pytestmark = pytest.mark.filterwarnings("ignore:In CPU autocast, but the target dtype is not supported")

#: The registered adapters written by hand (not declared), and the test files (in this folder) named after them.
HAND_WRITTEN = {"unet": ("test_unet.py",), "native_dit": ("test_native_dit.py",), "flux": ("test_flux.py",),
                "sd3": ("test_sd3_pixart_dit.py",), "pixart": ("test_sd3_pixart_dit.py",),
                "dit": ("test_sd3_pixart_dit.py",)}
#: A strategy's options in the ratio-0 check (tomesd without randomness: deterministic and per sample), and in the
#: ratio-0.5 check, where they make it merge every block on the rows' grids (8 x 8 tokens and less).
OPTIONS = {"tomesd": {"use_rand": False}, "facility_location": {"num_tiles": 4}}
HALF_OPTIONS = {**OPTIONS, "ssm": {"round_windows": 1}}
#: Adapters whose token grid may have more axes than their rows' grids: HunyuanImage 2.1's refiner latents have frames.
GRID_DIMS = {"hunyuan_image": 3}


def rows_with(strategies: str) -> list:
    """``(row, strategy)`` for every row and each strategy of its ``strategies`` field, with readable ids."""
    return [pytest.param(name, strategy, id=f"{name}-{strategy}")
            for name, family in FAMILIES.items() for strategy in getattr(family, strategies)]


# ---------------------------------------------------------------------- the registry
def test_every_declared_backbone_has_a_row_named_after_it_and_the_others_their_own_test_file():
    declared = {name for name in tomerge.list_backbones() if issubclass(backbone_class(name), DeclaredAdapter)}
    assert {family.backbone for family in FAMILIES.values()} == declared
    assert sorted(BACKBONE_ROWS) == sorted(declared)
    assert sorted(set(tomerge.list_backbones()) - declared) == sorted(HAND_WRITTEN)
    here = Path(__file__).parent
    for name, files in HAND_WRITTEN.items():
        for file in files:  # the file exists and its docstring names the adapter
            assert f"`{name}`" in ast.get_docstring(ast.parse((here / file).read_text())), (name, file)


# ---------------------------------------------------------------------- every row
@pytest.mark.parametrize("name", FAMILIES)
def test_finds_the_transformer_and_its_blocks_in_order(models, name):
    family, model = FAMILIES[name], models[name]
    with tomerge.merging(types.SimpleNamespace(transformer=model), "tomesd", ratio=0.5) as handle:
        assert handle.model is model and handle.adapter.name == family.backbone
        assert isinstance(handle.adapter, DeclaredAdapter)
        # (H, W); (T, H, W); Latte: one frame's (H, W)
        assert handle.adapter.grid_dims == GRID_DIMS.get(family.backbone, len(family.grid))
        specs = handle.adapter.blocks()
        assert [s.kind for s in specs] == list(family.kinds)
        assert [s.module for s in specs] == [b for c in family.containers for b in model.get_submodule(c)]
        assert [s.layer for s in specs] == list(range(len(specs)))


@pytest.mark.parametrize("name, strategy", rows_with("strategies"))
def test_ratio_zero_and_remove_are_bit_identical(models, name, strategy):
    model = models[name]
    check_bit_identical(model, FAMILIES[name].inputs(model), strategy, **OPTIONS.get(strategy, {}))


@pytest.mark.parametrize("name, strategy", rows_with("half_strategies"))
def test_half_ratio_is_finite_of_the_right_shape_and_merges_every_block(models, name, strategy):
    family, model = FAMILIES[name], models[name]
    inputs = family.inputs(model)
    before = run(model, inputs)
    with tomerge.merging(model, strategy, ratio=0.5, **HALF_OPTIONS.get(strategy, {}), **ALL_SUBLAYERS) as handle:
        out = run(model, inputs)
        assert handle.adapter.grid_size == family.grid
        records = handle.state.records
    assert out.shape == before.shape and torch.isfinite(out).all()
    assert [r.block_kind for r in records] == list(family.kinds)
    assert all(r.num_tokens == math.prod(family.grid) and r.num_removed > 0 for r in records)


@pytest.mark.parametrize("name", FAMILIES)
def test_half_ratio_blocks_cost_what_half_the_tokens_cost(models, name):
    check_flops(models[name], FAMILIES[name], name)


@pytest.mark.parametrize("name", FAMILIES)
def test_permuted_slots_give_the_unpatched_output(models, name, monkeypatch):
    """Exact only if every slot carries its token's rotary position (and, with masks, its mask rows and columns), the
    text or context part of every joint sequence is kept in place, and, for SANA, the 1x1 convolutions' tokens are
    unmerged back onto the grid before the depthwise convolution; on the row's grid and on its grid with leftovers."""
    family, model = FAMILIES[name], models[name]
    for grid in (family.grid, family.odd):
        check_permutation_is_exact(model, family.inputs(model, grid=grid, seed=4), family.shuffle, math.prod(grid))
    if not family.rope:
        return
    # Control: without the RoPE gather the same permutation changes the output (positions matter here).
    inputs = family.inputs(model, seed=4)
    before = run(model, inputs)
    adapter = backbone_class(family.backbone)
    monkeypatch.setattr(adapter, "kinds", without_rope(adapter))
    with tomerge.merging(model, Permute(), ratio=0.5, **ALL_SUBLAYERS):
        assert (run(model, inputs) - before).abs().max() > 1e-3


@pytest.mark.tie_sensitive
@pytest.mark.parametrize("name", [name for name, family in FAMILIES.items()
                                  if family.batch in ("exact", "as_unpatched")])  # the others' rows say why not
def test_a_batch_equals_its_samples_alone(models, name):
    family, model = FAMILIES[name], models[name]
    inputs = family.inputs(model, seed=5)
    if family.batch == "exact":
        check_batch_equals_samples(model, inputs, family.select)
    else:
        check_batch_as_close_as_unpatched(model, inputs, family.select)


@pytest.mark.parametrize("name", FAMILIES)
def test_grids_with_leftover_rows_and_frames_merge(models, name):
    check_odd_grid_merges(models[name], FAMILIES[name])


@pytest.mark.parametrize("name", FAMILIES)
def test_merging_runs_under_inference_mode(models, name):
    """Inference tensors (``torch.inference_mode``, what benchmarks and pipelines use) have no version counter: the
    adapters must not read one. The result equals the ``no_grad`` one."""
    check_inference_mode(models[name], FAMILIES[name].inputs(models[name]))
