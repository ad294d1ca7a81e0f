"""The image families under test: a builder and an input builder per declared image adapter, and their
:class:`~helpers.family.Family` rows (``IMAGE_FAMILIES``; every family: ``helpers.families.FAMILIES``).

Each model is a random-weight diffusers model built from its release's configuration with fewer heads and 1-2 blocks
of each kind (each builder's docstring says how it is reduced); ``<family>_inputs(model, batch, grid, seed, dtype,
text)`` gives one call's keyword inputs whose image tokens form ``grid``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from helpers import seeded
from helpers.family import Family, JointProbe, grid_ids, run, select, sharing, shuffle_tokens, text_mask


def randn(g: torch.Generator, dtype: torch.dtype, *shape: int) -> Tensor:
    return torch.randn(*shape, generator=g).to(dtype)


# ---------------------------------------------------------------------- FLUX.2, Qwen-Image, SANA


def build_flux2() -> nn.Module:
    """FLUX.2-dev's config (patch 1, 128 input channels, head dim 128, RoPE axes (32, 32, 32, 32), theta 2000,
    MLP ratio 3, text width 15360, guidance embedding) with 2 heads instead of 48, 1 double + 1 single block
    instead of 8 + 48."""
    from diffusers import Flux2Transformer2DModel

    torch.manual_seed(0)
    return Flux2Transformer2DModel(
        patch_size=1, in_channels=128, num_layers=1, num_single_layers=1, attention_head_dim=128,
        num_attention_heads=2, joint_attention_dim=15360, timestep_guidance_channels=256, mlp_ratio=3.0,
        axes_dims_rope=(32, 32, 32, 32), rope_theta=2000, guidance_embeds=True).eval()


def flux2_inputs(model: nn.Module, batch: int = 2, grid=(8, 8), seed: int = 1, dtype=torch.float32,
                 text: int = 8) -> dict:
    g = seeded(seed)
    H, W = grid
    return dict(
        hidden_states=torch.randn(batch, H * W, 128, generator=g).to(dtype),  # packed latent [B, N, 128]
        encoder_hidden_states=torch.randn(batch, text, 15360, generator=g).to(dtype),
        timestep=torch.full((batch,), 0.5, dtype=dtype), guidance=torch.full((batch,), 4.0, dtype=dtype),
        img_ids=grid_ids(1, H, W, 1)[None].expand(batch, -1, -1),  # (t, h, w, l) as Flux2Pipeline builds them
        txt_ids=grid_ids(1, 1, 1, text)[None].expand(batch, -1, -1))


def build_qwenimage() -> nn.Module:
    """Qwen-Image's config (patch 2, 64 packed input channels, 16 out, head dim 128, RoPE axes (16, 56, 56),
    text width 3584) with 2 heads instead of 24, 2 blocks instead of 60."""
    from diffusers import QwenImageTransformer2DModel

    torch.manual_seed(0)
    return QwenImageTransformer2DModel(
        patch_size=2, in_channels=64, out_channels=16, num_layers=2, attention_head_dim=128, num_attention_heads=2,
        joint_attention_dim=3584, axes_dims_rope=(16, 56, 56)).eval()


def qwenimage_inputs(model: nn.Module, batch: int = 2, grid=(8, 8), seed: int = 1, dtype=torch.float32,
                     text: int = 8) -> dict:
    g = seeded(seed)
    H, W = grid
    mask = torch.ones(batch, text, dtype=torch.long)
    mask[1:, text - 3:] = 0  # padded prompts after the first: the text mask must keep working
    return dict(
        hidden_states=torch.randn(batch, H * W, 64, generator=g).to(dtype),
        encoder_hidden_states=torch.randn(batch, text, 3584, generator=g).to(dtype),
        encoder_hidden_states_mask=mask, timestep=torch.full((batch,), 0.5, dtype=dtype),
        img_shapes=[[(1, H, W)]] * batch)


def build_sana() -> nn.Module:
    """SANA 1600M's config (32 latent channels, patch 1, head dim 32, MLP ratio 2.5, Gemma-2 caption width 2304,
    cross-attention head dim 112 -> here 128, no attention bias) with 8 heads (width 256) instead of 70 (2240)
    and 2 cross-attention heads, 2 blocks instead of 20."""
    from diffusers import SanaTransformer2DModel

    torch.manual_seed(0)
    return SanaTransformer2DModel(
        in_channels=32, out_channels=32, num_attention_heads=8, attention_head_dim=32, num_layers=2,
        num_cross_attention_heads=2, cross_attention_head_dim=128, cross_attention_dim=256, caption_channels=2304,
        mlp_ratio=2.5, sample_size=32, patch_size=1).eval()


def sana_inputs(model: nn.Module, batch: int = 2, grid=(8, 8), seed: int = 1, dtype=torch.float32,
                text: int = 8) -> dict:
    g = seeded(seed)
    mask = torch.ones(batch, text)
    mask[1:, text - 2:] = 0
    return dict(hidden_states=torch.randn(batch, 32, *grid, generator=g).to(dtype),
                encoder_hidden_states=torch.randn(batch, text, 2304, generator=g).to(dtype),
                encoder_attention_mask=mask.to(dtype), timestep=torch.full((batch,), 500.0, dtype=dtype))


# ---------------------------------------------------------------------- FLUX.3


def build_flux3() -> nn.Module:
    """FLUX.3's config (the class defaults: 128 packed input and reference channels, head dim 128, RoPE axes (32,
    32, 32, 32) over (t, h, w, l), theta 10000, MLP ratio 3, stacked Qwen3-VL text width 20480) with 2 heads
    instead of 24, 1 per-mode block per mode + 1 single block instead of 5 + 28."""
    from diffusers import Flux3Transformer2DModel

    torch.manual_seed(0)
    return Flux3Transformer2DModel(
        in_channels=128, cond_in_channels=128, num_layers=1, num_single_layers=1, attention_head_dim=128,
        num_attention_heads=2, joint_attention_dim=20480, mlp_ratio=3.0, axes_dims_rope=(32, 32, 32, 32),
        rope_theta=10000).eval()


def flux3_inputs(model: nn.Module, batch: int = 2, grid=(8, 8), seed: int = 1, dtype=torch.float32,
                 text: int = 8) -> dict:
    g = seeded(seed)
    H, W = grid
    return dict(hidden_states=randn(g, dtype, batch, H * W, 128),  # packed latent [B, N, 128]
                encoder_hidden_states=randn(g, dtype, batch, text, 20480),
                timestep=torch.full((batch,), 0.5, dtype=dtype),
                img_ids=grid_ids(1, H, W, 1), txt_ids=grid_ids(1, 1, 1, text))  # (t, h, w, l), shared by the batch


# ---------------------------------------------------------------------- Chroma


def build_chroma() -> nn.Module:
    """Chroma1-HD's config (patch 1, 64 packed channels, head dim 128, RoPE axes (16, 56, 56), T5 width 4096,
    approximator input 64) with 2 heads instead of 24, 1 double + 1 single block instead of 19 + 38, and the
    modulation approximator 1 layer of width 256 instead of 5 of 5120."""
    from diffusers import ChromaTransformer2DModel

    torch.manual_seed(0)
    return ChromaTransformer2DModel(
        patch_size=1, in_channels=64, num_layers=1, num_single_layers=1, attention_head_dim=128,
        num_attention_heads=2, joint_attention_dim=4096, axes_dims_rope=(16, 56, 56), approximator_num_channels=64,
        approximator_hidden_dim=256, approximator_layers=1).eval()


def chroma_inputs(model: nn.Module, batch: int = 2, grid=(8, 8), seed: int = 1, dtype=torch.float32,
                  text: int = 8) -> dict:
    g = seeded(seed)
    H, W = grid
    # ChromaPipeline's mask: the T5 mask (float 0/1) with the image tokens' ones appended, [B, T + N]
    mask = torch.cat([text_mask(batch, text), torch.ones(batch, H * W, dtype=torch.bool)], dim=1).to(dtype)
    return dict(hidden_states=randn(g, dtype, batch, H * W, 64),
                encoder_hidden_states=randn(g, dtype, batch, text, 4096),
                timestep=torch.full((batch,), 0.5, dtype=dtype),
                img_ids=grid_ids(1, H, W), txt_ids=torch.zeros(text, 3), attention_mask=mask)


# ---------------------------------------------------------------------- Qwen-Image 2.1


def build_qwenimage21() -> nn.Module:
    """Qwen-Image 2.1's config (the class defaults: patch 1, 64 packed channels, head dim 128, RoPE axes (16, 56,
    56), text width 4096, MLP ratio 3, causal condition) with 2 heads instead of 32, 2 blocks instead of 32."""
    from diffusers import QwenImage21Transformer2DModel

    torch.manual_seed(0)
    return QwenImage21Transformer2DModel(
        patch_size=1, in_channels=64, out_channels=64, num_layers=2, attention_head_dim=128, num_attention_heads=2,
        context_in_dim=4096, mlp_ratio=3, axes_dims_rope=(16, 56, 56), causal_condition=True).eval()


def qwenimage21_inputs(model: nn.Module, batch: int = 2, grid=(8, 8), seed: int = 1, dtype=torch.float32,
                       text: int = 8, condition: tuple[int, int] | None = None) -> dict:
    """A prompt of ``text`` tokens (with a ``condition`` image of ``(h, w)`` latent tokens in its middle, as the
    editing pipeline's vision-language sequence has it), then the target image's slots (one per 2 x 2 tokens)."""
    g = seeded(seed)
    H, W = grid
    vlm = torch.zeros(text, dtype=torch.bool)  # [T]: the prompt's image slots
    latents = [randn(g, dtype, batch, H * W, 64)]
    shapes = [(1, H, W)]
    if condition is not None:
        h, w = condition
        vlm = torch.cat([vlm[: text // 2], torch.ones(h * w // 4, dtype=torch.bool), vlm[text // 2:]])
        latents.insert(0, randn(g, dtype, batch, h * w, 64))
        shapes.insert(0, (1, h, w))
    img_mask = torch.cat([vlm, torch.ones(H * W // 4, dtype=torch.bool)])[None].expand(batch, -1)  # [B, S]
    prompt_mask = torch.ones(batch, vlm.shape[0], dtype=torch.bool)
    prompt_mask[1:, -2:] = False  # a padded prompt: its last text keys are excluded
    return dict(hidden_states=torch.cat(latents, dim=1), encoder_hidden_states=randn(g, dtype, batch, vlm.shape[0],
                4096), timestep=torch.full((batch,), 0.5, dtype=dtype), img_shapes=[shapes] * batch,
                img_mask=img_mask, encoder_hidden_states_mask=prompt_mask)


def qwenimage21_output(model: nn.Module, inputs: dict) -> Tensor:
    return run(model, inputs)[:, -math.prod(inputs["img_shapes"][0][-1]):]  # the target's tokens, as the pipeline


# ---------------------------------------------------------------------- Z-Image


def build_z_image() -> nn.Module:
    """Z-Image's config (the class defaults: 16 latent channels, patch 2, head dim 128 with RoPE axes (32, 48, 48)
    and lengths (1024, 512, 512), theta 256, q/k norm, Qwen3 caption width 2560, t scale 1000) with 2 heads (width
    256) instead of 30 (3840), 1 noise- and 1 context-refiner block instead of 2 each, 2 main blocks instead of
    30."""
    from diffusers import ZImageTransformer2DModel

    torch.manual_seed(0)
    return ZImageTransformer2DModel(
        all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=256, n_layers=2, n_refiner_layers=1,
        n_heads=2, n_kv_heads=2, qk_norm=True, cap_feat_dim=2560, rope_theta=256.0, t_scale=1000.0,
        axes_dims=[32, 48, 48], axes_lens=[1024, 512, 512]).eval()


def z_image_inputs(model: nn.Module, batch: int = 2, grid=(8, 8), seed: int = 1, dtype=torch.float32,
                   text: int = 8) -> dict:
    """ZImagePipeline's call: lists of per-sample latents ``[C, 1, 2H, 2W]`` and captions; the second caption is
    40 tokens, padded to 64 (the first to 32), so the batch has a key mask."""
    g = seeded(seed)
    H, W = grid
    lengths = [text] + [40] * (batch - 1)
    return dict(x=[randn(g, dtype, 16, 1, 2 * H, 2 * W) for _ in range(batch)],
                t=torch.full((batch,), 0.5, dtype=dtype),
                cap_feats=[randn(g, dtype, n, 2560) for n in lengths])


# ---------------------------------------------------------------------- HunyuanImage 2.1


def build_hunyuan_image() -> nn.Module:
    """HunyuanImage-2.1's config (64 latent channels, patch (1, 1), head dim 128, MLP ratio 4, RoPE axes (64, 64),
    theta 256, Qwen2.5-VL text width 3584, ByT5 glyph width 1472) with 2 heads instead of 28, 1 double + 1 single
    block instead of 20 + 40, 1 text-refiner block instead of 2."""
    from diffusers import HunyuanImageTransformer2DModel

    torch.manual_seed(0)
    return HunyuanImageTransformer2DModel(
        in_channels=64, out_channels=64, num_attention_heads=2, attention_head_dim=128, num_layers=1,
        num_single_layers=1, num_refiner_layers=1, mlp_ratio=4.0, patch_size=(1, 1), text_embed_dim=3584,
        text_embed_2_dim=1472, rope_theta=256.0, rope_axes_dim=(64, 64)).eval()


def hunyuan_image_inputs(model: nn.Module, batch: int = 2, grid=(8, 8), seed: int = 1, dtype=torch.float32,
                         text: int = 8) -> dict:
    g = seeded(seed)
    return dict(hidden_states=randn(g, dtype, batch, 64, *grid), timestep=torch.full((batch,), 500.0, dtype=dtype),
                encoder_hidden_states=randn(g, dtype, batch, text, 3584),
                encoder_attention_mask=text_mask(batch, text).long(),
                encoder_hidden_states_2=randn(g, dtype, batch, 4, 1472),
                encoder_attention_mask_2=text_mask(batch, 4, padded=1).long())


# ---------------------------------------------------------------------- Bria 3.2, FIBO, LongCat-Image, Ovis-Image


def build_bria() -> nn.Module:
    """Bria 3.2's layout (the class defaults: patch 1, 64 packed channels, head dim 128, RoPE axes (16, 56, 56),
    T5 width 4096) with 2 heads instead of 24, 1 double + 1 single block."""
    from diffusers import BriaTransformer2DModel

    torch.manual_seed(0)
    return BriaTransformer2DModel(
        patch_size=1, in_channels=64, num_layers=1, num_single_layers=1, attention_head_dim=128,
        num_attention_heads=2, joint_attention_dim=4096, axes_dims_rope=[16, 56, 56]).eval()


def flux1_like_inputs(width: int, t: float):
    """Inputs of a FLUX.1-style model at timestep ``t``: packed latent ``[B, N, 64]``, text ``[B, T, width]``, ids
    shared by the batch."""
    def inputs(model: nn.Module, batch: int = 2, grid=(8, 8), seed: int = 1, dtype=torch.float32,
               text: int = 8) -> dict:
        g = seeded(seed)
        H, W = grid
        return dict(hidden_states=randn(g, dtype, batch, H * W, 64),
                    encoder_hidden_states=randn(g, dtype, batch, text, width),
                    timestep=torch.full((batch,), t, dtype=dtype), img_ids=grid_ids(1, H, W),
                    txt_ids=torch.zeros(text, 3))
    return inputs


bria_inputs = flux1_like_inputs(4096, 500.0)


def build_bria_fibo() -> nn.Module:
    """FIBO's config (the class defaults: patch 1, 64 packed channels, head dim 128, RoPE axes (16, 56, 56), SmolLM3
    text width 2 x 2048 and per-block layers of 2048) with 2 heads instead of 24, 1 double + 1 single block instead
    of 8 + 38."""
    from diffusers import BriaFiboTransformer2DModel

    torch.manual_seed(0)
    return BriaFiboTransformer2DModel(
        patch_size=1, in_channels=64, num_layers=1, num_single_layers=1, attention_head_dim=128,
        num_attention_heads=2, joint_attention_dim=4096, axes_dims_rope=[16, 56, 56], text_encoder_dim=2048).eval()


def bria_fibo_inputs(model: nn.Module, batch: int = 2, grid=(8, 8), seed: int = 1, dtype=torch.float32,
                     text: int = 8) -> dict:
    """BriaFiboPipeline's call; a padded second prompt gives the [B, 1, 1, T + N] key mask it passes."""
    inputs = bria_inputs(model, batch, grid, seed, dtype, text)
    g = seeded(seed + 100)
    blocks = len(model.transformer_blocks) + len(model.single_transformer_blocks)
    mask = torch.cat([text_mask(batch, text), torch.ones(batch, math.prod(grid), dtype=torch.bool)], dim=1)
    return dict(inputs, text_encoder_layers=[randn(g, dtype, batch, text, 2048) for _ in range(blocks)],
                joint_attention_kwargs={"attention_mask": mask[:, None, None, :]})


def select_fibo(inputs: dict, i: int) -> dict:
    """Sample ``i`` of FIBO's inputs: its text-encoder layers and its row of the key mask."""
    return dict(sharing("img_ids", "txt_ids", "joint_attention_kwargs", "text_encoder_layers")(inputs, i),
                text_encoder_layers=[layer[i:i + 1] for layer in inputs["text_encoder_layers"]],
                joint_attention_kwargs={"attention_mask": inputs["joint_attention_kwargs"]["attention_mask"][i:i + 1]})


def build_longcat_image() -> nn.Module:
    """LongCat-Image's config (the class defaults: patch 1, 64 packed channels, head dim 128, RoPE axes (16, 56,
    56), Qwen2.5-VL text width 3584) with 2 heads instead of 24, 1 double + 1 single block instead of 19 + 38."""
    from diffusers import LongCatImageTransformer2DModel

    torch.manual_seed(0)
    return LongCatImageTransformer2DModel(
        patch_size=1, in_channels=64, num_layers=1, num_single_layers=1, attention_head_dim=128,
        num_attention_heads=2, joint_attention_dim=3584, pooled_projection_dim=3584,
        axes_dims_rope=[16, 56, 56]).eval()


def build_ovis_image() -> nn.Module:
    """Ovis-Image's config (the class defaults: patch 1, 64 packed channels, head dim 128, RoPE axes (16, 56, 56),
    Ovis text width 2048, SwiGLU MLPs) with 2 heads instead of 24, 1 double + 1 single block instead of 6 + 27."""
    from diffusers import OvisImageTransformer2DModel

    torch.manual_seed(0)
    return OvisImageTransformer2DModel(
        patch_size=1, in_channels=64, out_channels=64, num_layers=1, num_single_layers=1, attention_head_dim=128,
        num_attention_heads=2, joint_attention_dim=2048, axes_dims_rope=(16, 56, 56)).eval()


# ---------------------------------------------------------------------- CogView4, GLM-Image, CogView3-Plus


def build_cogview4() -> nn.Module:
    """CogView4-6B's config (16 latent channels, patch 2, head dim 128, GLM-4 text width 4096, time embedding 512,
    size conditions 256, RoPE axes (256, 256)) with 2 heads instead of 32, 2 blocks instead of 28."""
    from diffusers import CogView4Transformer2DModel

    torch.manual_seed(0)
    return CogView4Transformer2DModel(
        patch_size=2, in_channels=16, out_channels=16, num_layers=2, attention_head_dim=128, num_attention_heads=2,
        text_embed_dim=4096, time_embed_dim=512, condition_dim=256, rope_axes_dim=(256, 256)).eval()


def _size_conditions(batch: int, grid: tuple[int, int], dtype) -> dict:
    H, W = grid
    size = torch.tensor([[16.0 * H, 16.0 * W]] * batch, dtype=dtype)  # the image size of a 2 x 2-patch, 8x VAE latent
    return dict(target_size=size, crop_coords=torch.zeros(batch, 2, dtype=dtype))


def cogview4_inputs(model: nn.Module, batch: int = 2, grid=(8, 8), seed: int = 1, dtype=torch.float32,
                    text: int = 8, t: float = 0.5, masked: bool = False) -> dict:
    """As CogView4Pipeline calls the model (no text mask); ``masked``: with a text mask ``[B, T]``, the second
    sample's last 3 tokens padding."""
    g = seeded(seed)
    H, W = grid
    inputs = dict(hidden_states=torch.randn(batch, 16, 2 * H, 2 * W, generator=g).to(dtype),
                  encoder_hidden_states=torch.randn(batch, text, 4096, generator=g).to(dtype),
                  timestep=torch.full((batch,), 1000.0 * t, dtype=dtype),
                  original_size=_size_conditions(batch, grid, dtype)["target_size"],
                  **_size_conditions(batch, grid, dtype))
    return dict(inputs, attention_mask=text_mask(batch, text).long()) if masked else inputs


def build_glm_image() -> nn.Module:
    """GLM-Image's decoder config (16 latent channels, patch 2, head dim 128, ByT5 glyph width 1472, time embedding
    512, size conditions 256, prior codebook 16384) with 2 heads instead of 32, 2 blocks instead of 30."""
    from diffusers import GlmImageTransformer2DModel

    torch.manual_seed(0)
    return GlmImageTransformer2DModel(
        patch_size=2, in_channels=16, out_channels=16, num_layers=2, attention_head_dim=128, num_attention_heads=2,
        text_embed_dim=1472, time_embed_dim=512, condition_dim=256, prior_vq_quantizer_codebook_size=16384).eval()


def glm_image_inputs(model: nn.Module, batch: int = 2, grid=(8, 8), seed: int = 1, dtype=torch.float32,
                     text: int = 8, t: float = 0.5, masked: bool = False) -> dict:
    """As GlmImagePipeline calls the model (no text mask); ``masked``: as :func:`cogview4_inputs`."""
    g = seeded(seed)
    H, W = grid
    inputs = dict(hidden_states=torch.randn(batch, 16, 2 * H, 2 * W, generator=g).to(dtype),
                  encoder_hidden_states=torch.randn(batch, text, 1472, generator=g).to(dtype),
                  prior_token_id=torch.randint(0, 16384, (batch, H * W), generator=g),  # the AR model's image tokens
                  prior_token_drop=torch.zeros(batch, H * W, dtype=torch.bool),
                  timestep=torch.full((batch,), 1000.0 * t - 1, dtype=dtype), **_size_conditions(batch, grid, dtype))
    return dict(inputs, attention_mask=text_mask(batch, text).long()) if masked else inputs


def build_cogview3plus() -> nn.Module:
    """CogView3-Plus-3B's config (16 latent channels, patch 2, head dim 40, T5 width 4096, time embedding 512, size
    conditions 256) with 4 heads instead of 64, 2 blocks instead of 30."""
    from diffusers import CogView3PlusTransformer2DModel

    torch.manual_seed(0)
    return CogView3PlusTransformer2DModel(
        patch_size=2, in_channels=16, out_channels=16, num_layers=2, attention_head_dim=40, num_attention_heads=4,
        text_embed_dim=4096, time_embed_dim=512, condition_dim=256, pos_embed_max_size=128, sample_size=128).eval()


def cogview3plus_inputs(model: nn.Module, batch: int = 2, grid=(8, 8), seed: int = 1, dtype=torch.float32,
                        text: int = 8, t: float = 0.5) -> dict:
    return cogview4_inputs(model, batch, grid, seed, dtype, text, t)  # the same inputs (it takes no text mask)


# ---------------------------------------------------------------------- HiDream-I1


def build_hidream() -> nn.Module:
    """HiDream-I1's config (16 latent channels, patch 2, head dim 128, RoPE axes (64, 32, 32), T5 and Llama-3.1
    widths 4096, pooled CLIP width 2048, 4 routed experts of which 2 active) with 2 heads instead of 20, 1 double +
    1 single block instead of 16 + 32 (so 2 Llama layers instead of 48), a maximum resolution of 32 x 32 latent
    pixels instead of 128 x 128 (non-square latents are padded to its 16 x 16 tokens)."""
    from diffusers import HiDreamImageTransformer2DModel

    torch.manual_seed(0)
    return HiDreamImageTransformer2DModel(
        patch_size=2, in_channels=16, out_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=128,
        num_attention_heads=2, caption_channels=[4096, 4096], text_emb_dim=2048, num_routed_experts=4,
        num_activated_experts=2, axes_dims_rope=(64, 32, 32), max_resolution=(32, 32), llama_layers=[0, 1]).eval()


def hidream_inputs(model: nn.Module, batch: int = 2, grid=(8, 8), seed: int = 1, dtype=torch.float32,
                   text: int = 8, t: float = 0.5) -> dict:
    """A square grid as the pipeline passes it (a latent); another grid as already patchified tokens with an
    all-ones token mask, ids and sizes (the model's other input form; unpatched, this is what a 4 x 8 grid costs:
    a non-square latent would be padded to max_resolution's tokens)."""
    g = seeded(seed)
    H, W = grid
    inputs = dict(hidden_states=torch.randn(batch, 16, 2 * H, 2 * W, generator=g).to(dtype),
                  timesteps=torch.full((batch,), 1000.0 * t, dtype=dtype),
                  encoder_hidden_states_t5=torch.randn(batch, text, 4096, generator=g).to(dtype),
                  encoder_hidden_states_llama3=torch.randn(2, batch, 4, 4096, generator=g).to(dtype),  # [layers, B, T, C]
                  pooled_embeds=torch.randn(batch, 2048, generator=g).to(dtype))
    if H != W:
        latent = inputs["hidden_states"].unflatten(2, (H, 2)).unflatten(4, (W, 2))  # [B, C, H, 2, W, 2]
        ids = torch.cat([torch.zeros(H * W, 1), grid_ids(H, W).float()], dim=1)  # [N, 3]: (0, row, column)
        inputs.update(hidden_states=latent.permute(0, 2, 4, 3, 5, 1).reshape(batch, H * W, 4 * 16),  # [B, N, p*p*C]
                      hidden_states_masks=torch.ones(batch, H * W, dtype=dtype),
                      img_ids=ids[None].expand(batch, -1, -1),
                      img_sizes=torch.tensor([[H, W]] * batch))
    return inputs


# ---------------------------------------------------------------------- Lumina-Image 2.0


def build_lumina2() -> nn.Module:
    """Lumina-Image 2.0's config (16 latent channels, patch 2, head dim 96, 3 query heads per key/value head, RoPE
    axes (32, 32, 32) over lengths (300, 512, 512), Gemma-2 caption width 2304) with 3 heads and 1 key/value head
    (width 288) instead of 24 and 8 (2304), 1 refiner block of each kind and 2 joint blocks instead of 2 + 2 + 26."""
    from diffusers import Lumina2Transformer2DModel

    torch.manual_seed(0)
    return Lumina2Transformer2DModel(
        sample_size=128, patch_size=2, in_channels=16, hidden_size=288, num_layers=2, num_refiner_layers=1,
        num_attention_heads=3, num_kv_heads=1, multiple_of=256, norm_eps=1e-5, axes_dim_rope=(32, 32, 32),
        axes_lens=(300, 512, 512), cap_feat_dim=2304).eval()


def lumina2_inputs(model: nn.Module, batch: int = 2, grid=(8, 8), seed: int = 1, dtype=torch.float32,
                   text: int = 8, t: float = 0.5, padding: int = 3) -> dict:
    """The second sample's caption is ``padding`` tokens shorter: its image tokens start ``padding`` rows earlier
    in the joint sequence (0: every caption of one length)."""
    g = seeded(seed)
    H, W = grid
    return dict(hidden_states=torch.randn(batch, 16, 2 * H, 2 * W, generator=g).to(dtype),
                timestep=torch.full((batch,), 1.0 - t, dtype=dtype),  # the pipeline's 1 - t / 1000
                encoder_hidden_states=torch.randn(batch, text, 2304, generator=g).to(dtype),
                encoder_attention_mask=text_mask(batch, text, padding).long())


# ---------------------------------------------------------------------- AuraFlow


def build_auraflow() -> nn.Module:
    """AuraFlow's config (4 latent channels, patch 2, head dim 256, Pile-T5 text width 2048, learned positions over
    a 32 x 32 grid, 8 register tokens) with 1 head (width 256) instead of 12 (3072), 1 joint + 1 single block
    instead of 4 + 32."""
    from diffusers import AuraFlowTransformer2DModel

    torch.manual_seed(0)
    return AuraFlowTransformer2DModel(
        sample_size=64, patch_size=2, in_channels=4, num_mmdit_layers=1, num_single_dit_layers=1,
        attention_head_dim=256, num_attention_heads=1, joint_attention_dim=2048, caption_projection_dim=256,
        out_channels=4, pos_embed_max_size=1024).eval()


def auraflow_inputs(model: nn.Module, batch: int = 2, grid=(8, 8), seed: int = 1, dtype=torch.float32,
                    text: int = 8, t: float = 0.5) -> dict:
    g = seeded(seed)
    H, W = grid
    return dict(hidden_states=torch.randn(batch, 4, 2 * H, 2 * W, generator=g).to(dtype),
                encoder_hidden_states=torch.randn(batch, text, 2048, generator=g).to(dtype),
                timestep=torch.full((batch,), t, dtype=dtype))  # the pipeline's t / 1000


# ---------------------------------------------------------------------- Hunyuan-DiT


def build_hunyuan_dit() -> nn.Module:
    """Hunyuan-DiT v1.2's config (4 latent channels, patch 2, head dim 88, MLP ratio 4.3637, CLIP text width 1024,
    T5 width 2048, pooled width 1024, learned sigma, no style or size conditions) with 2 heads instead of 16, 4
    blocks instead of 40 (the last one takes the first one's skip), text lengths 4 + 4 instead of 77 + 256."""
    from diffusers import HunyuanDiT2DModel

    torch.manual_seed(0)
    return HunyuanDiT2DModel(
        num_attention_heads=2, attention_head_dim=88, in_channels=4, patch_size=2,
        activation_fn="gelu-approximate", sample_size=128, hidden_size=176, num_layers=4, mlp_ratio=4.3637,
        learn_sigma=True, cross_attention_dim=1024, cross_attention_dim_t5=2048, pooled_projection_dim=1024,
        text_len=4, text_len_t5=4, use_style_cond_and_image_meta_size=False).eval()


def hunyuan_dit_inputs(model: nn.Module, batch: int = 2, grid=(8, 8), seed: int = 1, dtype=torch.float32,
                       t: float = 0.5) -> dict:
    from diffusers.models.embeddings import get_2d_rotary_pos_embed

    g = seeded(seed)
    H, W = grid
    cos, sin = get_2d_rotary_pos_embed(88, ((0, 0), (H, W)), (H, W), output_type="pt")  # [N, 88] each
    return dict(hidden_states=torch.randn(batch, 4, 2 * H, 2 * W, generator=g).to(dtype),
                timestep=torch.full((batch,), 1000.0 * t, dtype=dtype),
                encoder_hidden_states=torch.randn(batch, 4, 1024, generator=g).to(dtype),
                text_embedding_mask=text_mask(batch, 4, 2).long(),
                encoder_hidden_states_t5=torch.randn(batch, 4, 2048, generator=g).to(dtype),
                text_embedding_mask_t5=text_mask(batch, 4, 1).long(),
                image_rotary_emb=(cos.to(dtype), sin.to(dtype)))


# ---------------------------------------------------------------------- OmniGen


def build_omnigen() -> nn.Module:
    """OmniGen v1's config (4 latent channels, patch 2, head dim 96, MLP width 8192 / 3072 of the model width,
    Phi-3 vocabulary 32064, su-scaled RoPE with 48 factors per range (here all 1), 192 x 192 positions) with 2
    heads (width 192) instead of 32 (3072), MLP width 512, 2 blocks instead of 32."""
    from diffusers import OmniGenTransformer2DModel

    torch.manual_seed(0)
    return OmniGenTransformer2DModel(
        in_channels=4, patch_size=2, hidden_size=192, num_attention_heads=2, num_key_value_heads=2,
        intermediate_size=512, num_layers=2, pad_token_id=32000, vocab_size=32064, max_position_embeddings=131072,
        original_max_position_embeddings=4096, rope_base=10000,
        rope_scaling={"short_factor": [1.0] * 48, "long_factor": [1.0] * 48}, pos_embed_max_size=192,
        time_step_dim=256).eval()


def omnigen_inputs(model: nn.Module, batch: int = 2, grid=(8, 8), seed: int = 1, dtype=torch.float32,
                   text: int = 8, t: float = 0.5) -> dict:
    """``text`` condition tokens (the second sample's first 3 are left padding, as OmniGen's processor pads), the
    time token, the image: the mask is causal over the condition and the time token, the image tokens see all
    unpadded ones."""
    g = seeded(seed)
    H, W = grid
    L = text + 1 + H * W
    mask = torch.tril(torch.ones(L, L)).repeat(batch, 1, 1)  # [B, L, L], 1: attend
    mask[:, text + 1:, :] = 1.0  # image rows see everything; condition and time rows are causal
    mask[1:, :, :3] = 0.0  # the padding is no key
    mask[1:, :3, :] = 1.0  # and its own rows see everything, as OmniGenProcessor.create_mask builds them
    return dict(hidden_states=torch.randn(batch, 4, 2 * H, 2 * W, generator=g).to(dtype),
                timestep=torch.full((batch,), 1000.0 * t, dtype=dtype),
                input_ids=torch.randint(0, 32000, (batch, text), generator=g), input_img_latents=[],
                input_image_sizes={}, attention_mask=mask.to(dtype), position_ids=torch.arange(L).repeat(batch, 1))


# ---------------------------------------------------------------------- ERNIE-Image


def build_ernie_image() -> nn.Module:
    """ERNIE-Image's config (128 latent channels, patch 1, head dim 128, RoPE axes (32, 48, 48) with theta 256,
    Mistral-3 text width 3072, FFN width 3 x the model width) with 2 heads (width 256) instead of 32 (4096), FFN
    768, 2 blocks instead of 36."""
    from diffusers import ErnieImageTransformer2DModel

    torch.manual_seed(0)
    model = ErnieImageTransformer2DModel(
        hidden_size=256, num_attention_heads=2, num_layers=2, ffn_hidden_size=768, in_channels=128,
        out_channels=128, patch_size=1, text_in_dim=3072, rope_theta=256, rope_axes_dim=(32, 48, 48)).eval()
    for zero_initialised in (model.adaLN_modulation[-1], model.final_linear):  # else the blocks are gated off
        nn.init.normal_(zero_initialised.weight, std=0.05)
        nn.init.normal_(zero_initialised.bias, std=0.05)
    return model


def ernie_image_inputs(model: nn.Module, batch: int = 2, grid=(8, 8), seed: int = 1, dtype=torch.float32,
                       text: int = 8, t: float = 0.5) -> dict:
    g = seeded(seed)
    return dict(hidden_states=torch.randn(batch, 128, *grid, generator=g).to(dtype),
                timestep=torch.full((batch,), 1000.0 * t, dtype=dtype),
                text_bth=torch.randn(batch, text, 3072, generator=g).to(dtype),
                text_lens=torch.tensor([text] + [text - 3] * (batch - 1)))  # shorter prompts: padding masked


def select_hidream(inputs: dict, i: int) -> dict:
    """Sample ``i`` of a batch of keyword inputs; HiDream's Llama states ``[layers, B, T, C]`` by their second axis."""
    sample = select(inputs, i)
    if "encoder_hidden_states_llama3" in inputs:
        sample["encoder_hidden_states_llama3"] = inputs["encoder_hidden_states_llama3"][:, i:i + 1]
    return sample


# ---------------------------------------------------------------------- the rows
_FLUX1 = ("transformer_blocks", "single_transformer_blocks")
_IDS = sharing("img_ids", "txt_ids")
#: The contract's strategies of the first families it covered (FLUX.2, Qwen-Image, SANA).
_THREE = ("tomesd", "ssm", "facility_location")

IMAGE_FAMILIES = {
    "flux2": Family("flux2", build_flux2, flux2_inputs, _FLUX1, ("double", "single"), (8, 8), (8, 4), (5, 7),
                    shuffle=shuffle_tokens, strategies=_THREE, half_strategies=_THREE,
                    joint=JointProbe(_FLUX1, text_first=True, masked=False)),
    "qwenimage": Family("qwenimage", build_qwenimage, qwenimage_inputs, ("transformer_blocks",), ("joint", "joint"),
                        (8, 8), (8, 4), (7, 5), shuffle=shuffle_tokens, strategies=_THREE, half_strategies=_THREE,
                        joint=JointProbe(("transformer_blocks",), text_first=True, masked=True)),
    "sana": Family("sana", build_sana, sana_inputs, ("transformer_blocks",), ("sana", "sana"), (8, 8), (8, 4), (5, 7),
                   rope=False, strategies=_THREE, half_strategies=_THREE),
    "flux3": Family("flux3", build_flux3, flux3_inputs, ("mode_blocks.image", "single_transformer_blocks"),
                    ("mode", "single"), (8, 8), (8, 4), (5, 7), select=_IDS,
                    joint=JointProbe(("single_transformer_blocks",), text_first=True, masked=False, kinds=(1,))),
    "chroma": Family("chroma", build_chroma, chroma_inputs, _FLUX1, ("double", "single"), (8, 8), (8, 4), (5, 7),
                     select=_IDS, joint=JointProbe(_FLUX1, text_first=True, masked=True)),
    "qwenimage21": Family("qwenimage21", build_qwenimage21, qwenimage21_inputs, ("transformer_blocks",),
                          ("joint", "joint"), (8, 8), (8, 4), (5, 4)),
    "z_image": Family("z_image", build_z_image, z_image_inputs, ("noise_refiner", "layers"),
                      ("refiner", "joint", "joint"), (8, 8), (8, 4), (5, 7), time_key="t", rising=True),
    "hunyuan_image": Family("hunyuan_image", build_hunyuan_image, hunyuan_image_inputs, _FLUX1, ("double", "single"),
                            (8, 8), (8, 4), (5, 7), joint=JointProbe(_FLUX1, text_first=False, masked=True)),
    "bria": Family("bria", build_bria, bria_inputs, _FLUX1, ("double", "single"), (8, 8), (8, 4), (5, 7),
                   select=_IDS, joint=JointProbe(_FLUX1, text_first=True, masked=False)),
    "bria_fibo": Family("bria_fibo", build_bria_fibo, bria_fibo_inputs, _FLUX1, ("double", "single"), (8, 8),
                        (8, 4), (5, 7), select=select_fibo, joint=JointProbe(_FLUX1, text_first=True, masked=True)),
    "longcat_image": Family("longcat_image", build_longcat_image, flux1_like_inputs(3584, 0.5), _FLUX1,
                            ("double", "single"), (8, 8), (8, 4), (5, 7), select=_IDS,
                            joint=JointProbe(_FLUX1, text_first=True, masked=False)),
    "ovis_image": Family("ovis_image", build_ovis_image, flux1_like_inputs(2048, 0.5), _FLUX1, ("double", "single"),
                         (8, 8), (8, 4), (5, 7), select=_IDS, joint=JointProbe(_FLUX1, text_first=True, masked=False)),
    # probe="sdpa": the joint probe's record from the attention's SDPA call
    "cogview4": Family("cogview4", build_cogview4, cogview4_inputs, ("transformer_blocks",),
                       ("cogview4", "cogview4"), (8, 8), (8, 4), (5, 7), half_strategies=("tomesd",),
                       joint=JointProbe(("transformer_blocks",), "attn1", text_first=True, masked=False)),
    "glm_image": Family("glm_image", build_glm_image, glm_image_inputs, ("transformer_blocks",),
                        ("glm_image", "glm_image"), (8, 8), (8, 4), (7, 5), half_strategies=("tomesd",),
                        joint=JointProbe(("transformer_blocks",), "attn1", text_first=True, masked=False)),
    "cogview3plus": Family("cogview3plus", build_cogview3plus, cogview3plus_inputs, ("transformer_blocks",),
                           ("cogview3plus", "cogview3plus"), (8, 8), (8, 4), (5, 7), rope=False,
                           half_strategies=("tomesd",),
                           joint=JointProbe(("transformer_blocks",), "attn1", text_first=True, masked=False)),
    "lumina2": Family("lumina2", build_lumina2, lumina2_inputs, ("noise_refiner", "layers"),
                      ("refiner", "joint", "joint"), (8, 8), (8, 4), (5, 7), half_strategies=("tomesd",),
                      rising=True),
    "auraflow": Family("auraflow", build_auraflow, auraflow_inputs, ("joint_transformer_blocks",
                       "single_transformer_blocks"), ("joint", "single"), (8, 8), (8, 4), (5, 7), rope=False,
                       half_strategies=("tomesd",),
                       joint=JointProbe(("joint_transformer_blocks", "single_transformer_blocks"), text_first=True,
                                        masked=False)),
    # Hunyuan-DiT runs its FP32LayerNorms and FP32SiLU in float32 even in a float64 model: its batch and its samples
    # alone differ by ~1e-7 unmerged already.
    "hunyuan_dit": Family("hunyuan_dit", build_hunyuan_dit, hunyuan_dit_inputs, ("blocks",), ("hunyuan_dit",) * 4,
                          (8, 8), (8, 4), (5, 7), half_strategies=("tomesd",), batch="as_unpatched"),
    "omnigen": Family("omnigen", build_omnigen, omnigen_inputs, ("layers",), ("omnigen", "omnigen"), (8, 8),
                      (8, 4), (5, 7), half_strategies=("tomesd",)),
    "ernie_image": Family("ernie_image", build_ernie_image, ernie_image_inputs, ("layers",),
                          ("ernie_image", "ernie_image"), (8, 8), (8, 4), (5, 7), half_strategies=("tomesd",),
                          joint=JointProbe(("layers",), "self_attention", text_first=False, masked=True)),
    # HiDream merges square latents only (a non-square one is padded with a key mask): its grid with leftover rows
    # is 7 x 7 and its 8 x 4 FLOP reference goes in as patchified tokens (hidream_inputs).
    "hidream": Family("hidream", build_hidream, hidream_inputs, ("double_stream_blocks", "single_stream_blocks"),
                      ("double", "single"), (8, 8), (8, 4), (7, 7), half_strategies=("tomesd",),
                      select=select_hidream, time_key="timesteps",
                      joint=JointProbe(("double_stream_blocks", "single_stream_blocks"), "block.attn1",
                                       text_first=False, masked=False)),
}
