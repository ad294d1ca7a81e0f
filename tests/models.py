"""Tiny random-weight models built from configs (no download), shared by the tests."""

from __future__ import annotations

import torch


def tiny_unet(seed: int = 0, cross_attention_dim: int = 32):
    """A 2-level SD-style UNet2DConditionModel with transformer blocks at full and 1/2 resolution."""
    from diffusers import UNet2DConditionModel

    torch.manual_seed(seed)
    unet = UNet2DConditionModel(
        sample_size=16, in_channels=4, out_channels=4, layers_per_block=1,
        block_out_channels=(32, 64), norm_num_groups=8,
        down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
        mid_block_type="UNetMidBlock2DCrossAttn",
        cross_attention_dim=cross_attention_dim, attention_head_dim=8,
    )
    return unet.eval()


def unet_inputs(batch: int = 2, size: tuple[int, int] = (16, 16), seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    sample = torch.randn(batch, 4, *size, generator=g)
    text = torch.randn(batch, 7, 32, generator=g)
    return sample, torch.tensor(500), text
