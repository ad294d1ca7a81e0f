"""What the `flux2` adapter (backbones/flux2.py, FLUX.2) does beyond the family contract: a single block's parallel
attention and MLP merged once (``to_out`` inside the attention), the MLP merged alone, timesteps in [0, 1], and a
declared point refusing an attention mask it cannot merge. The checks every declared family passes are in
test_family_contract.py; these are the family's own.
"""

from __future__ import annotations

import pytest
import torch

import tomerge
from tomerge.backbones._declared import DeclaredPoint
from helpers.family import ALL_SUBLAYERS, run, run_hooked
from helpers.image_families import flux2_inputs


def test_flux2_single_block_runs_its_parallel_attention_and_mlp_merged(models):
    """With attention and MLP merged, a FLUX.2 single block runs its whole parallel attention + MLP merged
    (``to_out`` is called inside the attention, on text + merged image tokens) and unmerges once, after
    ``to_out`` (the permutation test checks that this is exact)."""
    model = models["flux2"]
    inputs = flux2_inputs(model, seed=7)
    seen: list[int] = []
    with tomerge.merging(model, "tomesd", ratio=0.5, use_rand=False, **ALL_SUBLAYERS):
        block = model.single_transformer_blocks[0]
        hooks = [block.attn.to_out.register_forward_pre_hook(lambda m, args: seen.append(args[0].shape[1])),
                 block.register_forward_hook(lambda m, args, kwargs, out: seen.append(out.shape[1]), with_kwargs=True)]
        out = run_hooked(model, inputs, hooks)
    assert torch.isfinite(out).all()
    assert seen == [8 + 32, 8 + 64]  # to_out on text + merged image tokens; the block returns the full sequence


def test_flux2_mlp_only_merges_to_out_and_leaves_the_attention_at_full_length(models):
    model = models["flux2"]
    inputs = flux2_inputs(model, seed=8)
    seen: list[int] = []
    with tomerge.merging(model, "tomesd", ratio=0.5, use_rand=False, merge_attn=False, merge_mlp=True):
        hooks = [m.register_forward_pre_hook(lambda m, args, kwargs: seen.append(  # after tomerge's hooks
            (kwargs.get("hidden_states", args[0] if args else None)).shape[1]), with_kwargs=True)
            for m in (model.single_transformer_blocks[0].attn, model.transformer_blocks[0].ff)]
        hooks.append(model.single_transformer_blocks[0].attn.to_out.register_forward_pre_hook(
            lambda m, args: seen.append(args[0].shape[1])))
        out = run_hooked(model, inputs, hooks)
    assert torch.isfinite(out).all()
    assert seen == [32, 8 + 64, 8 + 32]  # double ff merged; single attn full length; to_out merged


def test_flux2_timestep_in_the_unit_interval_gives_progress(models):
    model = models["flux2"]
    with tomerge.merging(model, "tomesd", ratio=0.5) as handle:
        run(model, flux2_inputs(model, grid=(4, 4)))
        inputs = flux2_inputs(model, grid=(4, 4))
        inputs["timestep"] = torch.full((2,), 0.25)
        run(model, inputs)
        assert handle.state.clock.step == 1 and handle.state.clock.progress == pytest.approx(0.75)


def test_a_declared_point_refuses_a_mask_it_cannot_merge(models):
    model = models["flux2"]
    inputs = flux2_inputs(model, grid=(4, 4))
    inputs["joint_attention_kwargs"] = {"attention_mask": torch.ones(2, 1, 1, 8 + 16, dtype=torch.bool)}
    with tomerge.merging(model, "tomesd", ratio=0.5):
        with pytest.raises(ValueError, match="attention mask"):
            run(model, inputs)
    assert isinstance(DeclaredPoint, type)
