"""The `unet` adapter's default level (backbones/unet.py: the highest-resolution level with transformer blocks, as
tomesd merges on SD 1.5) on SD1.5- and SDXL-structured UNets: SDXL's real config on the meta device, a tiny UNet of
SDXL's structure and ``helpers.models.tiny_unet`` (SD 1.5's). The adapter on every strategy and in pipelines:
test_every_strategy_on_every_backbone.py, test_pipeline_sampling_loops.py; its feed-forward chunking:
test_sd3_pixart_dit.py; tomesd parity on it: tests/strategies/test_tomesd_parity.py.
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import tomerge
from tomerge.backbones.unet import UNetAdapter, block_levels
from helpers import no_hooks_left
from helpers.family import run
from helpers.models import SIZE, tiny_unet, unet_inputs


# ---------------------------------------------------------------------- the level merged by default
# SDXL's UNet config (stabilityai/stable-diffusion-xl-base-1.0, unet/config.json), the fields that set its
# structure: no attention at the first (full-resolution) level, 2 and 10 transformer layers below.
SDXL_CONFIG = dict(
    sample_size=128, in_channels=4, out_channels=4, layers_per_block=2, block_out_channels=(320, 640, 1280),
    down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
    up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
    transformer_layers_per_block=(1, 2, 10), attention_head_dim=(5, 10, 20), use_linear_projection=True,
    cross_attention_dim=2048, addition_embed_type="text_time", addition_time_embed_dim=256,
    projection_class_embeddings_input_dim=2816)


def tiny_sdxl_unet(seed: int = 0) -> nn.Module:
    """SDXL's structure (same block types, text_time conditioning, linear projections) with fewer channels and
    layers: level 1 (full resolution) has no attention, level 2 one transformer layer, level 4 two."""
    from diffusers import UNet2DConditionModel

    torch.manual_seed(seed)
    return UNet2DConditionModel(**{
        **SDXL_CONFIG, "sample_size": 16, "layers_per_block": 1, "block_out_channels": (16, 32, 64),
        "norm_num_groups": 8, "transformer_layers_per_block": (1, 1, 2), "attention_head_dim": (2, 4, 8),
        "cross_attention_dim": 32, "addition_time_embed_dim": 8, "projection_class_embeddings_input_dim": 16 + 6 * 8,
    }).eval()


def sdxl_inputs(batch: int = 2, size: tuple[int, int] = SIZE, seed: int = 1) -> dict:
    g = torch.Generator().manual_seed(seed)
    return dict(sample=torch.randn(batch, 4, *size, generator=g), timestep=torch.tensor(500),
                encoder_hidden_states=torch.randn(batch, 7, 32, generator=g),
                added_cond_kwargs={"text_embeds": torch.randn(batch, 16, generator=g),
                                   "time_ids": torch.tensor([[*SIZE, 0, 0, *SIZE]] * batch, dtype=torch.float32)})


def test_sdxl_real_config_defaults_to_level_2():
    from diffusers import UNet2DConditionModel

    with torch.device("meta"):  # the real 2.6B-parameter structure, no memory and no weights
        unet = UNet2DConditionModel(**SDXL_CONFIG)
    levels = sorted(block_levels(unet).values())
    # down: 2 x (2 transformer layers at 1/2, 10 at 1/4); mid: 10 at 1/4; up: 3 x (10 at 1/4, 2 at 1/2).
    assert levels == [2] * 10 + [4] * 60
    adapter = UNetAdapter(unet, UNetAdapter.Options())
    assert adapter.max_downsample == 2
    assert UNetAdapter(unet, UNetAdapter.Options(max_downsample=4)).max_downsample == 4


def test_sdxl_default_merges_the_half_resolution_blocks_and_logs_the_level(caplog):
    unet, inputs = tiny_sdxl_unet(), sdxl_inputs()
    levels = block_levels(unet)
    assert sorted(levels.values()) == [2] * 3 + [4] * 8  # 1/2: down 1 + up 2 x 1; 1/4: down 2 + mid 2 + up 2 x 2
    before = run(unet, inputs)
    with caplog.at_level(logging.INFO, logger="tomerge.backbones.unet"):
        handle = tomerge.apply(unet, "tomesd", ratio=0.5)
    assert handle.adapter.max_downsample == 2
    assert [r.getMessage() for r in caplog.records] == [
        "tomerge: unet max_downsample=None -> 2, the highest-resolution level with transformer blocks (3 of the 11 "
        "blocks of this UNet2DConditionModel); pass adapter={'max_downsample': ...} to change it"]
    merged = run(unet, inputs)
    records = [r for r in handle.state.records if r.num_removed > 0]
    handle.remove()
    half = (SIZE[0] // 2) * (SIZE[1] // 2)
    assert len(records) == 3 and all(r.num_tokens == half and r.num_removed == half // 2 for r in records)
    assert torch.isfinite(merged).all() and not torch.equal(merged, before)
    assert torch.equal(run(unet, inputs), before) and no_hooks_left(unet)


def test_sdxl_explicit_max_downsample_still_decides():
    unet, inputs = tiny_sdxl_unet(), sdxl_inputs()
    with tomerge.merging(unet, "tomesd", ratio=0.5, use_rand=False, adapter={"max_downsample": 1}) as handle:
        with pytest.warns(UserWarning, match="no block of this UNet2DConditionModel call was merged"):
            run(unet, inputs)
        assert handle.adapter.max_downsample == 1 and handle.stats["tokens_removed"] == 0
    with tomerge.merging(unet, "tomesd", ratio=0.5, use_rand=False, adapter={"max_downsample": 4}) as handle:
        run(unet, inputs)
        assert sorted({r.num_tokens for r in handle.state.records if r.num_removed}) == [16, 64]  # 1/4 and 1/2
    with pytest.raises(ValueError, match="1, 2, 4, 8 or None"):
        tomerge.apply(unet, "tomesd", ratio=0.5, use_rand=False, adapter={"max_downsample": 3})


def test_sd15_like_unet_defaults_to_level_1_as_tomesd():
    unet, inputs = tiny_unet(), unet_inputs()
    assert sorted(block_levels(unet).values()) == [1] * 3 + [2] * 4  # 1: down 1 + up 2; 1/2: down 1 + mid 1 + up 2
    outs = []
    for options in ({}, {"max_downsample": 1}):
        with tomerge.merging(unet, "tomesd", ratio=0.5, use_rand=False, adapter=options) as handle:
            with torch.no_grad():
                outs.append(unet(*inputs).sample)
            assert handle.adapter.max_downsample == 1
            assert {r.num_tokens for r in handle.state.records if r.num_removed} == {SIZE[0] * SIZE[1]}
    assert torch.equal(*outs)
