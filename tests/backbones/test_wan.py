"""What the `wan` adapter (backbones/wan.py, Wan 2.1 / 2.2) does beyond the family contract: odd latent sizes floored
like the patch embedding, Wan 2.2 TI2V's per-token timesteps, and a WanPipeline loaded from a local folder. The checks
every declared family passes are in test_family_contract.py; these are the family's own.
"""

from __future__ import annotations

import pytest
import torch

import tomerge
from helpers import seeded
from helpers.family import run
from helpers.local_pipelines import generate, load_tiny_pipeline
from helpers.video_families import wan_inputs


def test_wan_odd_latent_sizes_floor_like_the_patch_embedding(models):
    model = models["wan"]
    inputs = wan_inputs(model, grid=(2, 4, 4))
    inputs["hidden_states"] = torch.randn(2, 16, 2, 9, 11, generator=seeded(2))  # 9 x 11 latent -> 4 x 5 patches
    with tomerge.merging(model, "tomesd", ratio=0.5, use_rand=False) as handle:
        out = run(model, inputs)
        assert handle.adapter.grid_size == (2, 4, 5) and handle.stats["tokens_removed"] > 0
    assert out.shape == (2, 16, 2, 8, 10) and torch.isfinite(out).all()


def test_wan_per_token_timesteps_give_the_step_by_their_largest_value(models):
    """Wan 2.2 TI2V passes a timestep per token ([B, N]; 0 on the conditioning frame)."""
    model = models["wan"]
    with tomerge.merging(model, "tomesd", ratio=0.5, num_steps=3) as handle:
        for t in (999.0, 500.0):
            inputs = wan_inputs(model)
            timestep = torch.full((2, 32), t)
            timestep[:, :16] = 0.0  # first frame: the conditioning image
            adapter_t = handle.adapter.call_timestep((), dict(inputs, timestep=timestep))
            assert adapter_t.tolist() == [t, t]
            handle.state.begin_model_call(adapter_t)
        assert handle.state.clock.step == 1


@pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning")
def test_wan_pipeline_loaded_from_a_local_folder_merges_and_is_restored(monkeypatch):
    """WanPipeline (UMT5, Wan VAE, flow-matching Euler) saved and loaded offline: 9 frames of 64 x 64 are a
    3 x 4 x 4 token grid; the pipeline calls the transformer twice per step (conditional, unconditional), and
    both calls share the scheduler's step; the video changes and is bit-identical again afterwards."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    pipe = load_tiny_pipeline("wan")
    assert type(pipe).__name__ == "WanPipeline"
    before = generate(pipe, "wan")
    with tomerge.merging(pipe, "tomesd", ratio=0.5, use_rand=False, merge_mlp=True) as handle:
        merged = generate(pipe, "wan")
        assert handle.model is pipe.transformer and handle.adapter.name == "wan"
        assert handle.adapter.grid_size == (3, 4, 4)
        assert [r.step for r in handle.state.records] == [0] * 4 + [1] * 4 and handle.state.clock.num_steps == 2
        assert all(r.num_tokens == 48 and r.num_removed == 24 for r in handle.state.records)
    assert merged.shape == before.shape == (2, 9, 3, 64, 64) and torch.isfinite(merged).all()
    assert not torch.equal(merged, before)
    assert torch.equal(generate(pipe, "wan"), before)
