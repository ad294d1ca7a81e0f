"""The video families under test: a builder and an input builder per declared video adapter on ``(T, H, W)`` token
grids, and their :class:`~helpers.family.Family` rows (``VIDEO_FAMILIES``; every family: ``helpers.families``).

Each model is a random-weight diffusers model built from its release's configuration with fewer heads and 1-2 blocks
of each kind (each builder's docstring says how it is reduced); ``<family>_inputs(model, batch, grid, seed, dtype,
text)`` gives one call's keyword inputs whose tokens form the frames x height x width ``grid`` (Latte: one frame's
grid).
"""

from __future__ import annotations

import math
import types
from collections.abc import Callable

import torch
from torch import nn

import tomerge
from helpers import seeded
from helpers.family import Family, JointProbe, sharing, text_mask


# ---------------------------------------------------------------------- Wan 2.1 / 2.2, HunyuanVideo (1.5), LTX-Video
def build_wan() -> nn.Module:
    """Wan2.1-T2V-1.3B's config (patch (1, 2, 2), 16 latent channels, head dim 128, UMT5 width 4096, frequency dim
    256, cross-attention norm, RMS q/k norm across heads) with 2 heads (width 256) instead of 12 (1536), the FFN
    scaled with the width (8960 * 256 / 1536 = 1493), 2 blocks instead of 30."""
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    return WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=128, in_channels=16, out_channels=16,
        text_dim=4096, freq_dim=256, ffn_dim=1493, num_layers=2, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", eps=1e-6).eval()


def wan_inputs(model: nn.Module, batch: int = 2, grid=(2, 4, 4), seed: int = 1, dtype=torch.float32,
               text: int = 8) -> dict:
    g = seeded(seed)
    T, H, W = grid
    inputs = dict(hidden_states=torch.randn(batch, model.config.in_channels, T, 2 * H, 2 * W, generator=g).to(dtype),
                  timestep=torch.full((batch,), 500.0, dtype=dtype),
                  encoder_hidden_states=torch.randn(batch, text, 4096, generator=g).to(dtype))
    if model.config.image_dim is not None:  # I2V 2.1: CLIP image tokens; the processor takes the last 512 as text
        inputs["encoder_hidden_states"] = torch.randn(batch, 512, 4096, generator=g).to(dtype)
        inputs["encoder_hidden_states_image"] = torch.randn(batch, 9, model.config.image_dim, generator=g).to(dtype)
    return inputs


def build_wan_i2v() -> nn.Module:
    """Wan2.1-I2V-14B's config (36 input channels: noise + condition latent + mask; CLIP image width 1280 with
    added k/v projections; head dim 128) with 2 heads (width 256) instead of 40 (5120), FFN 13824 * 256 / 5120 =
    691, 2 blocks instead of 40."""
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    return WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=128, in_channels=36, out_channels=16,
        text_dim=4096, freq_dim=256, ffn_dim=691, num_layers=2, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", eps=1e-6, image_dim=1280, added_kv_proj_dim=256).eval()


def build_hunyuan_video() -> nn.Module:
    """HunyuanVideo's config (16 latent channels, patch 2, temporal patch 1, head dim 128, MLP ratio 4, RoPE axes
    (16, 56, 56), theta 256, LLaVA text width 4096, CLIP pooled 768, guidance embedding) with 2 heads instead of
    24, 1 double + 1 single block instead of 20 + 40, 1 refiner block instead of 2."""
    from diffusers import HunyuanVideoTransformer3DModel

    torch.manual_seed(0)
    return HunyuanVideoTransformer3DModel(
        in_channels=16, out_channels=16, num_attention_heads=2, attention_head_dim=128, num_layers=1,
        num_single_layers=1, num_refiner_layers=1, mlp_ratio=4.0, patch_size=2, patch_size_t=1,
        guidance_embeds=True, text_embed_dim=4096, pooled_projection_dim=768, rope_axes_dim=(16, 56, 56)).eval()


def hunyuan_video_inputs(model: nn.Module, batch: int = 2, grid=(2, 4, 4), seed: int = 1, dtype=torch.float32,
                         text: int = 8) -> dict:
    g = seeded(seed)
    T, H, W = grid
    mask = torch.ones(batch, text, dtype=torch.long)
    mask[1:, text - 3:] = 0  # a shorter prompt: its padding keys are masked in the joint attention
    return dict(hidden_states=torch.randn(batch, 16, T, 2 * H, 2 * W, generator=g).to(dtype),
                timestep=torch.full((batch,), 500.0, dtype=dtype),
                encoder_hidden_states=torch.randn(batch, text, 4096, generator=g).to(dtype),
                encoder_attention_mask=mask, pooled_projections=torch.randn(batch, 768, generator=g).to(dtype),
                guidance=torch.full((batch,), 6000.0, dtype=dtype))


def build_hunyuan_video15() -> nn.Module:
    """HunyuanVideo 1.5's config (65 input channels, 32 out, patch 1, head dim 128, MLP ratio 4, RoPE axes (16, 56,
    56), Qwen2.5-VL text width 3584, ByT5 width 1472, SigLIP image width 1152) with 2 heads instead of 16, 2
    blocks instead of 54, 1 refiner block instead of 2."""
    from diffusers import HunyuanVideo15Transformer3DModel

    torch.manual_seed(0)
    return HunyuanVideo15Transformer3DModel(
        in_channels=65, out_channels=32, num_attention_heads=2, attention_head_dim=128, num_layers=2,
        num_refiner_layers=1, mlp_ratio=4.0, patch_size=1, patch_size_t=1, text_embed_dim=3584,
        text_embed_2_dim=1472, image_embed_dim=1152, rope_axes_dim=(16, 56, 56)).eval()


def hunyuan_video15_inputs(model: nn.Module, batch: int = 2, grid=(2, 4, 4), seed: int = 1, dtype=torch.float32,
                           text: int = 8) -> dict:
    g = seeded(seed)
    mask = torch.ones(batch, text, dtype=torch.long)
    mask[1:, text - 3:] = 0
    return dict(hidden_states=torch.randn(batch, 65, *grid, generator=g).to(dtype),
                timestep=torch.full((batch,), 500.0, dtype=dtype),
                encoder_hidden_states=torch.randn(batch, text, 3584, generator=g).to(dtype),
                encoder_attention_mask=mask,
                encoder_hidden_states_2=torch.randn(batch, 4, 1472, generator=g).to(dtype),
                encoder_attention_mask_2=torch.ones(batch, 4, dtype=torch.long),
                image_embeds=torch.zeros(batch, 4, 1152, dtype=dtype))  # text-to-video: no image


def build_ltx() -> nn.Module:
    """LTX-Video 0.9's config (128 latent channels, patch 1, temporal patch 1, head dim 64, T5 width 4096, RMS q/k
    norm across heads) with 4 heads (width 256, cross-attention width 256) instead of 32 (2048), 2 blocks
    instead of 28."""
    from diffusers import LTXVideoTransformer3DModel

    torch.manual_seed(0)
    return LTXVideoTransformer3DModel(
        in_channels=128, out_channels=128, patch_size=1, patch_size_t=1, num_attention_heads=4, attention_head_dim=64,
        cross_attention_dim=256, num_layers=2, caption_channels=4096).eval()


def ltx_inputs(model: nn.Module, batch: int = 2, grid=(2, 4, 4), seed: int = 1, dtype=torch.float32,
               text: int = 8) -> dict:
    g = seeded(seed)
    T, H, W = grid
    mask = torch.ones(batch, text, dtype=torch.long)
    mask[1:, text - 3:] = 0
    return dict(hidden_states=torch.randn(batch, T * H * W, 128, generator=g).to(dtype),  # packed [B, N, C]
                encoder_hidden_states=torch.randn(batch, text, 4096, generator=g).to(dtype),
                timestep=torch.full((batch,), 500.0, dtype=dtype), encoder_attention_mask=mask,
                num_frames=T, height=H, width=W, rope_interpolation_scale=(8 / 25, 32, 32))


# ---------------------------------------------------------------------- CogVideoX, ConsisID
def build_cogvideox() -> nn.Module:
    """CogVideoX-5b's config (16 latent channels, patch 2 per frame, head dim 64, time embedding 512, T5 width
    4096, 3-D RoPE, sample 60 x 90 latents) with 2 heads instead of 48, 2 blocks instead of 42."""
    from diffusers import CogVideoXTransformer3DModel

    torch.manual_seed(0)
    return CogVideoXTransformer3DModel(
        num_attention_heads=2, attention_head_dim=64, in_channels=16, out_channels=16, time_embed_dim=512,
        text_embed_dim=4096, num_layers=2, patch_size=2, sample_height=60, sample_width=90, sample_frames=49,
        max_text_seq_length=226, use_rotary_positional_embeddings=True).eval()


def build_cogvideox2b() -> nn.Module:
    """CogVideoX-2b's config (as 5B, but sin-cos positions added at the patch embedding instead of RoPE) with 2
    heads instead of 30, 2 blocks instead of 30, and a text length of 8 instead of 226 (the sin-cos table has
    zero rows for the text: its prompts must have exactly that length)."""
    from diffusers import CogVideoXTransformer3DModel

    torch.manual_seed(0)
    return CogVideoXTransformer3DModel(
        num_attention_heads=2, attention_head_dim=64, in_channels=16, out_channels=16, time_embed_dim=512,
        text_embed_dim=4096, num_layers=2, patch_size=2, sample_height=60, sample_width=90, sample_frames=49,
        max_text_seq_length=8, use_rotary_positional_embeddings=False).eval()


def build_cogvideox15_i2v() -> nn.Module:
    """CogVideoX1.5-5B-I2V's config (32 input channels: noise + image latent, patches 2 x 2 x 2 (temporal patch
    2), no patch bias, "ofs" embedding 512, head dim 64, RoPE on a 300 x 300 base grid) with 2 heads instead of
    48, 2 blocks instead of 42."""
    from diffusers import CogVideoXTransformer3DModel

    torch.manual_seed(0)
    return CogVideoXTransformer3DModel(
        num_attention_heads=2, attention_head_dim=64, in_channels=32, out_channels=16, time_embed_dim=512,
        ofs_embed_dim=512, text_embed_dim=4096, num_layers=2, patch_size=2, patch_size_t=2, patch_bias=False,
        sample_height=300, sample_width=300, sample_frames=81, max_text_seq_length=226,
        use_rotary_positional_embeddings=True).eval()


def cogvideox_rope(model: nn.Module, grid: tuple[int, int, int]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The ``(cos, sin)`` tables ``[N, 64]`` as CogVideoX(1.5)Pipeline builds them for this token grid."""
    from diffusers import CogVideoXPipeline

    if not model.config.use_rotary_positional_embeddings:
        return None
    T, H, W = grid
    p, p_t = model.config.patch_size, model.config.patch_size_t or 1
    pipe = types.SimpleNamespace(transformer=model, vae_scale_factor_spatial=8)
    return CogVideoXPipeline._prepare_rotary_positional_embeddings(
        pipe, height=8 * p * H, width=8 * p * W, num_frames=T * p_t, device=torch.device("cpu"))


def cogvideox_inputs(model: nn.Module, batch: int = 2, grid=(2, 4, 4), seed: int = 1, dtype=torch.float32,
                     text: int = 8) -> dict:
    g = seeded(seed)
    T, H, W = grid
    p, p_t = model.config.patch_size, model.config.patch_size_t or 1
    inputs = dict(  # the latent is frames first: [B, F, C, H, W]
        hidden_states=torch.randn(batch, T * p_t, model.config.in_channels, p * H, p * W, generator=g).to(dtype),
        encoder_hidden_states=torch.randn(batch, text, 4096, generator=g).to(dtype),
        timestep=torch.full((batch,), 500, dtype=torch.long), image_rotary_emb=cogvideox_rope(model, grid))
    if model.config.ofs_embed_dim:
        inputs["ofs"] = torch.full((batch,), 2.0, dtype=dtype)  # CogVideoXImageToVideoPipeline's ofs
    return inputs


def build_consisid() -> nn.Module:
    """ConsisID-preview's config (CogVideoX-5B-I2V: 32 input channels, patch 2 per frame, head dim 64, T5 width
    4096, RoPE; the face path: identity embedding 1280, 5 ViT feature scales, a perceiver cross-attention to the
    face tokens after every 2nd block) with 2 heads instead of 48, 2 blocks instead of 42, the face encoder's
    ViT width 1024 -> 64 and 1 perceiver layer per scale instead of 2, and without the learned positional table
    (fixed to the 60 x 90 training latent, added at the patch embedding)."""
    from diffusers import ConsisIDTransformer3DModel

    torch.manual_seed(0)
    inner = 2 * 64
    return ConsisIDTransformer3DModel(
        num_attention_heads=2, attention_head_dim=64, in_channels=32, out_channels=16, time_embed_dim=512,
        text_embed_dim=4096, num_layers=2, patch_size=2, sample_height=60, sample_width=90, sample_frames=49,
        max_text_seq_length=226, use_rotary_positional_embeddings=True, use_learned_positional_embeddings=False,
        is_train_face=True, cross_attn_interval=2, LFE_id_dim=1280, LFE_vit_dim=64, LFE_depth=5, LFE_num_scale=5,
        LFE_dim_head=16, LFE_num_heads=4, LFE_output_dim=int(inner / 3 * 2)).eval()  # the perceiver's key width


def consisid_inputs(model: nn.Module, batch: int = 2, grid=(2, 4, 4), seed: int = 1, dtype=torch.float32,
                    text: int = 8) -> dict:
    """ConsisIDPipeline's call: CogVideoX's inputs (its RoPE tables are CogVideoX 1.0's: ConsisIDPipeline needs
    opencv, not installed here), the face's identity embedding and its ViT features."""
    g = seeded(seed)
    T, H, W = grid
    config = types.SimpleNamespace(**model.config, patch_size_t=None)  # ConsisID has no temporal patch
    rope = cogvideox_rope(types.SimpleNamespace(config=config), grid)
    return dict(hidden_states=torch.randn(batch, T, 32, 2 * H, 2 * W, generator=g).to(dtype),
                encoder_hidden_states=torch.randn(batch, text, 4096, generator=g).to(dtype),
                timestep=torch.full((batch,), 500, dtype=torch.long), image_rotary_emb=rope,
                id_cond=torch.randn(batch, 1280, generator=g).to(dtype),
                id_vit_hidden=[torch.randn(batch, 9, 64, generator=g).to(dtype) for _ in range(5)])


# ---------------------------------------------------------------------- Mochi
def build_mochi() -> nn.Module:
    """Mochi-1-preview's config (12 latent channels, patch 2 per frame, head dim 128, time embedding 256, SwiGLU
    MLPs) with 2 heads (width 256) instead of 24 (3072), the text stream's width scaled with it (1536 * 256 /
    3072 = 128), 2 blocks instead of 48 (the last one, as in the release, without text outputs), and a text
    width of 256 instead of T5's 4096: the text reaches the blocks projected to the text stream's width, and the
    4096-wide attention pool of the time embedding alone costs 0.25 s a call on one thread. The learned RoPE
    frequencies (zeros before loading a checkpoint) are drawn at random."""
    from diffusers import MochiTransformer3DModel

    torch.manual_seed(0)
    model = MochiTransformer3DModel(
        patch_size=2, num_attention_heads=2, attention_head_dim=128, num_layers=2, pooled_projection_dim=128,
        in_channels=12, text_embed_dim=MOCHI_TEXT_WIDTH, time_embed_dim=256).eval()
    with torch.no_grad():
        model.pos_frequencies.normal_(generator=seeded(0))  # [3, heads, d/2]
    return model


MOCHI_TEXT_WIDTH = 256


def mochi_inputs(model: nn.Module, batch: int = 2, grid=(2, 4, 4), seed: int = 1, dtype=torch.float32,
                 text: int = 8) -> dict:
    g = seeded(seed)
    T, H, W = grid
    return dict(hidden_states=torch.randn(batch, 12, T, 2 * H, 2 * W, generator=g).to(dtype),
                encoder_hidden_states=torch.randn(batch, text, MOCHI_TEXT_WIDTH, generator=g).to(dtype),
                timestep=torch.full((batch,), 500.0, dtype=dtype),
                encoder_attention_mask=text_mask(batch, text).long())


# ---------------------------------------------------------------------- Allegro
def build_allegro() -> nn.Module:
    """Allegro's config (4 latent channels, patch 2 per frame, head dim 96 (RoPE: 32 per axis), T5 width 4096
    projected to the model width, RoPE interpolation (2.2, 2, 2)) with 2 heads (width 192) instead of 24 (2304),
    2 blocks instead of 32."""
    from diffusers import AllegroTransformer3DModel

    torch.manual_seed(0)
    return AllegroTransformer3DModel(
        patch_size=2, patch_size_t=1, num_attention_heads=2, attention_head_dim=96, in_channels=4, out_channels=4,
        num_layers=2, cross_attention_dim=192, caption_channels=4096, sample_height=90, sample_width=160,
        sample_frames=22, interpolation_scale_h=2.0, interpolation_scale_w=2.0, interpolation_scale_t=2.2).eval()


def allegro_inputs(model: nn.Module, batch: int = 2, grid=(2, 4, 4), seed: int = 1, dtype=torch.float32,
                   text: int = 8) -> dict:
    """AllegroPipeline's rotary argument: per-axis tables and the (t, h, w) position ids [1, N]."""
    from diffusers import AllegroPipeline

    g = seeded(seed)
    T, H, W = grid
    pipe = types.SimpleNamespace(transformer=model, vae_scale_factor_spatial=8)
    rope = AllegroPipeline._prepare_rotary_positional_embeddings(pipe, batch, 16 * H, 16 * W, T, torch.device("cpu"))
    return dict(hidden_states=torch.randn(batch, 4, T, 2 * H, 2 * W, generator=g).to(dtype),
                encoder_hidden_states=torch.randn(batch, text, 4096, generator=g).to(dtype),
                timestep=torch.full((batch,), 500, dtype=torch.long),
                encoder_attention_mask=text_mask(batch, text).long(),
                image_rotary_emb=rope)


# ---------------------------------------------------------------------- EasyAnimate
def build_easyanimate(in_channels: int = 16) -> nn.Module:
    """EasyAnimateV5.1-7b's config (16 latent channels, patch 2 per frame, head dim 64, Qwen2-VL text width 3584
    with its RMS norm, time embedding 512; the first half of the blocks MM-DiT with their own text projections,
    the rest sharing them) with 2 heads instead of 48, 1 MM-DiT + 1 shared block instead of 18 + 18."""
    from diffusers import EasyAnimateTransformer3DModel

    torch.manual_seed(0)
    return EasyAnimateTransformer3DModel(
        num_attention_heads=2, attention_head_dim=64, in_channels=in_channels, out_channels=16, patch_size=2,
        sample_height=60, sample_width=90, num_layers=2, mmdit_layers=1, time_embed_dim=512,
        add_norm_text_encoder=True, text_embed_dim=3584, after_norm=False).eval()


def build_easyanimate_inp() -> nn.Module:
    """EasyAnimateV5.1-7b-InP (image-to-video): as :func:`build_easyanimate` with 33 input channels (noise, then
    the mask and the masked video's latent as ``inpaint_latents``)."""
    return build_easyanimate(in_channels=33)


def easyanimate_inputs(model: nn.Module, batch: int = 2, grid=(2, 4, 4), seed: int = 1, dtype=torch.float32,
                       text: int = 8) -> dict:
    g = seeded(seed)
    T, H, W = grid
    inputs = dict(hidden_states=torch.randn(batch, 16, T, 2 * H, 2 * W, generator=g).to(dtype),
                  timestep=torch.full((batch,), 500.0, dtype=dtype),
                  encoder_hidden_states=torch.randn(batch, text, 3584, generator=g).to(dtype))
    if model.config.in_channels > 16:  # the mask and the first frame's latent, the rest zeros
        inpaint = torch.zeros(batch, model.config.in_channels - 16, T, 2 * H, 2 * W, dtype=dtype)
        inpaint[:, 1:, 0] = torch.randn(batch, model.config.in_channels - 17, 2 * H, 2 * W, generator=g).to(dtype)
        inpaint[:, 0, 1:] = 1.0
        inputs["inpaint_latents"] = inpaint
    return inputs


# ---------------------------------------------------------------------- Latte
def build_latte() -> nn.Module:
    """Latte-1's config (4 latent channels, 8 out (learned sigma), patch 2, head dim 72, T5 width 4096 projected
    to the model width, adaLN-single, 1000 embedding steps) with 2 heads (width 144) instead of 16 (1152), 2
    spatial + 2 temporal blocks instead of 28 + 28, and 2 frames instead of 16 (the temporal positions are a
    table of ``video_length`` frames that the input must match)."""
    from diffusers import LatteTransformer3DModel

    torch.manual_seed(0)
    return LatteTransformer3DModel(
        num_attention_heads=2, attention_head_dim=72, in_channels=4, out_channels=8, num_layers=2,
        cross_attention_dim=144, attention_bias=True, sample_size=64, patch_size=2, activation_fn="gelu-approximate",
        num_embeds_ada_norm=1000, norm_type="ada_norm_single", norm_elementwise_affine=False, norm_eps=1e-6,
        caption_channels=4096, video_length=LATTE_FRAMES).eval()


LATTE_FRAMES = 2


def latte_inputs(model: nn.Module, batch: int = 2, grid=(4, 4), seed: int = 1, dtype=torch.float32,
                 text: int = 8) -> dict:
    """``grid``: one frame's ``(H, W)`` tokens; every call has ``LATTE_FRAMES`` frames."""
    g = seeded(seed)
    H, W = grid
    return dict(hidden_states=torch.randn(batch, 4, LATTE_FRAMES, 2 * H, 2 * W, generator=g).to(dtype),
                timestep=torch.full((batch,), 500, dtype=torch.long),
                encoder_hidden_states=torch.randn(batch, text, 4096, generator=g).to(dtype))


# ---------------------------------------------------------------------- Cosmos
def build_cosmos(in_channels: int = 16, rope_scale=(2.0, 1.0, 1.0), extra_pos_embed_type="learnable") -> nn.Module:
    """Cosmos-1.0-Diffusion-7B-Text2World's config (16 latent channels, patch (1, 2, 2), head dim 128, MLP ratio
    4, T5-11B width 1024, adaLN-LoRA 256, RoPE scale (2, 1, 1) on a (128, 240, 240) maximum size, learnable
    extra positions) with 2 heads instead of 32, 2 blocks instead of 28, and without the padding-mask input
    channel (the pipelines pass an all-zero ``[1, 1, H, W]`` mask that the model repeats over the batch, which
    the per-sample checks cannot split; it only feeds the patch embedding)."""
    from diffusers import CosmosTransformer3DModel

    torch.manual_seed(0)
    return CosmosTransformer3DModel(
        in_channels=in_channels, out_channels=16, num_attention_heads=2, attention_head_dim=128, num_layers=2,
        mlp_ratio=4.0, text_embed_dim=1024, adaln_lora_dim=256, max_size=(128, 240, 240), patch_size=(1, 2, 2),
        rope_scale=rope_scale, concat_padding_mask=False, extra_pos_embed_type=extra_pos_embed_type).eval()


def build_cosmos2_video2world() -> nn.Module:
    """Cosmos-2.0-Diffusion-2B-Video2World's config (as :func:`build_cosmos`, with the condition mask as a 17th
    input channel, RoPE scale (1, 3, 3), no extra positions) with 2 heads instead of 16, 2 blocks instead of 28."""
    return build_cosmos(in_channels=17, rope_scale=(1.0, 3.0, 3.0), extra_pos_embed_type=None)


def cosmos_inputs(model: nn.Module, batch: int = 2, grid=(2, 4, 4), seed: int = 1, dtype=torch.float32,
                  text: int = 8) -> dict:
    """Text2World (1.0): one EDM ``c_noise`` per sample; Video2World (2.0): the first frame is the condition
    (mask channel 1, its own small timestep ``[B, 1, F, 1, 1]``, as Cosmos2VideoToWorldPipeline passes them)."""
    g = seeded(seed)
    T, H, W = grid
    inputs = dict(hidden_states=torch.randn(batch, 16, T, 2 * H, 2 * W, generator=g).to(dtype),
                  timestep=torch.full((batch,), 0.5, dtype=dtype),
                  encoder_hidden_states=torch.randn(batch, text, 1024, generator=g).to(dtype), fps=24)
    if model.config.in_channels > 16:
        condition = torch.zeros(batch, 1, T, 2 * H, 2 * W, dtype=dtype)
        condition[:, :, 0] = 1.0
        timestep = torch.full((batch, 1, T, 1, 1), 0.5, dtype=dtype)
        timestep[:, :, 0] = 1e-4 / (1 + 1e-4)  # sigma_conditioning / (sigma_conditioning + 1)
        inputs.update(condition_mask=condition, timestep=timestep, fps=16)
    return inputs


# ---------------------------------------------------------------------- SANA-Video
def build_sana_video() -> nn.Module:
    """SANA-Video 2B's config (16 latent channels, patch (1, 2, 2), head dim 112 (Wan RoPE axes 40, 36, 36),
    cross-attention head dim 112, Gemma-2 caption width 2304, MLP ratio 2.5, RMS q/k norms across heads) with 2
    heads (width 224) and 2 cross-attention heads instead of 20, 2 blocks instead of 20."""
    from diffusers import SanaVideoTransformer3DModel

    torch.manual_seed(0)
    return SanaVideoTransformer3DModel(
        in_channels=16, out_channels=16, num_attention_heads=2, attention_head_dim=112, num_layers=2,
        num_cross_attention_heads=2, cross_attention_head_dim=112, cross_attention_dim=224, caption_channels=2304,
        mlp_ratio=2.5, patch_size=(1, 2, 2), qk_norm="rms_norm_across_heads", rope_max_seq_len=1024).eval()


def sana_video_inputs(model: nn.Module, batch: int = 2, grid=(2, 4, 4), seed: int = 1, dtype=torch.float32,
                      text: int = 8) -> dict:
    g = seeded(seed)
    T, H, W = grid
    return dict(hidden_states=torch.randn(batch, 16, T, 2 * H, 2 * W, generator=g).to(dtype),
                encoder_hidden_states=torch.randn(batch, text, 2304, generator=g).to(dtype),
                timestep=torch.full((batch,), 500.0, dtype=dtype),
                encoder_attention_mask=text_mask(batch, text).long())


# ---------------------------------------------------------------------- SkyReels-V2, Wan VACE, Wan Animate
def build_skyreels_v2() -> nn.Module:
    """SkyReels-V2-DF-14B-540P's config (patch (1, 2, 2), 16 latent channels, head dim 128, UMT5 width 4096, frequency
    dim 256, cross-attention norm, RMS q/k norm across heads, no fps embedding) with 2 heads (width 256) instead of 40
    (5120), the FFN scaled with the width (13824 * 256 / 5120 = 691), 2 blocks instead of 40."""
    from diffusers import SkyReelsV2Transformer3DModel

    torch.manual_seed(0)
    return SkyReelsV2Transformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=128, in_channels=16, out_channels=16,
        text_dim=4096, freq_dim=256, ffn_dim=691, num_layers=2, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", eps=1e-6, inject_sample_info=False).eval()


def skyreels_v2_inputs(model: nn.Module, batch: int = 2, grid=(2, 4, 4), seed: int = 1, dtype=torch.float32,
                       text: int = 8, t: float = 500.0) -> dict:
    """Diffusion forcing: a timestep per latent frame, the later frames noisier (the largest is ``t``)."""
    g = seeded(seed)
    T, H, W = grid
    frame_t = torch.tensor([t * (f + 1) / T for f in range(T)], dtype=dtype)
    return dict(hidden_states=torch.randn(batch, 16, T, 2 * H, 2 * W, generator=g).to(dtype),
                timestep=frame_t.expand(batch, T).clone(),
                encoder_hidden_states=torch.randn(batch, text, 4096, generator=g).to(dtype),
                enable_diffusion_forcing=True)


def build_wan_vace() -> nn.Module:
    """Wan2.1-VACE-1.3B's config (Wan 1.3B: patch (1, 2, 2), head dim 128, UMT5 width 4096; VACE blocks after every
    other block, 96 control channels) with 2 heads (width 256) instead of 12 (1536), FFN 8960 * 256 / 1536 = 1493,
    2 blocks and 2 VACE blocks (``vace_layers=[0, 1]``) instead of 30 and 15."""
    from diffusers import WanVACETransformer3DModel

    torch.manual_seed(0)
    return WanVACETransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=128, in_channels=16, out_channels=16,
        text_dim=4096, freq_dim=256, ffn_dim=1493, num_layers=2, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", eps=1e-6, vace_layers=[0, 1], vace_in_channels=96).eval()


def wan_vace_inputs(model: nn.Module, batch: int = 2, grid=(2, 4, 4), seed: int = 1, dtype=torch.float32,
                    text: int = 8, t: float = 500.0) -> dict:
    g = seeded(seed)
    T, H, W = grid
    return dict(hidden_states=torch.randn(batch, 16, T, 2 * H, 2 * W, generator=g).to(dtype),
                timestep=torch.full((batch,), t, dtype=dtype),
                encoder_hidden_states=torch.randn(batch, text, 4096, generator=g).to(dtype),
                control_hidden_states=torch.randn(batch, 96, T, 2 * H, 2 * W, generator=g).to(dtype))


def build_wan_animate() -> nn.Module:
    """Wan2.2-Animate-14B's transformer config (36 input channels, 16 latent, patch (1, 2, 2), head dim 128, CLIP image
    width 1280 with added k/v projections, UMT5 width 4096, 4 face-encoder heads, 20 motion dims) with 2 heads (width
    256) instead of 40 (5120), FFN 13824 * 256 / 5120 = 691, 2 blocks instead of 40 and a face adapter after block 0
    (``inject_face_latents_blocks=2``; 5 in the release, after blocks 0, 5, ...). The face motion encoder, outside the
    DiT, reads 16 x 16 faces with 32 channels instead of 512 x 512 with 512."""
    from diffusers import WanAnimateTransformer3DModel

    torch.manual_seed(0)
    return WanAnimateTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=128, in_channels=36, latent_channels=16,
        out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=691, num_layers=2, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", eps=1e-6, image_dim=1280, added_kv_proj_dim=256,
        motion_encoder_channel_sizes={"16": 32, "8": 32, "4": 32}, motion_encoder_size=16, motion_style_dim=32,
        motion_dim=20, motion_encoder_dim=32, face_encoder_hidden_dim=64, face_encoder_num_heads=4,
        inject_face_latents_blocks=2).eval()


def wan_animate_inputs(model: nn.Module, batch: int = 2, grid=(2, 4, 4), seed: int = 1, dtype=torch.float32,
                       text: int = 8, t: float = 500.0) -> dict:
    """The reference frame and ``T - 1`` pose frames; ``4 (T - 2) + 1`` face frames, which the face encoder's two
    stride-2 convolutions and its padding frame turn into ``T`` motion frames (as 77 face frames into 21)."""
    g = seeded(seed)
    T, H, W = grid
    return dict(hidden_states=torch.randn(batch, 36, T, 2 * H, 2 * W, generator=g).to(dtype),
                timestep=torch.full((batch,), t, dtype=dtype),
                encoder_hidden_states=torch.randn(batch, 512, 4096, generator=g).to(dtype),  # the processor's 512
                encoder_hidden_states_image=torch.randn(batch, 9, 1280, generator=g).to(dtype),
                pose_hidden_states=torch.randn(batch, 16, T - 1, 2 * H, 2 * W, generator=g).to(dtype),
                face_pixel_values=torch.randn(batch, 3, 4 * (T - 2) + 1, 16, 16, generator=g).to(dtype))


# ---------------------------------------------------------------------- HunyuanVideo-FramePack
def build_framepack() -> nn.Module:
    """FramePack's (lllyasviel/FramePackI2V_HY) config: HunyuanVideo's (16 latent channels, patch 2, temporal patch 1,
    head dim 128, MLP ratio 4, RoPE axes (16, 56, 56), theta 256, LLaVA text width 4096, CLIP pooled 768, guidance
    embedding) with the SigLIP image projection (1152) and the history patch embeddings, 2 heads instead of 24,
    1 double + 1 single block instead of 20 + 40, 1 refiner block instead of 2."""
    from diffusers import HunyuanVideoFramepackTransformer3DModel

    torch.manual_seed(0)
    return HunyuanVideoFramepackTransformer3DModel(
        in_channels=16, out_channels=16, num_attention_heads=2, attention_head_dim=128, num_layers=1,
        num_single_layers=1, num_refiner_layers=1, mlp_ratio=4.0, patch_size=2, patch_size_t=1, qk_norm="rms_norm",
        guidance_embeds=True, text_embed_dim=4096, pooled_projection_dim=768, rope_theta=256.0,
        rope_axes_dim=(16, 56, 56), has_image_proj=True, image_proj_dim=1152, has_clean_x_embedder=True).eval()


#: FramePack's frame indices have no batch axis (the pipeline's ``history_sizes = [1, 2, 16]``).
FRAMEPACK_INDICES = ("indices_latents", "indices_latents_clean", "indices_latents_history_2x",
                     "indices_latents_history_4x")


def framepack_history_tokens(grid) -> int:
    """``P``: the history tokens in front of the target's: 2 clean frames at patch (1, 2, 2), 2 frames at
    (2, 4, 4) and 16 at (4, 8, 8), each latent padded to its patch."""
    _, H, W = grid
    return 2 * H * W + math.ceil(H / 2) * math.ceil(W / 2) + 4 * math.ceil(H / 4) * math.ceil(W / 4)


def framepack_inputs(model: nn.Module, batch: int = 2, grid=(2, 4, 4), seed: int = 1, dtype=torch.float32,
                     text: int = 8, t: float = 500.0) -> dict:
    """A vanilla-sampling section: frame indices ``[prefix, 16 x 4x, 2 x 2x, 1 x 1x, T target]``."""
    g = seeded(seed)
    T, H, W = grid
    prefix, history_4x, history_2x, history_1x, target = torch.arange(20 + T).split([1, 16, 2, 1, T])
    latent = lambda frames: torch.randn(batch, 16, frames, 2 * H, 2 * W, generator=g).to(dtype)  # noqa: E731
    return dict(hidden_states=latent(T), timestep=torch.full((batch,), t, dtype=dtype),
                encoder_hidden_states=torch.randn(batch, text, 4096, generator=g).to(dtype),
                encoder_attention_mask=text_mask(batch, text).long(),
                pooled_projections=torch.randn(batch, 768, generator=g).to(dtype),
                image_embeds=torch.randn(batch, 4, 1152, generator=g).to(dtype),
                indices_latents=target, guidance=torch.full((batch,), 10000.0, dtype=dtype),
                latents_clean=latent(2), indices_latents_clean=torch.cat([prefix, history_1x]),
                latents_history_2x=latent(2), indices_latents_history_2x=history_2x,
                latents_history_4x=latent(16), indices_latents_history_4x=history_4x)


# ---------------------------------------------------------------------- LTX-2
def build_ltx2(rope_type: str = "split") -> nn.Module:
    """LTX-2.0's config (128 video and 128 audio latent channels, patch 1, video head dim 128, audio head dim 64,
    Gemma-3 caption width 3840, split RoPE, theta 1e4, VAE scale factors (8, 32, 32), audio scale factor 4) with 2
    video heads (width 256, text cross-attention width 256) and 2 audio heads (width 128, audio cross-attention width
    128) instead of 32 and 32 (4096, 2048), 2 blocks instead of 48."""
    from diffusers import LTX2VideoTransformer3DModel

    torch.manual_seed(0)
    return LTX2VideoTransformer3DModel(
        in_channels=128, out_channels=128, patch_size=1, patch_size_t=1, num_attention_heads=2, attention_head_dim=128,
        cross_attention_dim=256, audio_in_channels=128, audio_out_channels=128, audio_num_attention_heads=2,
        audio_attention_head_dim=64, audio_cross_attention_dim=128, num_layers=2, caption_channels=3840,
        rope_type=rope_type).eval()


LTX2_AUDIO = 6  # audio latent frames of the tests' calls


def ltx2_inputs(model: nn.Module, batch: int = 2, grid=(2, 4, 4), seed: int = 1, dtype=torch.float32,
                text: int = 8, t: float = 500.0) -> dict:
    g = seeded(seed)
    T, H, W = grid
    return dict(hidden_states=torch.randn(batch, T * H * W, 128, generator=g).to(dtype),  # packed [B, N, C]
                audio_hidden_states=torch.randn(batch, LTX2_AUDIO, 128, generator=g).to(dtype),
                encoder_hidden_states=torch.randn(batch, text, 3840, generator=g).to(dtype),
                audio_encoder_hidden_states=torch.randn(batch, text, 3840, generator=g).to(dtype),
                timestep=torch.full((batch,), t, dtype=dtype), encoder_attention_mask=text_mask(batch, text).long(),
                audio_encoder_attention_mask=text_mask(batch, text).long(), num_frames=T, height=H, width=W,
                audio_num_frames=LTX2_AUDIO)


# ---------------------------------------------------------------------- ChronoEdit
def build_chronoedit() -> nn.Module:
    """ChronoEdit-14B's config (Wan2.1-I2V-14B's: 36 input channels, head dim 128, CLIP image width 1280 with added
    k/v projections, UMT5 width 4096; RoPE temporal skip 8) with 2 heads (width 256) instead of 40 (5120), FFN
    13824 * 256 / 5120 = 691, 2 blocks instead of 40."""
    from diffusers import ChronoEditTransformer3DModel

    torch.manual_seed(0)
    return ChronoEditTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=128, in_channels=36, out_channels=16,
        text_dim=4096, freq_dim=256, ffn_dim=691, num_layers=2, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", eps=1e-6, image_dim=1280, added_kv_proj_dim=256,
        rope_temporal_skip_len=8).eval()


def chronoedit_inputs(model: nn.Module, batch: int = 2, grid=(2, 4, 4), seed: int = 1, dtype=torch.float32,
                      text: int = 8, t: float = 500.0) -> dict:
    """Two latent frames (the input image, the edit) take the RoPE's temporal skip."""
    g = seeded(seed)
    T, H, W = grid
    return dict(hidden_states=torch.randn(batch, 36, T, 2 * H, 2 * W, generator=g).to(dtype),
                timestep=torch.full((batch,), t, dtype=dtype),
                encoder_hidden_states=torch.randn(batch, 512, 4096, generator=g).to(dtype),  # the processor's 512
                encoder_hidden_states_image=torch.randn(batch, 9, 1280, generator=g).to(dtype))


# ---------------------------------------------------------------------- Helios
def build_helios(**overrides) -> nn.Module:
    """Helios' config (Wan2.1-T2V-14B's: patch (1, 2, 2), 16 latent channels, head dim 128, UMT5 width 4096; RoPE
    axes (44, 42, 42), the multi-term history patches, the history at timestep 0, guidance cross-attention on the
    target tokens) with 2 heads (width 256) instead of 40 (5120), FFN 13824 * 256 / 5120 = 691, 2 blocks instead
    of 40."""
    from diffusers import HeliosTransformer3DModel

    torch.manual_seed(0)
    return HeliosTransformer3DModel(**{
        **dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=128, in_channels=16, out_channels=16,
               text_dim=4096, freq_dim=256, ffn_dim=691, num_layers=2, cross_attn_norm=True,
               qk_norm="rms_norm_across_heads", eps=1e-6, rope_dim=(44, 42, 42), guidance_cross_attn=True,
               zero_history_timestep=True, has_multi_term_memory_patch=True, is_amplify_history=False),
        **overrides}).eval()


#: Helios's frame indices are shared by the batch (``[1, F]``).
HELIOS_INDICES = ("indices_hidden_states", "indices_latents_history_short", "indices_latents_history_mid",
                  "indices_latents_history_long")


def helios_inputs(model: nn.Module, batch: int = 2, grid=(2, 4, 4), seed: int = 1, dtype=torch.float32,
                  text: int = 8, t: float = 500.0) -> dict:
    """A chunk with the first frame kept (the pipeline's ``history_sizes = [16, 2, 1]``): frame indices
    ``[prefix, 16 long, 2 mid, 1 short, T target]``, the short history the prefix and the last frame."""
    g = seeded(seed)
    T, H, W = grid
    prefix, long, mid, short, target = torch.arange(20 + T).split([1, 16, 2, 1, T])
    latent = lambda frames: torch.randn(batch, 16, frames, 2 * H, 2 * W, generator=g).to(dtype)  # noqa: E731
    return dict(hidden_states=latent(T), timestep=torch.full((batch,), t, dtype=dtype),
                encoder_hidden_states=torch.randn(batch, text, 4096, generator=g).to(dtype),
                indices_hidden_states=target[None], indices_latents_history_short=torch.cat([prefix, short])[None],
                indices_latents_history_mid=mid[None], indices_latents_history_long=long[None],
                latents_history_short=latent(2), latents_history_mid=latent(2), latents_history_long=latent(16))


# ---------------------------------------------------------------------- Kandinsky 5
def build_kandinsky5() -> nn.Module:
    """Kandinsky-5.0-T2V-Lite's config (16 latent channels with the condition and mask channels, patch (1, 2, 2),
    RoPE axes (16, 24, 24): head dim 64, time width 512, Qwen2.5-VL text width 3584, CLIP pooled 768, regular
    attention) with 2 heads (width 128) instead of 28 (1792), the FFN scaled with the width (7168 * 128 / 1792 =
    512), 1 text block and 2 video blocks instead of 2 and 32. The modulations, zero-initialised (every gate 0: each
    block the identity), get random weights too."""
    from diffusers import Kandinsky5Transformer3DModel

    torch.manual_seed(0)
    model = Kandinsky5Transformer3DModel(
        in_visual_dim=16, in_text_dim=3584, in_text_dim2=768, time_dim=512, out_visual_dim=16, patch_size=(1, 2, 2),
        model_dim=128, ff_dim=512, num_text_blocks=1, num_visual_blocks=2, axes_dims=(16, 24, 24), visual_cond=True,
        attention_type="regular").eval()
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.endswith("modulation"):
                nn.init.normal_(module.out_layer.weight, std=0.02)
                nn.init.normal_(module.out_layer.bias, std=0.2)
    return model


#: Kandinsky's rope positions have no batch axis.
KANDINSKY5_POSITIONS = ("visual_rope_pos", "text_rope_pos")


def kandinsky5_inputs(model: nn.Module, batch: int = 2, grid=(2, 4, 4), seed: int = 1, dtype=torch.float32,
                      text: int = 8, t: float = 500.0) -> dict:
    """The channels-last latent ``[B, F, H, W, 2 * 16 + 1]`` and the pipeline's RoPE positions."""
    g = seeded(seed)
    T, H, W = grid
    return dict(hidden_states=torch.randn(batch, T, 2 * H, 2 * W, 33, generator=g).to(dtype),
                encoder_hidden_states=torch.randn(batch, text, 3584, generator=g).to(dtype),
                timestep=torch.full((batch,), t, dtype=dtype),
                pooled_projections=torch.randn(batch, 768, generator=g).to(dtype),
                visual_rope_pos=(torch.arange(T), torch.arange(H), torch.arange(W)), text_rope_pos=torch.arange(text))


# ---------------------------------------------------------------------- Kandinsky 6
def build_kandinsky6() -> nn.Module:
    """Kandinsky 6's config (the class defaults: 16 latent channels with the condition and mask channels, patch
    (1, 2, 2), RoPE axes (32, 48, 48): head dim 128, time width 1024, Qwen2.5-VL text width 3584, CLIP pooled 768,
    20 audio latent channels, the audio stream as wide as the video's; with the released checkpoints'
    ``text_token_padding``, ``ca_rope``, ``cross_gates``, ``fix_modulation`` and the two token types that
    image-to-video needs) with 2 heads (width 256) instead of 32 (4096) in both streams, the FFN scaled with the
    width (16384 * 256 / 4096 = 1024), 1 text block per branch and 2 fused blocks instead of 4 and 60."""
    from diffusers import Kandinsky6Transformer3DModel

    torch.manual_seed(0)
    return Kandinsky6Transformer3DModel(
        in_visual_dim=16, out_visual_dim=16, in_text_dim=3584, in_text_dim2=768, time_dim=1024, patch_size=(1, 2, 2),
        model_dim=256, ff_dim=1024, num_text_blocks=1, num_visual_blocks=2, axes_dims=(32, 48, 48), visual_cond=True,
        in_audio_dim=20, out_audio_dim=20, text_token_padding=True, ca_rope=True, cross_gates=True,
        fix_modulation=True, visual_token_type_num_embeddings=2).eval()


KANDINSKY6_AUDIO = 6  # audio latent frames of the tests' calls


#: Kandinsky 6's rope positions have no batch axis.
KANDINSKY6_POSITIONS = ("visual_rope_pos",)


def kandinsky6_inputs(model: nn.Module, batch: int = 2, grid=(2, 4, 4), seed: int = 1, dtype=torch.float32,
                      text: int = 8, t: float = 500.0, reference: bool = True, audio: bool = True) -> dict:
    """Image-to-video with audio, as the pipeline calls it: the ``T`` generated frames and the appended reference
    frame (token type 1, temporal RoPE position 0) in the channels-last latent ``[B, T + 1, H, W, 2 * 16 + 1]``,
    audio latents ``[B, Na, 20]``, a shorter second prompt (its padding masked). ``reference=False``: text-to-video
    (``T`` frames, no type ids, default positions); ``audio=False``: a video-only call."""
    g = seeded(seed)
    T, H, W = grid
    frames = T + 1 if reference else T
    inputs = dict(hidden_states=torch.randn(batch, frames, 2 * H, 2 * W, 33, generator=g).to(dtype),
                  encoder_hidden_states=torch.randn(batch, text, 3584, generator=g).to(dtype),
                  pooled_projections=torch.randn(batch, 768, generator=g).to(dtype),
                  timestep=torch.full((batch,), t, dtype=dtype),
                  encoder_attention_mask=text_mask(batch, text))
    if audio:
        inputs["audio_hidden_states"] = torch.randn(batch, KANDINSKY6_AUDIO, 20, generator=g).to(dtype)
    if reference:
        token_types = torch.zeros(batch, frames, dtype=torch.long)
        token_types[:, -1] = 1  # [B, T + 1]: the reference frame
        inputs.update(visual_token_type_ids=token_types,
                      visual_rope_pos=(torch.cat([torch.arange(T), torch.zeros(1, dtype=torch.long)]), torch.arange(H),
                                       torch.arange(W)))
    return inputs


# ---------------------------------------------------------------------- families whose blocks return (video, audio)
def audio_video_trajectory(model: nn.Module, inputs: dict, blocks: list[nn.Module], streams_of: Callable,
                           schedule: str | None = None, **options) -> tuple[list[tuple], list[list[tuple]]]:
    """Three steps of a model whose blocks return ``(video, audio)`` (the timestep falling by 20% a step), plain or
    under ``schedule``: the ``(sample, audio_sample)`` outputs per step, and per step and block the block's
    ``(input streams, output streams)``, ``streams_of(args, kwargs)`` giving its input ``(video, audio)``."""
    io: list[list[tuple]] = []  # per step, per block

    def capture(module: nn.Module, args: tuple, kwargs: dict, output: tuple) -> None:
        io[-1].append((streams_of(args, kwargs), output))

    hooks = [b.register_forward_hook(capture, with_kwargs=True) for b in blocks]
    handle = tomerge.apply(model, schedule, num_steps=3, **options) if schedule else None
    outs = []
    try:
        for step in range(3):
            io.append([])
            with torch.no_grad():
                out = model(**dict(inputs, timestep=inputs["timestep"] * (1 - 0.2 * step)))
            outs.append((out.sample, out.audio_sample))
    finally:
        if handle:
            handle.remove()
        for h in hooks:
            h.remove()
    return outs, io


# ---------------------------------------------------------------------- the rows
_VIDEO = ("tomesd", "ssm")  # the contract's strategies of the first video families
_HUNYUAN = ("transformer_blocks", "single_transformer_blocks")

VIDEO_FAMILIES = {
    "wan": Family("wan", build_wan, wan_inputs, ("blocks",), ("wan", "wan"), (2, 4, 4), (1, 4, 4), (3, 5, 7),
                  strategies=_VIDEO),
    "wan_i2v": Family("wan", build_wan_i2v, wan_inputs, ("blocks",), ("wan", "wan"), (2, 4, 4), (1, 4, 4), (3, 5, 7),
                      strategies=_VIDEO),
    "hunyuan_video": Family("hunyuan_video", build_hunyuan_video, hunyuan_video_inputs, _HUNYUAN, ("double", "single"),
                            (2, 4, 4), (1, 4, 4), (3, 5, 7), strategies=_VIDEO,
                            joint=JointProbe(_HUNYUAN, text_first=False, masked=True)),
    "hunyuan_video15": Family("hunyuan_video15", build_hunyuan_video15, hunyuan_video15_inputs,
                              ("transformer_blocks",), ("double", "double"), (2, 4, 4), (1, 4, 4), (3, 5, 7),
                              strategies=_VIDEO,
                              joint=JointProbe(("transformer_blocks",), text_first=False, masked=True)),
    "ltx": Family("ltx", build_ltx, ltx_inputs, ("transformer_blocks",), ("ltx", "ltx"), (2, 4, 4), (1, 4, 4),
                  (3, 5, 7), strategies=_VIDEO),
    "cogvideox": Family("cogvideox", build_cogvideox, cogvideox_inputs, ("transformer_blocks",),
                        ("cogvideox", "cogvideox"), (2, 4, 4), (1, 4, 4), (3, 5, 7),
                        joint=JointProbe(("transformer_blocks",), "attn1", text_first=True, masked=False)),
    "cogvideox2b": Family("cogvideox", build_cogvideox2b, cogvideox_inputs, ("transformer_blocks",),
                          ("cogvideox", "cogvideox"), (2, 4, 4), (1, 4, 4), (3, 5, 7), rope=False),
    "cogvideox15_i2v": Family("cogvideox", build_cogvideox15_i2v, cogvideox_inputs, ("transformer_blocks",),
                              ("cogvideox", "cogvideox"), (2, 4, 4), (1, 4, 4), (3, 5, 7),
                              joint=JointProbe(("transformer_blocks",), "attn1", text_first=True, masked=False)),
    "consisid": Family("consisid", build_consisid, consisid_inputs, ("transformer_blocks",),
                       ("cogvideox", "cogvideox"), (2, 4, 4), (1, 4, 4), (3, 5, 7),
                       batch="its face features are a list per ViT scale, which the per-sample split cannot cut "
                             "(cogvideox checks the same blocks)",
                       joint=JointProbe(("transformer_blocks",), "attn1", text_first=True, masked=False)),
    "mochi": Family("mochi", build_mochi, mochi_inputs, ("transformer_blocks",), ("mochi", "mochi"), (2, 4, 4),
                    (1, 4, 4), (3, 5, 7), rising=True),
    "allegro": Family("allegro", build_allegro, allegro_inputs, ("transformer_blocks",), ("allegro", "allegro"),
                      (2, 4, 4), (1, 4, 4), (3, 5, 7)),
    "easyanimate": Family("easyanimate", build_easyanimate, easyanimate_inputs, ("transformer_blocks",),
                          ("easyanimate", "easyanimate"), (2, 4, 4), (1, 4, 4), (3, 5, 7),
                          joint=JointProbe(("transformer_blocks",), "attn1", text_first=True, masked=False)),
    "easyanimate_inp": Family("easyanimate", build_easyanimate_inp, easyanimate_inputs, ("transformer_blocks",),
                              ("easyanimate", "easyanimate"), (2, 4, 4), (1, 4, 4), (3, 5, 7)),
    "latte": Family("latte", build_latte, latte_inputs, ("transformer_blocks",), ("spatial", "spatial"), (4, 4),
                    (4, 2), (5, 7), rope=False),
    "cosmos": Family("cosmos", build_cosmos, cosmos_inputs, ("transformer_blocks",), ("cosmos", "cosmos"),
                     (2, 4, 4), (1, 4, 4), (3, 5, 7),
                     batch="its learnable positions compute their norm in float32 (diffusers keeps the module in fp32) "
                           "and cannot run in float64 (cosmos2_video2world checks the same adapter)"),
    # Cosmos Video2World's adaLN-LoRA modulation of the per-frame timestep embeddings ([B, N, C], computed in each
    # norm before the merge points) runs on every token whatever is merged.
    "cosmos2_video2world": Family("cosmos", build_cosmos2_video2world, cosmos_inputs, ("transformer_blocks",),
                                  ("cosmos", "cosmos"), (2, 4, 4), (1, 4, 4), (3, 5, 7),
                                  full_length=("norm1", "norm2", "norm3"), full_length_per_token=True),
    # SANA-Video's depthwise and temporal convolutions mix neighbouring tokens and frames: at full length.
    "sana_video": Family("sana_video", build_sana_video, sana_video_inputs, ("transformer_blocks",),
                         ("sana_video", "sana_video"), (2, 4, 4), (1, 4, 4), (3, 5, 7),
                         full_length=("ff.conv_depth", "ff.conv_temp"), full_length_per_token=True),
    "skyreels_v2": Family("skyreels_v2", build_skyreels_v2, skyreels_v2_inputs, ("blocks",),
                          ("skyreels_v2", "skyreels_v2"), (2, 4, 4), (1, 4, 4), (3, 5, 7)),
    "wan_vace": Family("wan_vace", build_wan_vace, wan_vace_inputs, ("vace_blocks", "blocks"),
                       ("vace", "vace", "wan", "wan"), (2, 4, 4), (1, 4, 4), (3, 5, 7)),
    "wan_animate": Family("wan_animate", build_wan_animate, wan_animate_inputs, ("blocks",), ("wan", "wan"),
                          (2, 4, 4), (2, 4, 2), (3, 5, 7)),
    "framepack": Family("framepack", build_framepack, framepack_inputs, _HUNYUAN, ("double", "single"), (2, 4, 4),
                        (1, 4, 4), (3, 5, 7), select=sharing(*FRAMEPACK_INDICES)),
    # LTX-2's video_to_audio_attn (audio queries, video keys) reads the full-length video stream.
    "ltx2": Family("ltx2", build_ltx2, ltx2_inputs, ("transformer_blocks",), ("ltx2", "ltx2"), (2, 4, 4), (1, 4, 4),
                   (3, 5, 7), full_length=("video_to_audio_attn",)),
    "chronoedit": Family("chronoedit", build_chronoedit, chronoedit_inputs, ("blocks",), ("wan", "wan"), (2, 4, 4),
                         (1, 4, 4), (3, 5, 7)),
    "helios": Family("helios", build_helios, helios_inputs, ("blocks",), ("helios", "helios"), (2, 4, 4), (1, 4, 4),
                     (3, 5, 7), select=sharing(*HELIOS_INDICES)),
    "kandinsky5": Family("kandinsky5", build_kandinsky5, kandinsky5_inputs, ("visual_transformer_blocks",),
                         ("kandinsky5", "kandinsky5"), (2, 4, 4), (1, 4, 4), (3, 5, 7),
                         select=sharing(*KANDINSKY5_POSITIONS),
                         batch="Kandinsky 5 is not batch-invariant itself "
                               "(test_kandinsky5.py::test_kandinsky5_batch_plans_are_its_samples_plans)"),
    # Kandinsky 6's av_cross_attention (audio queries, video keys) reads the full-length video stream.
    "kandinsky6": Family("kandinsky6", build_kandinsky6, kandinsky6_inputs, ("visual_transformer_blocks",),
                         ("kandinsky6", "kandinsky6"), (2, 4, 4), (1, 4, 4), (3, 5, 7),
                         select=sharing(*KANDINSKY6_POSITIONS), full_length=("av_cross_attention",)),
}
