"""Tiny random-weight models of the hand-written adapters, built from configs (no download), and their inputs.

``unet`` (an SD-style UNet2DConditionModel), ``sd3``, ``pixart``, ``dit`` (diffusers transformers with a 16 x 16
token grid: ``make_inputs``), ``flux`` (FluxTransformer2DModel: ``flux_inputs``) and ``native_dit`` (the bundled
timm-style DiT). The declared adapters' models are Family rows (``helpers.families``).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


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


# ---------------------------------------------------------------------- sd3, pixart, dit
SIZE = (16, 16)  # latent; patch 1 -> a 16 x 16 token grid (256 tokens)


def tiny_sd3(seed: int = 0, dual: bool = True, qk_norm: str | None = "rms_norm") -> nn.Module:
    """SD3.5-Medium-like by default: dual attention in block 0, RMS q/k norms; the last block is context_pre_only."""
    from diffusers import SD3Transformer2DModel

    torch.manual_seed(seed)
    return SD3Transformer2DModel(
        sample_size=16, patch_size=1, in_channels=4, out_channels=4, num_layers=2, attention_head_dim=8,
        num_attention_heads=4, joint_attention_dim=24, caption_projection_dim=32, pooled_projection_dim=16,
        pos_embed_max_size=32, dual_attention_layers=(0,) if dual else (), qk_norm=qk_norm).eval()


def tiny_pixart(seed: int = 0) -> nn.Module:
    from diffusers import PixArtTransformer2DModel

    torch.manual_seed(seed)
    return PixArtTransformer2DModel(
        num_attention_heads=4, attention_head_dim=8, in_channels=4, out_channels=8, num_layers=2,
        cross_attention_dim=32, sample_size=16, patch_size=1, caption_channels=24).eval()


def tiny_dit(seed: int = 0) -> nn.Module:
    from diffusers import DiTTransformer2DModel

    torch.manual_seed(seed)
    return DiTTransformer2DModel(num_attention_heads=4, attention_head_dim=8, in_channels=4, num_layers=2,
                                 sample_size=16, patch_size=1, num_embeds_ada_norm=10).eval()


def make_inputs(backbone: str, batch: int = 2, size: tuple[int, int] = SIZE, seed: int = 1) -> dict:
    """Keyword inputs of one call of ``tiny_sd3``, ``tiny_pixart`` or ``tiny_dit``; samples differ, the timestep is
    shared (as in a pipeline)."""
    g = torch.Generator().manual_seed(seed)
    latent = torch.randn(batch, 4, *size, generator=g)
    t = torch.full((batch,), 500.0)
    if backbone == "sd3":
        return dict(hidden_states=latent, encoder_hidden_states=torch.randn(batch, 7, 24, generator=g),
                    pooled_projections=torch.randn(batch, 16, generator=g), timestep=t)
    if backbone == "pixart":
        return dict(hidden_states=latent, encoder_hidden_states=torch.randn(batch, 7, 24, generator=g),
                    timestep=t.long(), added_cond_kwargs={"resolution": None, "aspect_ratio": None})
    return dict(hidden_states=latent, timestep=t.long(), class_labels=torch.arange(batch) % 10)


# ---------------------------------------------------------------------- flux
def tiny_flux(seed: int = 0) -> nn.Module:
    """2 double + 2 single blocks, 2 heads of 16 (RoPE axes 4 + 6 + 6), width 32."""
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(seed)
    model = FluxTransformer2DModel(
        patch_size=1, in_channels=8, num_layers=2, num_single_layers=2, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=(4, 6, 6))
    return model.eval()


def image_ids(H: int, W: int) -> Tensor:
    """``[H*W, 3]`` ids ``(0, row, col)`` in raster order, as FluxPipeline._prepare_latent_image_ids builds them."""
    rows = torch.arange(H).repeat_interleave(W)  # [N]
    cols = torch.arange(W).repeat(H)  # [N]
    return torch.stack([torch.zeros(H * W), rows.float(), cols.float()], dim=1)


def flux_inputs(batch: int = 2, grid: tuple[int, int] = (8, 8), text: int = 7, t: float = 0.5, seed: int = 1,
                dtype: torch.dtype = torch.float32) -> dict:
    g = torch.Generator().manual_seed(seed)
    H, W = grid
    return dict(
        hidden_states=torch.randn(batch, H * W, 8, generator=g).to(dtype),  # [B, N, C_in] packed latent
        encoder_hidden_states=torch.randn(batch, text, 32, generator=g).to(dtype),  # [B, T, 32]
        pooled_projections=torch.randn(batch, 32, generator=g).to(dtype),
        timestep=torch.full((batch,), t, dtype=dtype),
        img_ids=image_ids(H, W), txt_ids=torch.zeros(text, 3),
    )


# ---------------------------------------------------------------------- native_dit
def tiny_native_dit() -> nn.Module:
    """The bundled DiT (tomerge.backbones.timm_dit) on an 8 x 8 grid of 1 channel, 2 blocks of width 32, with
    non-zero weights everywhere (the DiT init zeroes the adaLN and output layers)."""
    from tomerge.backbones.timm_dit import DiT, DiTConfig

    model = DiT(DiTConfig(input_size=8, patch_size=1, in_channels=1, hidden_size=32, depth=2, num_heads=2,
                          num_classes=10, learn_sigma=False))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return model.eval()


def native_dit_inputs(batch: int = 1) -> dict:
    g = torch.Generator().manual_seed(1)
    return dict(x=torch.randn(batch, 1, 8, 8, generator=g), t=torch.full((batch,), 0.5),
                y=torch.tensor([3] * batch))
