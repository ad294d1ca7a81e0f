"""More declared video adapters: `cogvideox` (CogVideoX 1.0 / 1.5, text- and image-to-video), `consisid`
(ConsisID, identity-preserving CogVideoX), `mochi` (Mochi 1), `allegro` (Allegro), `easyanimate` (EasyAnimate
V5.1, text-to-video and inpainting), `latte` (Latte, its spatial blocks merged per frame), `cosmos` (Cosmos 1.0
Text2World, Predict2 Video2World) and `sana_video` (SANA-Video).

Each family is a random-weight diffusers model built from its released configuration with fewer heads and 1-2
blocks of each kind (see each builder), on tiny frames x height x width token grids (Latte: one frame's grid).
The checks are those of ``test_backbones_video.py`` (the helpers of ``test_backbones_current.py``), the
families' specifics (Mochi's rising timesteps, EasyAnimate's feed-forward shared with the text stream, the
rotary layouts Mochi and Allegro brought, Cosmos' step counting, the parts of Cosmos Video2World and SANA-Video
blocks that stay at full length) and the joint-attention probes against the models' own attention.
``tests/test_every_strategy.py`` runs every registered strategy and schedule on one configuration per adapter
(``ADAPTER_FAMILIES``).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import types

import pytest
import torch
from torch import nn

import tomerge
from tomerge.backbones._gather import gather_rope
from tomerge.registry import backbone_class
from test_backbones_current import (ALL_SUBLAYERS, Family, Permute, check_batch_equals_samples,
                                    check_inference_mode, check_flops,
                                    check_odd_grid_merges, check_permutation_is_exact, run)


# Mochi's RoPE runs under torch.autocast(float32), which diffusers calls on the CPU too.
pytestmark = pytest.mark.filterwarnings("ignore:In CPU autocast, but the target dtype is not supported")


def _seed(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _text_mask(batch: int, text: int) -> torch.Tensor:
    """``[B, T]``: the first prompt fills the text, the others are 3 tokens shorter (padding masked)."""
    mask = torch.ones(batch, text, dtype=torch.long)
    mask[1:, text - 3:] = 0
    return mask


# ---------------------------------------------------------------------- CogVideoX
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
    g = _seed(seed)
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
    g = _seed(seed)
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
        model.pos_frequencies.normal_(generator=_seed(0))  # [3, heads, d/2]
    return model


MOCHI_TEXT_WIDTH = 256


def mochi_inputs(model: nn.Module, batch: int = 2, grid=(2, 4, 4), seed: int = 1, dtype=torch.float32,
                 text: int = 8) -> dict:
    g = _seed(seed)
    T, H, W = grid
    return dict(hidden_states=torch.randn(batch, 12, T, 2 * H, 2 * W, generator=g).to(dtype),
                encoder_hidden_states=torch.randn(batch, text, MOCHI_TEXT_WIDTH, generator=g).to(dtype),
                timestep=torch.full((batch,), 500.0, dtype=dtype), encoder_attention_mask=_text_mask(batch, text))


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

    g = _seed(seed)
    T, H, W = grid
    pipe = types.SimpleNamespace(transformer=model, vae_scale_factor_spatial=8)
    rope = AllegroPipeline._prepare_rotary_positional_embeddings(pipe, batch, 16 * H, 16 * W, T, torch.device("cpu"))
    return dict(hidden_states=torch.randn(batch, 4, T, 2 * H, 2 * W, generator=g).to(dtype),
                encoder_hidden_states=torch.randn(batch, text, 4096, generator=g).to(dtype),
                timestep=torch.full((batch,), 500, dtype=torch.long), encoder_attention_mask=_text_mask(batch, text),
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
    g = _seed(seed)
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
    g = _seed(seed)
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
    g = _seed(seed)
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
    g = _seed(seed)
    T, H, W = grid
    return dict(hidden_states=torch.randn(batch, 16, T, 2 * H, 2 * W, generator=g).to(dtype),
                encoder_hidden_states=torch.randn(batch, text, 2304, generator=g).to(dtype),
                timestep=torch.full((batch,), 500.0, dtype=dtype), encoder_attention_mask=_text_mask(batch, text))


FAMILIES = {
    "cogvideox": Family("cogvideox", build_cogvideox, cogvideox_inputs, ("transformer_blocks",),
                        ("cogvideox", "cogvideox"), (2, 4, 4), (1, 4, 4), (3, 5, 7)),
    "cogvideox2b": Family("cogvideox", build_cogvideox2b, cogvideox_inputs, ("transformer_blocks",),
                          ("cogvideox", "cogvideox"), (2, 4, 4), (1, 4, 4), (3, 5, 7), rope=False),
    "cogvideox15_i2v": Family("cogvideox", build_cogvideox15_i2v, cogvideox_inputs, ("transformer_blocks",),
                              ("cogvideox", "cogvideox"), (2, 4, 4), (1, 4, 4), (3, 5, 7)),
    "consisid": Family("consisid", build_consisid, consisid_inputs, ("transformer_blocks",),
                       ("cogvideox", "cogvideox"), (2, 4, 4), (1, 4, 4), (3, 5, 7)),
    "mochi": Family("mochi", build_mochi, mochi_inputs, ("transformer_blocks",), ("mochi", "mochi"), (2, 4, 4),
                    (1, 4, 4), (3, 5, 7)),
    "allegro": Family("allegro", build_allegro, allegro_inputs, ("transformer_blocks",), ("allegro", "allegro"),
                      (2, 4, 4), (1, 4, 4), (3, 5, 7)),
    "easyanimate": Family("easyanimate", build_easyanimate, easyanimate_inputs, ("transformer_blocks",),
                          ("easyanimate", "easyanimate"), (2, 4, 4), (1, 4, 4), (3, 5, 7)),
    "easyanimate_inp": Family("easyanimate", build_easyanimate_inp, easyanimate_inputs, ("transformer_blocks",),
                              ("easyanimate", "easyanimate"), (2, 4, 4), (1, 4, 4), (3, 5, 7)),
    "latte": Family("latte", build_latte, latte_inputs, ("transformer_blocks",), ("spatial", "spatial"), (4, 4),
                    (4, 2), (5, 7), rope=False),
    "cosmos": Family("cosmos", build_cosmos, cosmos_inputs, ("transformer_blocks",), ("cosmos", "cosmos"),
                     (2, 4, 4), (1, 4, 4), (3, 5, 7)),
    "cosmos2_video2world": Family("cosmos", build_cosmos2_video2world, cosmos_inputs, ("transformer_blocks",),
                                  ("cosmos", "cosmos"), (2, 4, 4), (1, 4, 4), (3, 5, 7)),
    "sana_video": Family("sana_video", build_sana_video, sana_video_inputs, ("transformer_blocks",),
                         ("sana_video", "sana_video"), (2, 4, 4), (1, 4, 4), (3, 5, 7)),
}


@pytest.fixture(scope="module")
def models() -> dict[str, nn.Module]:
    return {name: family.build() for name, family in FAMILIES.items()}


# ---------------------------------------------------------------------- every family
@pytest.mark.parametrize("name", FAMILIES)
def test_finds_the_transformer_and_its_blocks_in_order(models, name):
    family, model = FAMILIES[name], models[name]
    with tomerge.merging(types.SimpleNamespace(transformer=model), "tomesd", ratio=0.5) as handle:
        assert handle.model is model and handle.adapter.name == family.backbone
        assert handle.adapter.grid_dims == len(family.grid)  # (T, H, W); Latte: one frame's (H, W)
        specs = handle.adapter.blocks()
        assert [s.kind for s in specs] == list(family.kinds)
        assert [s.module for s in specs] == [b for c in family.containers for b in getattr(model, c)]


@pytest.mark.parametrize("name", FAMILIES)
def test_half_ratio_is_finite_right_shape_and_merges_the_video_grid(models, name):
    family, model = FAMILIES[name], models[name]
    inputs = family.inputs(model)
    before = run(model, inputs)
    with tomerge.merging(model, "ssm", ratio=0.5, round_windows=1, **ALL_SUBLAYERS) as handle:
        out = run(model, inputs)
        assert handle.adapter.grid_size == family.grid
        records = handle.state.records
    assert out.shape == before.shape and torch.isfinite(out).all()
    assert [r.block_kind for r in records] == list(family.kinds) and all(r.num_removed > 0 for r in records)


# Submodules of the blocks that run on every token whatever is merged: Cosmos Video2World's adaLN-LoRA modulation
# of the per-frame timestep embeddings ([B, N, C], computed in each norm before the merge points), SANA-Video's
# depthwise and temporal convolutions (they mix neighbouring tokens and frames).
FULL_LENGTH_PARTS = {"cosmos2_video2world": ("norm1", "norm2", "norm3"), "sana_video": ("ff.conv_depth", "ff.conv_temp")}


def block_flops(model: nn.Module, inputs: dict, family: Family, parts: tuple[str, ...]) -> tuple[int, int]:
    """``(parts, the rest)``: FLOPs of one call in the blocks' submodules ``parts`` and in the rest of the blocks."""
    from tomerge.experiments.measure.flops import FlopCounter

    counter = FlopCounter()
    with counter:
        run(model, inputs)
    counts = {name: sum(ops.values()) for name, ops in counter.get_flop_counts().items()}
    blocks = [f"{type(model).__name__}.{c}.{i}" for c in family.containers for i in range(len(getattr(model, c)))]
    in_parts = sum(counts.get(f"{block}.{part}", 0) for block in blocks for part in parts)
    return in_parts, sum(counts[block] for block in blocks) - in_parts


@pytest.mark.parametrize("name", FAMILIES)
def test_half_ratio_blocks_cost_what_half_the_tokens_cost(models, name):
    """``check_flops``; in the families with ``FULL_LENGTH_PARTS``: those parts cost what they cost unmerged
    (and twice what they cost on half the tokens: they are per token), the rest of the blocks what half the
    tokens cost (plus tomesd's similarity matmuls: at most 5%)."""
    family, model = FAMILIES[name], models[name]
    if name not in FULL_LENGTH_PARTS:
        check_flops(model, family, name)
        return
    parts = FULL_LENGTH_PARTS[name]
    full = block_flops(model, family.inputs(model), family, parts)
    half = block_flops(model, family.inputs(model, grid=family.half), family, parts)
    with tomerge.merging(model, "tomesd", ratio=0.5, use_rand=False, **ALL_SUBLAYERS) as handle:
        merged = block_flops(model, family.inputs(model), family, parts)
        assert all(r.num_removed == math.prod(family.grid) // 2 for r in handle.state.records)
    assert full[0] == 2 * half[0] > 0 and merged[0] == full[0]
    assert half[1] <= merged[1] <= 1.05 * half[1], (merged, half)


@pytest.mark.parametrize("name", FAMILIES)
def test_permuted_slots_give_the_unpatched_output(models, name, monkeypatch):
    """Exact only if every slot carries its token's 3-D RoPE position; the control (without the RoPE gather the
    same permutation changes the output) shows that positions matter in the families with RoPE."""
    family, model = FAMILIES[name], models[name]
    for grid in (family.grid, family.odd):
        check_permutation_is_exact(model, family.inputs(model, grid=grid, seed=4), None, math.prod(grid))
    if not family.rope:
        return
    inputs = family.inputs(model, seed=4)
    before = run(model, inputs)
    adapter = backbone_class(family.backbone)
    kinds = tuple(dataclasses.replace(k, sites=tuple(dataclasses.replace(s, rope=None) for s in k.sites))
                  for k in adapter.kinds)
    monkeypatch.setattr(adapter, "kinds", kinds)
    with tomerge.merging(model, Permute(), ratio=0.5, **ALL_SUBLAYERS):
        assert (run(model, inputs) - before).abs().max() > 1e-3


@pytest.mark.tie_sensitive
# Not Cosmos 1.0: its learnable positions compute their norm in float32 (diffusers keeps the module in fp32) and
# cannot run in float64; cosmos2_video2world checks the same adapter. Not ConsisID: its face features are a list
# per ViT scale, which the per-sample split cannot cut (cogvideox checks the same blocks).
@pytest.mark.parametrize("name", [name for name in FAMILIES if name not in ("cosmos", "consisid")])
def test_a_batch_equals_its_samples_alone(models, name):
    family, model = FAMILIES[name], models[name]
    check_batch_equals_samples(model, family.inputs(model, seed=5))


@pytest.mark.parametrize("name", FAMILIES)
def test_grids_with_leftover_rows_and_frames_merge(models, name):
    check_odd_grid_merges(models[name], FAMILIES[name])


@pytest.mark.parametrize("name", FAMILIES)
def test_merging_runs_under_inference_mode(models, name):
    check_inference_mode(models[name], FAMILIES[name].inputs(models[name]))


# ---------------------------------------------------------------------- family specifics
def test_mochi_rising_timesteps_advance_one_trajectory(models):
    """Mochi's pipeline calls the model with t rising from noise to data (inverted sigmas): the adapter reports
    1000 - t, so the calls of one sampling run are steps 0, 1, 2 of one trajectory, found in the scheduler's
    schedule (mapped the same way) and, without a scheduler, by the order of the calls."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    model = models["mochi"]
    scheduler = FlowMatchEulerDiscreteScheduler(invert_sigmas=True)
    scheduler.set_timesteps(sigmas=[1.0, 0.6, 0.3])
    rising = scheduler.timesteps.tolist()
    assert rising == sorted(rising) and rising[0] < 500 < rising[-1]
    for target in (types.SimpleNamespace(transformer=model, scheduler=scheduler), model):
        with tomerge.merging(target, "tomesd", ratio=0.5, use_rand=False) as handle:
            for t in rising:
                run(model, dict(mochi_inputs(model), timestep=torch.full((2,), t)))
            clock = handle.state.clock
            assert [r.step for r in handle.state.records] == [0, 0, 1, 1, 2, 2]
            assert clock.trajectory == 1 and clock.progress == pytest.approx(1.0 if target is not model else
                                                                             rising[-1] / 1000)


def test_easyanimate_shared_ff_merges_the_video_call_and_passes_the_text_call(models):
    """EasyAnimate's blocks without text projections call ``ff`` twice, on the video stream, then on the text
    stream: the first call runs on the merged video tokens, the second on the whole text (the permutation test
    shows that the unmerge of the first is exact)."""
    model = models["easyanimate"]
    assert model.transformer_blocks[0].txt_ff is not None and model.transformer_blocks[1].txt_ff is None
    seen: dict[int, list[int]] = {0: [], 1: []}
    with tomerge.merging(model, "tomesd", ratio=0.5, use_rand=False, merge_attn=False, merge_mlp=True):
        hooks = [block.ff.register_forward_pre_hook(lambda m, args, i=i: seen[i].append(args[0].shape[1]))
                 for i, block in enumerate(model.transformer_blocks)]  # after tomerge's hooks
        try:
            out = run(model, easyanimate_inputs(model))
        finally:
            for h in hooks:
                h.remove()
    assert torch.isfinite(out).all()
    assert seen == {0: [16], 1: [16, 8]}  # merged video (32 -> 16), then the 8 text tokens unmerged


def test_latte_merges_each_frame_of_its_spatial_blocks_and_leaves_the_temporal_blocks_at_full_length(models):
    model = models["latte"]
    seen: dict[str, list[tuple[int, ...]]] = {"spatial": [], "temporal": []}
    with tomerge.merging(model, "tomesd", ratio=0.5, use_rand=False, **ALL_SUBLAYERS) as handle:
        hooks = [model.transformer_blocks[0].attn1.register_forward_pre_hook(  # after tomerge's hooks
                     lambda m, args: seen["spatial"].append(tuple(args[0].shape[:2]))),
                 model.temporal_transformer_blocks[0].register_forward_pre_hook(
                     lambda m, args: seen["temporal"].append(tuple(args[0].shape[:2])))]
        try:
            run(model, latte_inputs(model))
        finally:
            for h in hooks:
                h.remove()
        assert [r.num_tokens for r in handle.state.records] == [16, 16]
    assert seen == {"spatial": [(2 * LATTE_FRAMES, 8)], "temporal": [(2 * 16, LATTE_FRAMES)]}


def test_gather_rope_broadcast_and_allegro_layouts_match_hand_built_tables():
    dst = torch.tensor([[2, 0], [1, 1]])  # [B=2, M=2]
    table = torch.arange(3.0).view(3, 1, 1).expand(3, 2, 4)  # Mochi's [N=3, heads, d/2], no batch axis
    cos, _ = gather_rope((table, table), dst, 3, "broadcast")
    assert cos.shape == (2, 2, 2, 4) and torch.equal(cos[..., 0, 0], torch.tensor([[2.0, 0], [1, 1]]))
    shared, _ = gather_rope((table, table), dst[:1], 3, "broadcast")
    assert shared.shape == (2, 2, 4) and torch.equal(shared[:, 0, 0], torch.tensor([2.0, 0]))
    single = torch.arange(3.0).view(3, 1, 1, 1, 1).expand(3, 1, 4, 2, 2)  # Kandinsky 6's one [N, 1, d/2, 2, 2] table
    rotations = gather_rope(single, dst, 3, "broadcast")
    assert rotations.shape == (2, 2, 1, 4, 2, 2)  # [B, M, 1, d/2, 2, 2]
    assert torch.equal(rotations[:, :, 0, 0, 0, 0], torch.tensor([[2.0, 0], [1, 1]]))
    assert gather_rope(single, dst[:1], 3, "broadcast").shape == (2, 1, 4, 2, 2)
    tables = ((torch.zeros(5, 2),) * 2,) * 3  # per-axis (cos, sin), kept as they are
    ids = (torch.tensor([[0, 0, 1]]), torch.tensor([[0, 1, 0]]), torch.tensor([[4, 5, 6]]))  # (t, h, w) [1, N]
    kept, (t, h, w) = gather_rope((tables, ids), dst, 3, "allegro")
    assert kept is tables
    assert (t.tolist(), h.tolist(), w.tolist()) == ([[1, 0], [0, 0]], [[0, 0], [1, 1]], [[6, 4], [5, 5]])
    _, (t1, _, w1) = gather_rope((tables, ids), dst[:1], 3, "allegro")
    assert (t1.tolist(), w1.tolist()) == ([[1, 0]], [[6, 4]])
    with pytest.raises(ValueError, match="broadcast"):
        gather_rope((table[:2], table[:2]), dst, 3, "broadcast")
    with pytest.raises(ValueError, match="position ids"):
        gather_rope((tables, tuple(i[:, :2] for i in ids)), dst, 3, "allegro")


def test_cosmos_counts_the_steps_in_call_order(models):
    """Cosmos Predict2 is called with sigma / (sigma + 1), not with its scheduler's timesteps (sigma * 1000): the
    steps of a run are counted in call order, the same with and without the pipeline's scheduler (looking the
    calls up in the schedule would put the first two calls on step 0: 0.83 is nearer 1.0 than 0.5)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    model = models["cosmos2_video2world"]
    scheduler = FlowMatchEulerDiscreteScheduler()
    scheduler.set_timesteps(3)
    assert [round(t) for t in scheduler.timesteps.tolist()] == [1000, 501, 1]
    for target in (types.SimpleNamespace(transformer=model, scheduler=scheduler), model):
        with tomerge.merging(target, "tomesd", ratio=0.5, use_rand=False) as handle:
            for sigma in (80.0, 5.0, 0.5):
                inputs = cosmos_inputs(model)
                run(model, dict(inputs, timestep=torch.full_like(inputs["timestep"], sigma / (sigma + 1))))
            assert [r.step for r in handle.state.records] == [0, 0, 1, 1, 2, 2]
            assert handle.state.clock.trajectory == 1


# ---------------------------------------------------------------------- received attention in joint attention
def _attn1(model: nn.Module) -> dict[int, nn.Module]:
    return {layer: block.attn1 for layer, block in enumerate(model.transformer_blocks)}


@pytest.mark.parametrize("name", ["cogvideox", "cogvideox15_i2v", "consisid", "easyanimate"])
def test_joint_probe_equals_the_models_attention(models, name):
    """float64, against each block's own SDPA call (``test_probes.check_probe_matches_the_model``): CogVideoX
    projects the joint [text, video] sequence at once, normalises q/k as [B, heads, L, d] and rotates the video
    rows only; EasyAnimate's first block has its own text projections, its second projects the joint sequence."""
    from test_probes import check_probe_matches_the_model

    family, model = FAMILIES[name], models[name]
    check_probe_matches_the_model(model, family.inputs(model), _attn1, math.prod(family.grid), text_first=True,
                                  masked=False)


def test_mochi_joint_probe_equals_the_models_attention(models):
    """float64: Mochi attends per sample over [video, the prompt's valid text tokens] (one SDPA call per sample,
    no mask: the padding is cut out) with its pairwise RoPE on the video q/k; the recorded received attention
    equals the probe's rule computed from those calls (the second prompt is 3 tokens shorter, so its padded
    text tokens are neither queries nor keys)."""
    from test_probes import record_sdpa, reference_received_attention

    model = copy.deepcopy(models["mochi"]).double()
    inputs = {k: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v
              for k, v in mochi_inputs(model).items()}
    seen, hooks = record_sdpa(_attn1(model))
    try:
        with tomerge.merging(model, "idm", ratio=0.5) as handle, torch.no_grad():
            model(**inputs)
            recorded = dict(handle.state.attention)
    finally:
        for hook in hooks:
            hook.remove()
    assert sorted(recorded) == [0, 1]
    for layer, calls in seen.items():
        assert [call["query"].shape[2] for call in calls] == [32 + 8, 32 + 5]  # per sample: video + valid text
        reference = torch.cat([reference_received_attention(call["query"], call["key"], call.get("attn_mask"),
                                                            call.get("scale"), 32, text_first=False)
                               for call in calls])  # [B, N]
        torch.testing.assert_close(recorded[layer].double(), reference, rtol=1e-5, atol=1e-8)
        assert (reference.max(-1).values - reference.min(-1).values > 1e-3).all()  # not uniform: real q/k


# ---------------------------------------------------------------------- every strategy on every family
# One configuration per adapter for tests/test_every_strategy.py, which runs every registered strategy and
# schedule on them (the variants above share the adapter's code and are checked by the family tests).
ADAPTER_FAMILIES = ["cogvideox", "consisid", "mochi", "allegro", "easyanimate", "latte", "cosmos", "sana_video"]


def test_every_adapter_of_this_file_is_in_the_strategy_matrix():
    backbones = [FAMILIES[name].backbone for name in ADAPTER_FAMILIES]
    assert sorted(backbones) == sorted(set(backbones)) == sorted({family.backbone for family in FAMILIES.values()})
