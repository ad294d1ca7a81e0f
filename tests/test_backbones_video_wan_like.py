"""The declared adapters of the Wan-derived, history-conditioned and other current video transformers on
``(T, H, W)`` token grids: `skyreels_v2` (SkyReels-V2, diffusion forcing), `wan_vace` (Wan VACE), `wan_animate`
(Wan 2.2 Animate), `framepack` (HunyuanVideo-FramePack), `ltx2` (LTX-2, video + audio), `chronoedit` (ChronoEdit),
`helios` (Helios), `kandinsky5` (Kandinsky 5.0 video) and `kandinsky6` (Kandinsky 6, video + audio), on
random-weight diffusers models built from their
released configurations with fewer heads and 1-2 blocks of each kind (see each builder). The checks are those of
``test_backbones_video.py`` (the helpers of ``test_backbones_current.py``), every registered strategy and schedule
on every family, and each family's own layout (FramePack's and Helios's history tokens, LTX-2's audio stream,
VACE's hints, SkyReels-V2's block-causal mask, Kandinsky's probe and batch behaviour, Kandinsky 6's audio stream,
reference frame and block cache, LTX-2's block cache). The declaration language's
context tokens and square masks on hand-made cases are in ``test_declared_layouts.py``.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import types
from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn

import tomerge
from tomerge.backbones._declared import DeclaredAdapter
from tomerge.experiments.measure.flops import FlopCounter
from tomerge.registry import backbone_class
from tomerge.schedule import Schedule
from test_backbones_current import (ALL_SUBLAYERS, Family, Permute, check_batch_equals_samples,
                                    check_inference_mode, check_flops,
                                    check_odd_grid_merges, check_permutation_is_exact, flop_counts, no_hooks_left,
                                    run, select, to_float64)
from test_probes import record_sdpa


def _seed(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _text_mask(batch: int, text: int) -> Tensor:
    mask = torch.ones(batch, text, dtype=torch.long)
    mask[1:, text - 3:] = 0  # a shorter second prompt: its padding keys are masked
    return mask


# ---------------------------------------------------------------------- families
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
    g = _seed(seed)
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
    g = _seed(seed)
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
    g = _seed(seed)
    T, H, W = grid
    return dict(hidden_states=torch.randn(batch, 36, T, 2 * H, 2 * W, generator=g).to(dtype),
                timestep=torch.full((batch,), t, dtype=dtype),
                encoder_hidden_states=torch.randn(batch, 512, 4096, generator=g).to(dtype),  # the processor's 512
                encoder_hidden_states_image=torch.randn(batch, 9, 1280, generator=g).to(dtype),
                pose_hidden_states=torch.randn(batch, 16, T - 1, 2 * H, 2 * W, generator=g).to(dtype),
                face_pixel_values=torch.randn(batch, 3, 4 * (T - 2) + 1, 16, 16, generator=g).to(dtype))


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
    g = _seed(seed)
    T, H, W = grid
    prefix, history_4x, history_2x, history_1x, target = torch.arange(20 + T).split([1, 16, 2, 1, T])
    latent = lambda frames: torch.randn(batch, 16, frames, 2 * H, 2 * W, generator=g).to(dtype)  # noqa: E731
    return dict(hidden_states=latent(T), timestep=torch.full((batch,), t, dtype=dtype),
                encoder_hidden_states=torch.randn(batch, text, 4096, generator=g).to(dtype),
                encoder_attention_mask=_text_mask(batch, text),
                pooled_projections=torch.randn(batch, 768, generator=g).to(dtype),
                image_embeds=torch.randn(batch, 4, 1152, generator=g).to(dtype),
                indices_latents=target, guidance=torch.full((batch,), 10000.0, dtype=dtype),
                latents_clean=latent(2), indices_latents_clean=torch.cat([prefix, history_1x]),
                latents_history_2x=latent(2), indices_latents_history_2x=history_2x,
                latents_history_4x=latent(16), indices_latents_history_4x=history_4x)


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
    g = _seed(seed)
    T, H, W = grid
    return dict(hidden_states=torch.randn(batch, T * H * W, 128, generator=g).to(dtype),  # packed [B, N, C]
                audio_hidden_states=torch.randn(batch, LTX2_AUDIO, 128, generator=g).to(dtype),
                encoder_hidden_states=torch.randn(batch, text, 3840, generator=g).to(dtype),
                audio_encoder_hidden_states=torch.randn(batch, text, 3840, generator=g).to(dtype),
                timestep=torch.full((batch,), t, dtype=dtype), encoder_attention_mask=_text_mask(batch, text),
                audio_encoder_attention_mask=_text_mask(batch, text), num_frames=T, height=H, width=W,
                audio_num_frames=LTX2_AUDIO)


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
    g = _seed(seed)
    T, H, W = grid
    return dict(hidden_states=torch.randn(batch, 36, T, 2 * H, 2 * W, generator=g).to(dtype),
                timestep=torch.full((batch,), t, dtype=dtype),
                encoder_hidden_states=torch.randn(batch, 512, 4096, generator=g).to(dtype),  # the processor's 512
                encoder_hidden_states_image=torch.randn(batch, 9, 1280, generator=g).to(dtype))


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
    g = _seed(seed)
    T, H, W = grid
    prefix, long, mid, short, target = torch.arange(20 + T).split([1, 16, 2, 1, T])
    latent = lambda frames: torch.randn(batch, 16, frames, 2 * H, 2 * W, generator=g).to(dtype)  # noqa: E731
    return dict(hidden_states=latent(T), timestep=torch.full((batch,), t, dtype=dtype),
                encoder_hidden_states=torch.randn(batch, text, 4096, generator=g).to(dtype),
                indices_hidden_states=target[None], indices_latents_history_short=torch.cat([prefix, short])[None],
                indices_latents_history_mid=mid[None], indices_latents_history_long=long[None],
                latents_history_short=latent(2), latents_history_mid=latent(2), latents_history_long=latent(16))


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
    g = _seed(seed)
    T, H, W = grid
    return dict(hidden_states=torch.randn(batch, T, 2 * H, 2 * W, 33, generator=g).to(dtype),
                encoder_hidden_states=torch.randn(batch, text, 3584, generator=g).to(dtype),
                timestep=torch.full((batch,), t, dtype=dtype),
                pooled_projections=torch.randn(batch, 768, generator=g).to(dtype),
                visual_rope_pos=(torch.arange(T), torch.arange(H), torch.arange(W)), text_rope_pos=torch.arange(text))


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
    g = _seed(seed)
    T, H, W = grid
    frames = T + 1 if reference else T
    inputs = dict(hidden_states=torch.randn(batch, frames, 2 * H, 2 * W, 33, generator=g).to(dtype),
                  encoder_hidden_states=torch.randn(batch, text, 3584, generator=g).to(dtype),
                  pooled_projections=torch.randn(batch, 768, generator=g).to(dtype),
                  timestep=torch.full((batch,), t, dtype=dtype),
                  encoder_attention_mask=_text_mask(batch, text).bool())
    if audio:
        inputs["audio_hidden_states"] = torch.randn(batch, KANDINSKY6_AUDIO, 20, generator=g).to(dtype)
    if reference:
        token_types = torch.zeros(batch, frames, dtype=torch.long)
        token_types[:, -1] = 1  # [B, T + 1]: the reference frame
        inputs.update(visual_token_type_ids=token_types,
                      visual_rope_pos=(torch.cat([torch.arange(T), torch.zeros(1, dtype=torch.long)]), torch.arange(H),
                                       torch.arange(W)))
    return inputs


FAMILIES = {
    "skyreels_v2": Family("skyreels_v2", build_skyreels_v2, skyreels_v2_inputs, ("blocks",),
                          ("skyreels_v2", "skyreels_v2"), (2, 4, 4), (1, 4, 4), (3, 5, 7)),
    "wan_vace": Family("wan_vace", build_wan_vace, wan_vace_inputs, ("vace_blocks", "blocks"),
                       ("vace", "vace", "wan", "wan"), (2, 4, 4), (1, 4, 4), (3, 5, 7)),
    "wan_animate": Family("wan_animate", build_wan_animate, wan_animate_inputs, ("blocks",), ("wan", "wan"),
                          (2, 4, 4), (2, 4, 2), (3, 5, 7)),
    "framepack": Family("framepack", build_framepack, framepack_inputs,
                        ("transformer_blocks", "single_transformer_blocks"), ("double", "single"), (2, 4, 4),
                        (1, 4, 4), (3, 5, 7)),
    "ltx2": Family("ltx2", build_ltx2, ltx2_inputs, ("transformer_blocks",), ("ltx2", "ltx2"), (2, 4, 4), (1, 4, 4),
                   (3, 5, 7)),
    "chronoedit": Family("chronoedit", build_chronoedit, chronoedit_inputs, ("blocks",), ("wan", "wan"), (2, 4, 4),
                         (1, 4, 4), (3, 5, 7)),
    "helios": Family("helios", build_helios, helios_inputs, ("blocks",), ("helios", "helios"), (2, 4, 4), (1, 4, 4),
                     (3, 5, 7)),
    "kandinsky5": Family("kandinsky5", build_kandinsky5, kandinsky5_inputs, ("visual_transformer_blocks",),
                         ("kandinsky5", "kandinsky5"), (2, 4, 4), (1, 4, 4), (3, 5, 7)),
    "kandinsky6": Family("kandinsky6", build_kandinsky6, kandinsky6_inputs, ("visual_transformer_blocks",),
                         ("kandinsky6", "kandinsky6"), (2, 4, 4), (1, 4, 4), (3, 5, 7)),
}
SHARED_INPUTS = {"framepack": FRAMEPACK_INDICES, "helios": HELIOS_INDICES,  # inputs shared by the batch
                 "kandinsky5": KANDINSKY5_POSITIONS, "kandinsky6": KANDINSKY6_POSITIONS}
#: Sublayers that stay at full length in a merged block and so are not in the half-tokens FLOP reference.
FULL_LENGTH = {"ltx2": ("video_to_audio_attn",), "kandinsky6": ("av_cross_attention",)}


@pytest.fixture(scope="module")
def models() -> dict[str, nn.Module]:
    return {name: family.build() for name, family in FAMILIES.items()}


# ---------------------------------------------------------------------- every family
@pytest.mark.parametrize("name", FAMILIES)
def test_finds_the_transformer_and_its_blocks_in_order(models, name):
    family, model = FAMILIES[name], models[name]
    with tomerge.merging(types.SimpleNamespace(transformer=model), "tomesd", ratio=0.5) as handle:
        assert handle.model is model and handle.adapter.name == family.backbone
        assert isinstance(handle.adapter, DeclaredAdapter)
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
        assert handle.adapter.grid_size == family.grid  # (T, H, W) of the target tokens
        records = handle.state.records
    assert out.shape == before.shape and torch.isfinite(out).all()
    assert [r.block_kind for r in records] == list(family.kinds)
    assert all(r.num_tokens == math.prod(family.grid) and r.num_removed > 0 for r in records)


@pytest.mark.parametrize("name", FAMILIES)
def test_half_ratio_blocks_cost_what_half_the_tokens_cost(models, name):
    if name not in FULL_LENGTH:
        check_flops(models[name], FAMILIES[name], name)
        return
    # Sublayers at full length cost what they cost unmerged; the others what they cost on half the tokens.
    family, model = FAMILIES[name], models[name]
    full = [f"{type(model).__name__}.{c}.{i}.{sub}" for c in family.containers
            for i in range(len(getattr(model, c))) for sub in FULL_LENGTH[name]]

    def counts(inputs: dict) -> tuple[int, int]:
        """``(full-length sublayers, blocks)`` FLOPs of one call."""
        counter = FlopCounter()
        with counter:
            run(model, inputs)
        per_module = counter.get_flop_counts()
        return sum(sum(per_module[m].values()) for m in full), flop_counts(model, inputs, family.containers)[1]

    inputs, half = family.inputs(model, grid=family.grid), family.inputs(model, grid=family.half)
    base_full, _ = counts(inputs)
    half_full, half_blocks = counts(half)
    with tomerge.merging(model, "tomesd", ratio=0.5, use_rand=False, **ALL_SUBLAYERS) as handle:
        merged_full, blocks = counts(inputs)
        assert all(r.num_removed == math.prod(family.grid) // 2 for r in handle.state.records)
    assert merged_full == base_full > half_full > 0
    assert half_blocks - half_full <= blocks - merged_full <= 1.05 * (half_blocks - half_full)


@pytest.mark.parametrize("name", FAMILIES)
def test_permuted_slots_give_the_unpatched_output(models, name, monkeypatch):
    """Exact only if every slot carries its token's 3-D RoPE position (and FramePack's history keeps its rows)."""
    family, model = FAMILIES[name], models[name]
    for grid in (family.grid, family.odd):
        check_permutation_is_exact(model, family.inputs(model, grid=grid, seed=4), None, math.prod(grid))
    # Control: without the RoPE gather the same permutation changes the output (positions matter here).
    inputs = family.inputs(model, seed=4)
    before = run(model, inputs)
    adapter = backbone_class(family.backbone)
    kinds = tuple(dataclasses.replace(k, sites=tuple(dataclasses.replace(s, rope=None) for s in k.sites))
                  for k in adapter.kinds)
    monkeypatch.setattr(adapter, "kinds", kinds)
    with tomerge.merging(model, Permute(), ratio=0.5, **ALL_SUBLAYERS):
        assert (run(model, inputs) - before).abs().max() > 1e-3


#: Kandinsky 5 is not batch-invariant itself (test_kandinsky5_batch_plans_are_its_samples_plans).
BATCH_INVARIANT = [name for name in FAMILIES if name != "kandinsky5"]


@pytest.mark.tie_sensitive
@pytest.mark.parametrize("name", BATCH_INVARIANT)
def test_a_batch_equals_its_samples_alone(models, name):
    family, model = FAMILIES[name], models[name]
    shared = SHARED_INPUTS.get(name, ())
    check_batch_equals_samples(model, family.inputs(model, seed=5), lambda inputs, i: select(inputs, i, shared))


@pytest.mark.parametrize("name", FAMILIES)
def test_grids_with_leftover_rows_and_frames_merge(models, name):
    check_odd_grid_merges(models[name], FAMILIES[name])


@pytest.mark.parametrize("name", FAMILIES)
def test_merging_runs_under_inference_mode(models, name):
    check_inference_mode(models[name], FAMILIES[name].inputs(models[name]))


# ---------------------------------------------------------------------- every strategy on every family
from tomerge.experiments.sources.coverage import caches_blocks  # noqa: E402

# the merging strategies and schedules; the caching schedules have their own contract (tests/test_caching.py)
STRATEGIES = [name for name in tomerge.registry.list_strategies() if not caches_blocks(name)]
#: Options that make every strategy remove tokens on the tests' 32-token grid in 2 steps: ssm's windows unrounded,
#: 4 facility-location tiles, toma_release's first blocks merged too (its release skips the first 5 of each kind).
STRATEGY_OPTIONS = {"ssm": {"round_windows": 1}, "facility_location": {"num_tiles": 4}, "toma": {"num_tiles": 4},
                    "toma_release": {"num_tiles": 4, "skip_first": 0}}
def _needs_probe(strategy: str) -> bool:
    """The strategy (or one of the schedule's strategies) ranks tokens by received attention."""
    built = tomerge.get_strategy(strategy)
    parts = built.strategies() if isinstance(built, Schedule) else (built,)
    return any("received_attention" in part.needs for part in parts)


def _zero_ratio_options(strategy: str) -> dict:
    """A schedule with a ratio curve merges nothing only with its deviation 0 too (``sdtm_paper``'s curve around
    ratio 0 with deviation 0.2 starts at 0.2)."""
    fields = {f.name for f in dataclasses.fields(tomerge.registry.strategy_class(strategy))}
    return {"deviation": 0.0} if "deviation" in fields else {}


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("name", FAMILIES)
def test_every_strategy_is_exact_at_ratio_zero_and_after_remove_and_finite_at_half(models, name, strategy):
    """Two denoising steps (t = 999, then 500) so that schedules reach their merging phases (sdtm_release protects
    step 0 and fills its feature cache there); ratio 0 and ``remove()`` give the unpatched outputs bit for bit.
    One sample per call (the batch checks are above)."""
    family, model = FAMILIES[name], models[name]
    options = dict(STRATEGY_OPTIONS.get(strategy, {}), num_steps=2)
    calls = [family.inputs(model, batch=1, t=t) for t in (999.0, 500.0)]
    before = [run(model, c) for c in calls]
    with tomerge.merging(model, strategy, ratio=0.0, **options, **_zero_ratio_options(strategy)) as handle:
        assert all(torch.equal(run(model, c), b) for c, b in zip(calls, before))
        assert handle.stats["block_calls"] == 2 * len(family.kinds)
    handle = tomerge.apply(model, strategy, ratio=0.5, **options)
    try:
        merged = [run(model, c) for c in calls]
        assert handle.stats["tokens_removed"] > 0 and handle.state.clock.step == 1
    finally:
        handle.remove()
    assert all(m.shape == b.shape and torch.isfinite(m).all() for m, b in zip(merged, before))
    assert any(not torch.equal(m, b) for m, b in zip(merged, before))
    assert all(torch.equal(run(model, c), b) for c, b in zip(calls, before))
    assert no_hooks_left(model)


def test_the_strategies_include_those_that_need_received_attention():
    """Every family above records received attention: idm's attention variant and the schedules built on it need
    it (sdtm_release runs idm's streak variant), and so does fresh_tokens (ToCa's score)."""
    assert {s for s in STRATEGIES if _needs_probe(s)} == {"idm", "sdtm", "sdtm_paper", "fresh_tokens"}


# ---------------------------------------------------------------------- SkyReels-V2
def test_skyreels_v2_block_causal_mask_is_gathered_on_both_axes():
    """With causal blocks of 2 frames (``num_frame_per_block=2``) attn1 gets a block-causal mask ``[1, 1, N, N]``:
    merged calls gather its rows and columns per slot (the permutation is exact with it), and the probe that
    ignores masks refuses to rank tokens."""
    model = build_skyreels_v2()
    model._set_ar_attention(2)
    inputs = skyreels_v2_inputs(model, grid=(4, 2, 2), seed=3)
    N = 16
    check_permutation_is_exact(model, inputs, None, N)
    seen = []
    with tomerge.merging(model, "tomesd", ratio=0.5, use_rand=False, **ALL_SUBLAYERS):
        attn = model.blocks[0].attn1
        hook = attn.register_forward_pre_hook(lambda m, a, k: seen.append((a[0].shape[1], a[2])), with_kwargs=True)
        try:
            out = run(model, inputs)
        finally:
            hook.remove()
    assert torch.isfinite(out).all()
    (M, mask), = seen
    assert M == N // 2 and mask.shape == (2, 1, M, M) and mask.dtype == torch.bool  # per-sample plans
    block_of = torch.arange(N) // 4 // 2  # token -> its causal block (2 frames of 2 x 2 tokens)
    with tomerge.merging(model, Permute(), ratio=0.5, **ALL_SUBLAYERS):  # the mask a per-sample permutation gets
        attn = model.blocks[0].attn1
        hook = attn.register_forward_pre_hook(lambda m, a, k: seen.append((a[0].shape[1], a[2])), with_kwargs=True)
        try:
            run(model, inputs)
        finally:
            hook.remove()
    _, permuted = seen[1]  # [B, 1, N, N]
    slots = Permute().select_destinations(torch.zeros(2, N, 1), None)  # [B, N]: the token of each slot
    assert permuted.shape == (2, 1, N, N) and not torch.equal(slots[0], slots[1])
    for b in range(2):
        blocks = block_of[slots[b]]
        assert torch.equal(permuted[b, 0], blocks[None, :] <= blocks[:, None])  # query slot i sees key slot j
    with pytest.raises(NotImplementedError, match="attention mask.*probe ignores masks"):
        with tomerge.merging(model, "idm", ratio=0.5):
            run(model, inputs)
    assert no_hooks_left(model)


# ---------------------------------------------------------------------- Wan VACE
def test_wan_vace_hints_leave_their_blocks_at_full_length(models):
    """The VACE blocks merge the control tokens inside (attn1 gets M slots) and return the hint and the control
    tokens at full length, so the hints are added to the full-length video tokens as the model consumes them."""
    model = models["wan_vace"]
    inputs = wan_vace_inputs(model)
    N, C = 32, 256
    seen: dict[str, list[tuple[int, ...]]] = {"attn1": [], "hint": [], "control": []}

    def outputs(module: nn.Module, args: tuple, out: tuple[Tensor, Tensor]) -> None:
        seen["hint"].append(tuple(out[0].shape))
        seen["control"].append(tuple(out[1].shape))

    with tomerge.merging(model, "tomesd", ratio=0.5, use_rand=False, **ALL_SUBLAYERS):
        hooks = []
        for block in model.vace_blocks:  # registered after tomerge's hooks: they see what the model sees
            hooks.append(block.attn1.register_forward_pre_hook(lambda m, a: seen["attn1"].append(tuple(a[0].shape))))
            hooks.append(block.register_forward_hook(outputs))
        try:
            out = run(model, inputs)
        finally:
            for h in hooks:
                h.remove()
    assert torch.isfinite(out).all()
    assert seen == {"attn1": [(2, N // 2, C)] * 2, "hint": [(2, N, C)] * 2, "control": [(2, N, C)] * 2}


# ---------------------------------------------------------------------- FramePack
def test_framepack_history_tokens_are_context_and_the_key_mask_follows_the_target(models):
    """The history tokens pass through the attention at full length and unchanged (they precede any merge in the
    first block), the target tokens are merged, and the key mask over [history, target, text] keeps the history
    and text columns (the second prompt's 3 padding keys stay masked)."""
    model = models["framepack"]
    inputs = framepack_inputs(model)
    P, N, T = framepack_history_tokens((2, 4, 4)), 32, 4 + 8  # text: 4 image tokens + 8 prompt tokens
    attn = model.transformer_blocks[0].attn

    def first_attention_call() -> tuple[Tensor, Tensor]:
        seen = []
        hook = attn.register_forward_pre_hook(lambda m, a, k: seen.append((k["hidden_states"], k["attention_mask"])),
                                              with_kwargs=True)
        try:
            run(model, inputs)
        finally:
            hook.remove()
        return seen[0]

    plain, plain_mask = first_attention_call()
    with tomerge.merging(model, "tomesd", ratio=0.5, use_rand=False, **ALL_SUBLAYERS) as handle:
        merged, mask = first_attention_call()
        assert all(r.num_tokens == N and r.num_removed == N // 2 for r in handle.state.records)
    M = N // 2
    assert plain.shape[1] == P + N and merged.shape[1] == P + M
    assert torch.equal(merged[:, :P], plain[:, :P])
    assert plain_mask.shape == (2, 1, 1, P + N + T) and mask.shape == (2, 1, 1, P + M + T)
    assert mask[0].all() and mask[1, 0, 0, : P + M + T - 3].all() and not mask[1, 0, 0, -3:].any()


def test_framepack_received_attention_is_the_target_keys_share_of_the_text_queries(models):
    """float64: the joint-attention probe's rule (the text queries' softmax over every key, averaged over heads and
    the unmasked text queries) with the history keys attended but not recorded: the target keys' share,
    renormalised, computed here from each attention's own SDPA call over [history, target, text]."""
    model = copy.deepcopy(models["framepack"]).double()
    inputs = to_float64(framepack_inputs(model))
    attentions = {0: model.transformer_blocks[0].attn, 1: model.single_transformer_blocks[0].attn}
    P, N, T = framepack_history_tokens((2, 4, 4)), 32, 4 + 8
    seen, hooks = record_sdpa(attentions)
    try:
        with tomerge.merging(model, "idm", ratio=0.5) as handle, torch.no_grad():
            model(**inputs)
            recorded = dict(handle.state.attention)
    finally:
        for hook in hooks:
            hook.remove()
    assert sorted(recorded) == [0, 1]
    for layer, [call] in seen.items():
        q, k, mask, scale = (call[name] for name in ("query", "key", "attn_mask", "scale"))
        assert k.shape[2] == P + N + T and mask.shape == (2, 1, 1, P + N + T)
        logits = (q @ k.transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scale is None else scale)  # [B, h, L, L]
        p = logits.masked_fill(~mask, -math.inf).softmax(-1)
        reference = []
        for b in range(2):
            text = torch.arange(P + N, P + N + T)[mask[b, 0, 0, P + N:]]  # the text queries the mask keeps
            share = p[b][:, text].mean(dim=(0, 1))[P:P + N]  # [N]: the target keys
            reference.append(share / share.sum())
        reference = torch.stack(reference)
        torch.testing.assert_close(recorded[layer].double(), reference, rtol=1e-5, atol=1e-8)
        history = p[:, :, P + N:, :P].sum(-1)  # the history keys do take part of the text's attention
        assert (history > 1e-3).all()


# ---------------------------------------------------------------------- LTX-2
def test_ltx2_video_to_audio_attention_reads_the_full_length_video_stream(models):
    """v2a (audio queries, video keys/values) runs at full length on the video stream, a2v (video queries) on the
    merged slots; the audio stream keeps its length; the audio output changes only through the merged video."""
    model = models["ltx2"]
    inputs = ltx2_inputs(model)
    block = model.transformer_blocks[0]
    seen: dict[str, tuple[int, int]] = {}

    def record(name: str):
        def hook(module, args, kwargs):
            queries = kwargs.get("hidden_states", args[0] if args else None)
            keys = kwargs.get("encoder_hidden_states")
            seen[name] = (queries.shape[1], (queries if keys is None else keys).shape[1])
        return hook

    with torch.no_grad():
        plain = model(**inputs)
    with tomerge.merging(model, "tomesd", ratio=0.5, use_rand=False, **ALL_SUBLAYERS):
        hooks = [getattr(block, name).register_forward_pre_hook(record(name), with_kwargs=True)
                 for name in ("attn1", "audio_to_video_attn", "video_to_audio_attn", "audio_attn1")]
        try:
            with torch.no_grad():
                merged = model(**inputs)
        finally:
            for h in hooks:
                h.remove()
    N, M, Na = 32, 16, LTX2_AUDIO
    assert seen == {"attn1": (M, M), "audio_to_video_attn": (M, Na), "video_to_audio_attn": (Na, N),
                    "audio_attn1": (Na, Na)}
    assert merged.audio_sample.shape == plain.audio_sample.shape and torch.isfinite(merged.audio_sample).all()
    assert not torch.equal(merged.audio_sample, plain.audio_sample)  # v2a reads the merged blocks' video output


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


def test_ltx2_block_cache_reuses_the_video_and_audio_streams(models):
    """The block returns ``(hidden_states, audio_hidden_states)``: interval 1 is the plain model bit for bit (video
    and audio); on a reused step (block_cache, interval 2) each block returns each stream's input plus that stream's
    residual of the last full step, and the full steps are the plain model's."""
    model = models["ltx2"]
    inputs = ltx2_inputs(model, batch=1)
    blocks = list(model.transformer_blocks)
    # the block's video [B, N, C] and audio [B, Na, Ca] inputs
    streams = lambda args, kwargs: (kwargs["hidden_states"], kwargs["audio_hidden_states"])  # noqa: E731
    base, _ = audio_video_trajectory(model, inputs, blocks, streams)
    every_step, _ = audio_video_trajectory(model, inputs, blocks, streams, "block_cache", interval=1)
    outs, cached_io = audio_video_trajectory(model, inputs, blocks, streams, "block_cache", interval=2)
    assert all(torch.equal(x, y) for step in range(3) for x, y in zip(every_step[step], base[step]))
    assert all(torch.equal(x, y) for step in (0, 2) for x, y in zip(outs[step], base[step]))
    assert all(torch.isfinite(x).all() and not torch.equal(x, y) for x, y in zip(outs[1], base[1]))
    for layer in range(len(blocks)):
        (x0, y0), (x1, y1) = cached_io[0][layer], cached_io[1][layer]
        for stream in range(2):  # video, audio
            assert torch.equal(y1[stream], x1[stream] + (y0[stream] - x0[stream])), (layer, stream)
    assert no_hooks_left(model)


def test_ltx2_interleaved_rope_and_video_self_attention_mask_follow_the_slots():
    """LTX-2's interleaved RoPE ([B, N, C]) and the video self-attention mask ([B, N, N], the IC-LoRA pipelines')
    are gathered per slot: the permutation is exact with both."""
    model = build_ltx2(rope_type="interleaved")
    inputs = ltx2_inputs(model, seed=4)
    g = _seed(7)
    inputs["video_self_attention_mask"] = (torch.rand(2, 32, 32, generator=g) < 0.6).float() + torch.eye(32)
    inputs["video_self_attention_mask"] = inputs["video_self_attention_mask"].clamp(max=1.0)
    check_permutation_is_exact(model, inputs, None, 32)
    unmasked = run(model, dict(inputs, video_self_attention_mask=None))
    assert (unmasked - run(model, inputs)).abs().max() > 1e-3  # the mask matters


# ---------------------------------------------------------------------- Wan Animate
def test_wan_animate_face_adapter_gets_the_full_length_video_tokens(models):
    """The face adapter runs between blocks, on the blocks' full-length output, frame-aligned with the motion
    frames: merging leaves it as it is."""
    model = models["wan_animate"]
    seen = []
    with tomerge.merging(model, "tomesd", ratio=0.5, use_rand=False, **ALL_SUBLAYERS) as handle:
        hook = model.face_adapter[0].register_forward_pre_hook(lambda m, a: seen.append(tuple(a[0].shape)))
        try:
            out = run(model, wan_animate_inputs(model))
        finally:
            hook.remove()
        assert handle.stats["tokens_removed"] == 2 * 16
    assert seen == [(2, 32, 256)] and torch.isfinite(out).all()


# ---------------------------------------------------------------------- Helios
def test_helios_history_is_context_and_the_target_count_follows_the_slots():
    """attn1 gets the history tokens unchanged in front of the merged target tokens and, as
    ``original_context_length``, the slot count, so that the amplified history keys are the history's
    (``is_amplify_history``); attn2 gets the merged target tokens alone; the permutation stays exact."""
    model = build_helios(is_amplify_history=True)
    inputs = helios_inputs(model, seed=4)
    P, N, M = framepack_history_tokens((2, 4, 4)), 32, 16
    check_permutation_is_exact(model, inputs, None, N)
    block = model.blocks[0]

    def first_calls() -> dict[str, tuple]:
        """``(tokens, original_context_length)`` the first block's attentions get (after tomerge's hooks)."""
        seen: dict[str, tuple] = {}

        def record(name: str):
            def hook(module: nn.Module, args: tuple) -> None:
                seen[name] = (args[0], args[4])
            return hook

        hooks = [block.attn1.register_forward_pre_hook(record("attn1")),
                 block.attn2.register_forward_pre_hook(record("attn2"))]
        try:
            run(model, inputs)
        finally:
            for h in hooks:
                h.remove()
        return seen

    plain = first_calls()
    with tomerge.merging(model, "tomesd", ratio=0.5, use_rand=False, **ALL_SUBLAYERS) as handle:
        merged = first_calls()
        assert all(r.num_tokens == N and r.num_removed == N - M for r in handle.state.records)
    (x, count), (y, cross_count) = merged["attn1"], merged["attn2"]
    assert plain["attn1"][0].shape[1] == P + N and plain["attn1"][1] == N
    assert x.shape[1] == P + M and count == M and x.shape[1] - count == P  # the processor's history length
    assert torch.equal(x[:, :P], plain["attn1"][0][:, :P])
    assert y.shape[1] == M and plain["attn2"][0].shape[1] == N and cross_count == N  # attn2 ignores the count


def idm_attention_and_inputs(model: nn.Module, inputs: dict, attentions: list[nn.Module],
                             call=None) -> tuple[dict[int, Tensor], dict[int, Tensor]]:
    """One forward of ``model`` under ``idm`` (ratio 0.5): the received attention it recorded per layer, and the
    input ``x [B, L, C]`` each of ``attentions`` (one per layer) was called with."""
    seen: dict[int, Tensor] = {}

    def record(layer: int):
        def hook(module: nn.Module, args: tuple) -> None:
            seen[layer] = args[0]
        return hook

    hooks = [attn.register_forward_pre_hook(record(layer)) for layer, attn in enumerate(attentions)]
    try:
        with tomerge.merging(model, "idm", ratio=0.5) as handle, torch.no_grad():
            (call or (lambda: model(**inputs)))()
            recorded = dict(handle.state.attention)
    finally:
        for hook in hooks:
            hook.remove()
    return recorded, seen


def test_helios_received_attention_is_the_target_queries_share_on_the_target_keys(models):
    """float64: the self-attention probe's rule with history keys: every target query's softmax over the history
    and target keys (q and k after the q/k norms, before the RoPE rotation), averaged over heads and target queries,
    restricted to the target keys and renormalised."""
    model = copy.deepcopy(models["helios"]).double()
    inputs = to_float64(helios_inputs(model))
    P, N = framepack_history_tokens((2, 4, 4)), 32
    recorded, seen = idm_attention_and_inputs(model, inputs, [block.attn1 for block in model.blocks])
    assert sorted(recorded) == sorted(seen) == [0, 1]
    for layer, x in seen.items():
        attn = model.blocks[layer].attn1
        assert x.shape[1] == P + N
        with torch.no_grad():
            q = attn.norm_q(attn.to_q(x)).unflatten(2, (attn.heads, -1)).transpose(1, 2)  # [B, h, P + N, d]
            k = attn.norm_k(attn.to_k(x)).unflatten(2, (attn.heads, -1)).transpose(1, 2)
        p = ((q[:, :, P:] @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5).softmax(-1)  # target queries, all keys
        share = p.mean(dim=(1, 2))[:, P:]  # [B, N]
        torch.testing.assert_close(recorded[layer].double(), share / share.sum(-1, keepdim=True), rtol=1e-5,
                                   atol=1e-8)
        assert (p[..., :P].sum(-1) > 1e-3).all()  # the history keys take part of the target's attention


def test_helios_without_guidance_cross_attention_is_refused():
    model = build_helios(guidance_cross_attn=False)
    with pytest.raises(ValueError, match="guidance_cross_attn=False"):
        tomerge.apply(model, "tomesd", ratio=0.5)
    assert no_hooks_left(model)


# ---------------------------------------------------------------------- Kandinsky 5
@pytest.mark.tie_sensitive
@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")  # its norms get float32 q, k
def test_kandinsky5_batch_plans_are_its_samples_plans(models, monkeypatch):
    """Kandinsky 5 is not batch-invariant by itself: its time embedding computes in float32 whatever the model's
    dtype (kept so here, as diffusers keeps it) and its attention rounds the rotated q and k to bfloat16, so a batch
    and its samples alone differ (~1e-4) even unmerged. In float64 otherwise, every block of the batch still gets
    each sample's own plan (destinations and assignment), and the merged outputs differ as little."""
    from tomerge.state import MergeState

    model = copy.deepcopy(models["kandinsky5"]).double()
    model.time_embeddings.float()
    inputs = to_float64(kandinsky5_inputs(model, seed=5))
    parts = [inputs] + [select(inputs, i, KANDINSKY5_POSITIONS) for i in (0, 1)]
    plans: list = []
    plan_for = MergeState.plan_for

    def recording(self, call, tokens):
        plan = plan_for(self, call, tokens)
        if not any(plan is seen for seen in plans):
            plans.append(plan)
        return plan

    monkeypatch.setattr(MergeState, "plan_for", recording)
    plain = [run(model, part) for part in parts]
    merged, per_part = [], []
    for part in parts:
        plans.clear()
        with tomerge.merging(model, "tomesd", ratio=0.5, use_rand=False, **ALL_SUBLAYERS):
            merged.append(run(model, part))
        per_part.append(list(plans))
    batch, alone = per_part[0], per_part[1:]
    assert len(batch) == 2 and all(len(p) == 2 for p in alone)  # one plan per block
    for layer in range(2):
        for b in range(2):
            assert torch.equal(batch[layer].dst[b], alone[b][layer].dst[0])
            assert torch.equal(batch[layer].assign[b], alone[b][layer].assign[0])
    unmerged_gap = (plain[0] - torch.cat(plain[1:])).abs().max()
    merged_gap = (merged[0] - torch.cat(merged[1:])).abs().max()
    assert 0 < unmerged_gap < 1e-3 and merged_gap < 1e-3


def test_kandinsky5_received_attention_is_computed_from_its_query_and_key_norms(models):
    """The probe declared on ``to_query``/``to_key`` + ``query_norm``/``key_norm``: every video query's softmax
    over the video keys (after the per-head norms, before the rotation), averaged over heads and queries."""
    model = models["kandinsky5"]
    inputs = kandinsky5_inputs(model)
    recorded, seen = idm_attention_and_inputs(
        model, inputs, [block.self_attention for block in model.visual_transformer_blocks], lambda: run(model, inputs))
    assert sorted(recorded) == sorted(seen) == [0, 1]
    for layer, x in seen.items():
        attn = model.visual_transformer_blocks[layer].self_attention
        with torch.no_grad():
            q = attn.query_norm(attn.to_query(x).unflatten(2, (attn.num_heads, -1)).float()).double()
            k = attn.key_norm(attn.to_key(x).unflatten(2, (attn.num_heads, -1)).float()).double()
        p = torch.einsum("bqhd,bkhd->bhqk", q, k).mul(q.shape[-1] ** -0.5).softmax(-1)  # [B, h, N, N]
        torch.testing.assert_close(recorded[layer].double(), p.mean(dim=(1, 2)), rtol=1e-4, atol=1e-6)


@pytest.mark.filterwarnings("ignore:tomerge. no block")
def test_kandinsky5_sparse_attention_calls_are_not_merged(models):
    """With ``sparse_params`` (nabla attention) the tokens are in a fractal order and attend through a block mask
    of the full sequence: the call's grid is unknown (no block merges), with the adapter's warning saying why."""
    model = models["kandinsky5"]
    inputs = dict(kandinsky5_inputs(model), sparse_params={"to_fractal": False, "sta_mask": None, "P": 0.9})
    with tomerge.merging(model, "tomesd", ratio=0.5) as handle:
        with pytest.warns(UserWarning, match="sparse"):
            assert handle.adapter.on_model_call((), inputs) is not None
        assert handle.adapter.grid_size is None


# ---------------------------------------------------------------------- Kandinsky 6
def _kandinsky6_calls(model: nn.Module, inputs: dict, names: tuple[str, ...]) -> tuple[Tensor, dict[str, dict]]:
    """The output and, per submodule of the first fused block (dotted ``names``), its call's tokens, keys/values
    (``encoder_hidden_states``) and query RoPE (after tomerge's hooks, which run first)."""
    block = model.visual_transformer_blocks[0]
    seen: dict[str, dict] = {}

    def record(name: str):
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            seen[name] = dict(tokens=kwargs.get("hidden_states", args[0] if args else None),
                              keys=kwargs.get("encoder_hidden_states"),
                              rope=kwargs.get("rope_q", kwargs.get("rotary_emb")))
        return hook

    hooks = [block.get_submodule(name).register_forward_pre_hook(record(name), with_kwargs=True) for name in names]
    try:
        with torch.no_grad():
            out = model(**inputs)
    finally:
        for h in hooks:
            h.remove()
    return out, seen


def test_kandinsky6_merges_the_video_stream_and_keeps_audio_and_reference_frame_as_context(models):
    """The video sublayers get the merged target tokens and the reference frame's tokens unchanged after them (with
    their RoPE rows); the audio stream keeps its length and av_cross_attention reads the full-length video stream,
    which merging the cross-attention alone leaves as the plain model's in the first block; the audio output
    changes only through the merged video stream."""
    model = models["kandinsky6"]
    inputs = kandinsky6_inputs(model)
    names = ("video_dec_block.self_attention", "video_dec_block.cross_attention", "va_cross_attention",
             "av_cross_attention", "audio_dec_block.self_attention", "video_dec_block.feed_forward")
    plain, before = _kandinsky6_calls(model, inputs, names)
    with tomerge.merging(model, "tomesd", ratio=0.5, use_rand=False, **ALL_SUBLAYERS) as handle:
        merged, after = _kandinsky6_calls(model, inputs, names)
        assert handle.adapter.grid_size == (2, 4, 4) and handle.adapter.context.after == 16
    N, M, R, Na, T = 32, 16, 16, KANDINSKY6_AUDIO, 8
    shapes = {name: (call["tokens"].shape[1], None if call["keys"] is None else call["keys"].shape[1])
              for name, call in after.items()}
    assert shapes == {"video_dec_block.self_attention": (M + R, None), "video_dec_block.cross_attention": (M + R, T),
                      "va_cross_attention": (M + R, Na), "av_cross_attention": (Na, N + R),
                      "audio_dec_block.self_attention": (Na, None), "video_dec_block.feed_forward": (M + R, None)}
    attn, plain_attn = after["video_dec_block.self_attention"], before["video_dec_block.self_attention"]
    assert torch.equal(attn["tokens"][:, M:], plain_attn["tokens"][:, N:])  # the reference frame, as it is
    assert attn["rope"].shape == (2, M + R, 1, 64, 2, 2)  # per-sample [B, M + R, 1, d/2, 2, 2] rotations
    assert torch.equal(attn["rope"][:, M:], plain_attn["rope"][None, N:].expand(2, -1, -1, -1, -1, -1))
    assert after["va_cross_attention"]["rope"].shape[1] == M + R
    for name in ("av_cross_attention", "audio_dec_block.self_attention"):
        assert torch.equal(after[name]["tokens"], before[name]["tokens"])
    with tomerge.merging(model, "tomesd", ratio=0.5, use_rand=False, merge_attn=False, merge_crossattn=True,
                         merge_mlp=False):
        _, crossattn_only = _kandinsky6_calls(model, inputs, names)
    assert crossattn_only["video_dec_block.cross_attention"]["tokens"].shape[1] == M + R
    assert torch.equal(crossattn_only["av_cross_attention"]["keys"], before["av_cross_attention"]["keys"])
    assert merged.audio_sample.shape == plain.audio_sample.shape and torch.isfinite(merged.audio_sample).all()
    assert not torch.equal(merged.audio_sample, plain.audio_sample)  # the second block reads the merged video


@pytest.mark.parametrize("audio", [True, False], ids=["audio", "video_only"])
def test_kandinsky6_text_to_video_permutation_is_exact(models, audio):
    """Without a reference frame (text-to-video), with and without audio: the permuted slots give the plain output,
    the video's and the audio's (the video RoPE of the self-attention and of va_cross_attention's queries gathered)."""
    model = models["kandinsky6"]
    inputs = kandinsky6_inputs(model, seed=4, reference=False, audio=audio)
    with torch.no_grad():
        before = model(**inputs)
    with tomerge.merging(model, Permute(), ratio=0.5, **ALL_SUBLAYERS) as handle:
        with torch.no_grad():
            out = model(**inputs)
        assert handle.adapter.grid_size == (2, 4, 4) and not handle.adapter.context
        assert len(handle.state.records) == 2
    torch.testing.assert_close(out.sample, before.sample, rtol=1e-4, atol=1e-5)
    if audio:
        torch.testing.assert_close(out.audio_sample, before.audio_sample, rtol=1e-4, atol=1e-5)
    else:
        assert out.audio_sample is None


def test_kandinsky6_received_attention_is_the_target_queries_share_on_the_target_keys(models):
    """float64: the probe on ``query_norm``/``key_norm`` with the reference frame's keys attended but not recorded:
    every target query's softmax over the target and reference keys (after the per-head norms, before the rotation),
    averaged over heads and queries, restricted to the target keys and renormalised."""
    model = copy.deepcopy(models["kandinsky6"]).double()
    inputs = to_float64(kandinsky6_inputs(model))
    N, R = 32, 16
    attentions = [block.video_dec_block.self_attention for block in model.visual_transformer_blocks]
    recorded, seen = idm_attention_and_inputs(model, inputs, attentions)
    assert sorted(recorded) == sorted(seen) == [0, 1]
    for layer, x in seen.items():
        attn = attentions[layer]
        assert x.shape[1] == N + R
        with torch.no_grad():
            q = attn.query_norm(attn.to_query(x).unflatten(2, (attn.num_heads, -1)))  # [B, N + R, h, d]
            k = attn.key_norm(attn.to_key(x).unflatten(2, (attn.num_heads, -1)))
        p = torch.einsum("bqhd,bkhd->bhqk", q[:, :N], k).mul(q.shape[-1] ** -0.5).softmax(-1)  # target queries
        share = p.mean(dim=(1, 2))[:, :N]  # [B, N]: the target keys
        torch.testing.assert_close(recorded[layer].double(), share / share.sum(-1, keepdim=True), rtol=1e-5,
                                   atol=1e-8)
        assert (p[..., N:].sum(-1) > 1e-3).all()  # the reference keys take part of the target's attention


@pytest.mark.parametrize("audio", [True, False], ids=["audio", "video_only"])
def test_kandinsky6_block_cache_reuses_the_video_and_audio_streams(models, audio):
    """The fused block returns ``(vis, aud)``: on a reused step (block_cache, interval 2) each block returns each
    stream's input plus that stream's residual of the last full step; the full steps are the plain model's. A
    video-only call's blocks return ``(vis, None)``, kept as ``None``."""
    model = models["kandinsky6"]
    inputs = kandinsky6_inputs(model, batch=1, audio=audio)
    blocks = list(model.visual_transformer_blocks)
    streams = lambda args, kwargs: args[:2]  # noqa: E731  (vis, aud)
    base, _ = audio_video_trajectory(model, inputs, blocks, streams)
    outs, cached_io = audio_video_trajectory(model, inputs, blocks, streams, "block_cache", interval=2)
    same = lambda a, b: a is b is None or torch.equal(a, b)  # noqa: E731
    assert all(same(x, y) for step in (0, 2) for x, y in zip(outs[step], base[step]))
    assert not torch.equal(outs[1][0], base[1][0])
    for layer in range(len(blocks)):
        (x0, y0), (x1, y1) = cached_io[0][layer], cached_io[1][layer]
        assert torch.equal(y1[0], x1[0] + (y0[0] - x0[0]))
        assert (y1[1] is None) if not audio else torch.equal(y1[1], x1[1] + (y0[1] - x0[1]))
    assert no_hooks_left(model)


@pytest.mark.parametrize("name", ["kandinsky6", "ltx2"])
@pytest.mark.parametrize("schedule", [name for name in tomerge.registry.list_strategies() if caches_blocks(name)])
def test_video_and_audio_families_run_every_caching_schedule(models, name, schedule):
    """Six steps of each caching schedule on the families whose blocks return ``(video, audio)`` (toca merges the
    video stream and reuses its attention on partial steps): finite video and audio outputs of the plain shapes, the
    first step the plain model's, ``remove()`` restores it."""
    model = models[name]
    calls = [FAMILIES[name].inputs(model, batch=1, t=500.0 * (1 - 0.1 * step)) for step in range(6)]
    with torch.no_grad():
        before = model(**calls[0])
    handle = tomerge.apply(model, schedule, num_steps=6)
    try:
        with torch.no_grad():
            outs = [model(**call) for call in calls]
    finally:
        handle.remove()
    assert torch.equal(outs[0].sample, before.sample) and torch.equal(outs[0].audio_sample, before.audio_sample)
    for out in outs:
        assert out.sample.shape == before.sample.shape and torch.isfinite(out.sample).all()
        assert out.audio_sample.shape == before.audio_sample.shape and torch.isfinite(out.audio_sample).all()
    with torch.no_grad():
        assert torch.equal(model(**calls[0]).sample, before.sample)
    assert no_hooks_left(model)


@pytest.mark.filterwarnings("ignore:tomerge. no block")
def test_kandinsky6_token_types_other_than_a_trailing_reference_leave_the_call_unmerged(models):
    """Type ids that mark a frame before the target's last (not one grid followed by context) give no grid, with the
    adapter's warning saying why."""
    model = models["kandinsky6"]
    inputs = kandinsky6_inputs(model)
    inputs["visual_token_type_ids"] = inputs["visual_token_type_ids"].flip(1)  # [B, T + 1]: the first frame marked
    with tomerge.merging(model, "tomesd", ratio=0.5) as handle:
        with pytest.warns(UserWarning, match="visual_token_type_ids"):
            handle.adapter.on_model_call((), inputs)
        assert handle.adapter.grid_size is None
