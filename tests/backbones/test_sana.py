"""What the `sana` adapter (backbones/sana.py, SANA) does beyond the family contract: the MLP's convolutions on merged
tokens (the depthwise one on the unmerged grid), ``t_max`` from the timestep scale, and a SanaPipeline loaded from a
local folder. The checks every declared family passes are in test_family_contract.py; these are the family's own.
"""

from __future__ import annotations

import pytest
import torch

import tomerge
from helpers.family import run
from helpers.image_families import sana_inputs
from helpers.local_pipelines import generate, load_tiny_pipeline


def test_sana_mlp_convolutions_run_on_merged_tokens(models):
    model = models["sana"]
    block = model.transformer_blocks[0]
    seen: dict[str, list] = {"inverted": [], "depth": [], "point": []}
    with tomerge.merging(model, "tomesd", ratio=0.5, use_rand=False, merge_attn=False, merge_mlp=True):
        hooks = [getattr(block.ff, f"conv_{k}").register_forward_pre_hook(  # after tomerge's hooks
            lambda m, args, k=k: seen[k].append(tuple(args[0].shape[2:]))) for k in seen]
        try:
            out = run(model, sana_inputs(model))
        finally:
            for h in hooks:
                h.remove()
    assert torch.isfinite(out).all()
    assert seen == {"inverted": [(32, 1)], "depth": [(8, 8)], "point": [(32, 1)]}


def test_sana_t_max_follows_timestep_scale():
    from diffusers import SanaTransformer2DModel

    from tomerge.backbones.sana import SanaAdapter

    model = SanaTransformer2DModel(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8,
                                   num_layers=1, num_cross_attention_heads=1, cross_attention_head_dim=16,
                                   cross_attention_dim=16, caption_channels=8, timestep_scale=0.5)
    assert SanaAdapter(model, None).t_max == 500.0


@pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning")
def test_sana_pipeline_loaded_from_a_local_folder_merges_and_is_restored(monkeypatch):
    """SanaPipeline (Gemma-2 text encoder, DC-AE, DPM-Solver flow) saved and loaded offline: ``merging(pipe)``
    patches its transformer, the scheduler gives the step (batched guidance: one call per step), the images
    change and are bit-identical again afterwards."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    pipe = load_tiny_pipeline("sana")
    assert type(pipe).__name__ == "SanaPipeline"
    before = generate(pipe, "sana")
    assert torch.equal(generate(pipe, "sana"), before)
    with tomerge.merging(pipe, "tomesd", ratio=0.5, use_rand=False) as handle:
        merged = generate(pipe, "sana")
        assert handle.model is pipe.transformer and handle.adapter.name == "sana"
        assert [r.step for r in handle.state.records] == [0, 0, 1, 1] and handle.state.clock.num_steps == 2
        assert all(r.num_tokens == 256 and r.num_removed == 128 for r in handle.state.records)
    assert merged.shape == before.shape == (2, 3, 32, 32) and torch.isfinite(merged).all()
    assert not torch.equal(merged, before)
    assert torch.equal(generate(pipe, "sana"), before)
