"""Tiny random-weight diffusers pipelines WITH their text encoders and tokenizers, saved to folders.

Each family's pipeline is assembled offline from configs (random weights, no download: the tokenizers
are built in memory, see :func:`clip_tokenizer` and :func:`t5_tokenizer`) and written with
``save_pretrained``, so that ``diffusers.DiffusionPipeline.from_pretrained(folder, local_files_only=True)``
loads it as a researcher's local weights would be loaded (``model_index.json``, one subfolder per
component, safetensors).

| family | loads as | image | latent | merged token grid |
|---|---|---|---|---|
| ``sd3`` | StableDiffusion3Pipeline (2 CLIP + T5) | 32 x 32 | 16 x 16 x 16 | 8 x 8 (patch 2) |
| ``flux`` | FluxPipeline (CLIP + T5, guidance embedding) | 32 x 32 | 16 x 16 x 16 | 8 x 8 (packed 2 x 2) |
| ``pixart`` | PixArtAlphaPipeline (T5) | 32 x 32 | 16 x 16 x 4 | 8 x 8 (patch 2) |
| ``sdxl`` | StableDiffusionXLPipeline (CLIP + CLIP with projection) | 32 x 32 | 16 x 16 x 4 | 8 x 8 (attention only at 1/2 resolution, as in SDXL: the unet adapter's default merges there) |
| ``sd`` | StableDiffusionPipeline (CLIP) | 32 x 32 | 16 x 16 x 4 | 16 x 16 (and 8 x 8 at 1/2 resolution) |

Every VAE has two levels (scale factor 2). ``CALL_DEFAULTS[family]`` are the call arguments of a fast
2-step generation. :func:`clip_folder` is a tiny ``CLIPModel`` + ``CLIPProcessor`` (for CLIP-score style
metrics).

Notes for callers: always pass ``height``/``width`` (FluxPipeline's default is 1024 whatever the config;
the others default to 32) and a small ``max_sequence_length`` (T5 defaults are 120-512 tokens); PixArt
needs ``use_resolution_binning=False`` (its binning only knows sample sizes 32/64/128). The CLIP tokenizers lowercase and never fail (byte fallback); the T5
tokenizer is case-sensitive and maps characters outside printable ASCII to ``<unk>``.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

FAMILIES = ("sd3", "flux", "pixart", "sdxl", "sd")

_SIZE = dict(height=32, width=32, num_inference_steps=2)
CALL_DEFAULTS: dict[str, dict[str, Any]] = {
    "sd3": {**_SIZE, "guidance_scale": 5.0, "max_sequence_length": 16},
    "flux": {**_SIZE, "guidance_scale": 3.5, "max_sequence_length": 16},
    "pixart": {**_SIZE, "guidance_scale": 4.5, "max_sequence_length": 16, "use_resolution_binning": False,
               "clean_caption": False},
    "sdxl": {**_SIZE, "guidance_scale": 5.0},
    "sd": {**_SIZE, "guidance_scale": 7.5},
}

CLIP_MAX_LENGTH = 77  # tokenizer.model_max_length = text encoder max_position_embeddings, as in real CLIP

# ---------------------------------------------------------------------- tokenizers
# A few BPE merges (in priority order) on top of the 256 byte-level characters and their "</w>" forms.
_CLIP_MERGES = [("t", "h"), ("th", "e</w>"), ("o", "f</w>"), ("a", "n"), ("an", "d</w>"), ("i", "n"),
                ("in", "g</w>"), ("p", "h"), ("ph", "o"), ("t", "o</w>"), ("pho", "to</w>"), ("c", "a"),
                ("ca", "t</w>"), ("d", "o"), ("do", "g</w>"), ("a", "r</w>"), ("e", "d</w>")]

_T5_WORDS = ("a an the of in on with and at by to for photo picture painting portrait cat dog horse bird "
             "astronaut riding red blue green white black small large beautiful city street mountain sky sea "
             "forest house car tree man woman child moon sun night day light dark style detailed high quality")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable unicode character map (the base alphabet of byte-level BPE)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def clip_tokenizer():
    """CLIP's byte-level BPE layout (bytes, bytes + "</w>", merges, <|startoftext|>, <|endoftext|>; pad is
    <|endoftext|> as in SD 1.x), with 17 merges: every text tokenizes (unknown words fall back to bytes)."""
    from transformers import CLIPTokenizer

    chars = list(_bytes_to_unicode().values())
    tokens = chars + [c + "</w>" for c in chars] + ["".join(m) for m in _CLIP_MERGES]
    tokens += ["<|startoftext|>", "<|endoftext|>"]
    vocab = {t: i for i, t in enumerate(tokens)}
    assert len(vocab) == len(tokens)
    return CLIPTokenizer(vocab=vocab, merges=list(_CLIP_MERGES), model_max_length=CLIP_MAX_LENGTH)


def t5_tokenizer():
    """A T5-style Unigram tokenizer (``<pad>`` 0, ``</s>`` 1, ``<unk>`` 2, metaspace ``▁`` pieces, ``</s>``
    appended): a few whole words and every printable ASCII character, so any text tokenizes (other
    characters are ``<unk>``). No sentencepiece model: it saves as ``tokenizer.json``."""
    from transformers import T5Tokenizer

    pieces: list[tuple[str, float]] = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -3.0)]
    pieces += [("▁" + w, -2.0) for w in _T5_WORDS.split()]
    ascii_chars = [chr(c) for c in range(33, 127)]
    pieces += [("▁" + c, -4.0) for c in ascii_chars if ("▁" + c, -2.0) not in pieces]
    pieces += [(c, -5.0) for c in ascii_chars]
    names = [p for p, _ in pieces]
    assert len(set(names)) == len(names)
    return T5Tokenizer(vocab=pieces, extra_ids=0)


# ---------------------------------------------------------------------- components
def _seeded(seed: int) -> None:
    torch.manual_seed(seed)


def _clip_text(tokenizer, hidden: int = 32, projection: int | None = None, seed: int = 0):
    """CLIPTextModel (``projection`` None) or CLIPTextModelWithProjection, 2 layers."""
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    config = CLIPTextConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
                            num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=CLIP_MAX_LENGTH,
                            projection_dim=projection or hidden, hidden_act="quick_gelu",
                            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                            pad_token_id=tokenizer.pad_token_id)
    _seeded(seed)
    model = CLIPTextModel(config) if projection is None else CLIPTextModelWithProjection(config)
    return model.eval()


def _t5(tokenizer, d_model: int, seed: int = 0):
    """T5EncoderModel (v1.1 style: gated-gelu), 2 layers."""
    from transformers import T5Config, T5EncoderModel

    config = T5Config(vocab_size=len(tokenizer), d_model=d_model, d_kv=8, d_ff=2 * d_model, num_layers=2,
                      num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=32,
                      feed_forward_proj="gated-gelu", dropout_rate=0.0, pad_token_id=tokenizer.pad_token_id,
                      eos_token_id=tokenizer.eos_token_id, decoder_start_token_id=tokenizer.pad_token_id,
                      is_encoder_decoder=False, use_cache=False)
    _seeded(seed)
    return T5EncoderModel(config).eval()


def _vae(latent_channels: int = 4, seed: int = 0, **config: Any):
    """Two-level AutoencoderKL (scale factor 2)."""
    from diffusers import AutoencoderKL

    _seeded(seed)
    return AutoencoderKL(in_channels=3, out_channels=3, latent_channels=latent_channels, block_out_channels=(8, 16),
                         down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
                         norm_num_groups=8, layers_per_block=1, sample_size=32, **config).eval()


def _sd_scheduler_config() -> dict[str, Any]:
    return dict(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", steps_offset=1)


def _build_sd3():
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline

    clip, t5 = clip_tokenizer(), t5_tokenizer()
    text_encoder = _clip_text(clip, 32, projection=32, seed=1)      # "CLIP-L": hidden 32, pooled 32
    text_encoder_2 = _clip_text(clip, 32, projection=32, seed=2)    # "CLIP-G": hidden 32, pooled 32
    text_encoder_3 = _t5(t5, d_model=64, seed=3)                    # >= 32 + 32 (CLIP embeds are padded to it)
    _seeded(0)
    transformer = SD3Transformer2DModel(
        sample_size=16, patch_size=2, in_channels=16, out_channels=16, num_layers=2, attention_head_dim=8,
        num_attention_heads=4, joint_attention_dim=64, caption_projection_dim=32, pooled_projection_dim=64,
        pos_embed_max_size=16, dual_attention_layers=(0,), qk_norm="rms_norm").eval()
    vae = _vae(16, seed=4, scaling_factor=1.5305, shift_factor=0.0609, use_quant_conv=False,
               use_post_quant_conv=False)
    return StableDiffusion3Pipeline(
        transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), vae=vae,
        text_encoder=text_encoder, tokenizer=clip, text_encoder_2=text_encoder_2, tokenizer_2=clip_tokenizer(),
        text_encoder_3=text_encoder_3, tokenizer_3=t5)


def _build_flux():
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

    clip, t5 = clip_tokenizer(), t5_tokenizer()
    text_encoder = _clip_text(clip, 32, seed=1)         # pooled_projection_dim = CLIP hidden (pooler_output)
    text_encoder_2 = _t5(t5, d_model=32, seed=2)        # joint_attention_dim = T5 d_model
    _seeded(0)
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=64, num_layers=2, num_single_layers=2, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, guidance_embeds=True,
        axes_dims_rope=(4, 6, 6)).eval()
    vae = _vae(16, seed=3, scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False,
               use_post_quant_conv=False)
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, base_shift=0.5,
                                                max_shift=1.15, base_image_seq_len=256, max_image_seq_len=4096)
    return FluxPipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=clip,
                        text_encoder_2=text_encoder_2, tokenizer_2=t5, transformer=transformer)


def _build_pixart():
    from diffusers import DPMSolverMultistepScheduler, PixArtAlphaPipeline, PixArtTransformer2DModel

    t5 = t5_tokenizer()
    text_encoder = _t5(t5, d_model=32, seed=1)          # caption_channels = T5 d_model
    _seeded(0)
    transformer = PixArtTransformer2DModel(
        num_attention_heads=4, attention_head_dim=8, in_channels=4, out_channels=8, num_layers=2,
        cross_attention_dim=32, sample_size=16, patch_size=2, caption_channels=32).eval()
    vae = _vae(4, seed=2, scaling_factor=0.18215)
    scheduler = DPMSolverMultistepScheduler(beta_start=0.0001, beta_end=0.02, beta_schedule="linear",
                                            algorithm_type="dpmsolver++", solver_order=2, prediction_type="epsilon")
    return PixArtAlphaPipeline(tokenizer=t5, text_encoder=text_encoder, vae=vae, transformer=transformer,
                               scheduler=scheduler)


def _build_sdxl():
    from diffusers import EulerDiscreteScheduler, StableDiffusionXLPipeline, UNet2DConditionModel

    clip = clip_tokenizer()
    text_encoder = _clip_text(clip, 32, seed=1)                    # hidden 32
    text_encoder_2 = _clip_text(clip, 32, projection=32, seed=2)   # hidden 32, pooled (text_embeds) 32
    _seeded(0)
    unet = UNet2DConditionModel(   # SDXL layout: no attention at full resolution
        sample_size=16, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(32, 64),
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        mid_block_type="UNetMidBlock2DCrossAttn", norm_num_groups=8, attention_head_dim=(2, 4),
        transformer_layers_per_block=(1, 2), use_linear_projection=True, cross_attention_dim=64,
        addition_embed_type="text_time", addition_time_embed_dim=8,
        projection_class_embeddings_input_dim=6 * 8 + 32).eval()
    vae = _vae(4, seed=3, scaling_factor=0.13025)
    scheduler = EulerDiscreteScheduler(**_sd_scheduler_config(), timestep_spacing="leading")
    return StableDiffusionXLPipeline(vae=vae, text_encoder=text_encoder, text_encoder_2=text_encoder_2,
                                     tokenizer=clip, tokenizer_2=clip_tokenizer(), unet=unet, scheduler=scheduler,
                                     image_encoder=None, feature_extractor=None, add_watermarker=False)


def _build_sd():
    from diffusers import DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel

    clip = clip_tokenizer()
    text_encoder = _clip_text(clip, 32, seed=1)
    _seeded(0)
    unet = UNet2DConditionModel(
        sample_size=16, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(32, 64),
        down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D"), mid_block_type="UNetMidBlock2DCrossAttn",
        norm_num_groups=8, cross_attention_dim=32, attention_head_dim=8).eval()
    vae = _vae(4, seed=2, scaling_factor=0.18215)
    scheduler = DDIMScheduler(**_sd_scheduler_config(), clip_sample=False, set_alpha_to_one=False)
    return StableDiffusionPipeline(vae=vae, text_encoder=text_encoder, tokenizer=clip, unet=unet,
                                   scheduler=scheduler, safety_checker=None, feature_extractor=None,
                                   image_encoder=None, requires_safety_checker=False)


_BUILDERS = {"sd3": _build_sd3, "flux": _build_flux, "pixart": _build_pixart, "sdxl": _build_sdxl, "sd": _build_sd}


def build_tiny_pipeline(family: str):
    """The family's tiny pipeline in memory (not saved)."""
    if family not in _BUILDERS:
        raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")
    return _BUILDERS[family]()


def save_tiny_pipeline(family: str, folder: str | Path) -> Path:
    """Build the family's tiny pipeline (deterministic) and ``save_pretrained`` it into ``folder``."""
    folder = Path(folder)
    build_tiny_pipeline(family).save_pretrained(folder, safe_serialization=True)
    return folder


def _temp_dir(prefix: str) -> Path:
    path = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


@functools.cache
def pipeline_folder(family: str) -> Path:
    """The family's saved pipeline, built once per process into a temporary folder removed at exit."""
    if family not in _BUILDERS:
        raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")
    return save_tiny_pipeline(family, _temp_dir(f"tomerge-tiny-{family}-"))


@contextlib.contextmanager
def diffusers_log() -> Iterator[list[logging.LogRecord]]:
    """The records diffusers logs inside the block (its library logger does not propagate to the root logger,
    so pytest's ``caplog`` does not see them)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("diffusers")
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)


# ---------------------------------------------------------------------- CLIP (for metrics)
def save_tiny_clip(folder: str | Path) -> Path:
    """A tiny random-weight ``CLIPModel`` (text and vision width 32, 2 layers, 32 x 32 images, patch 8,
    projection 32) and its ``CLIPProcessor``, saved into ``folder``."""
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor

    folder = Path(folder)
    tokenizer = clip_tokenizer()
    text = dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, max_position_embeddings=CLIP_MAX_LENGTH, bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=32,
                  patch_size=8)
    _seeded(0)
    model = CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=32)).eval()
    image_processor = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    model.save_pretrained(folder, safe_serialization=True)
    CLIPProcessor(image_processor=image_processor, tokenizer=tokenizer).save_pretrained(folder)
    return folder


@functools.cache
def clip_folder() -> Path:
    """The tiny CLIP, saved once per process into a temporary folder removed at exit."""
    return save_tiny_clip(_temp_dir("tomerge-tiny-clip-"))


# ---------------------------------------------------------------------- current families (declared adapters)
# Built like the pipelines above (random weights, in-memory tokenizers, save_pretrained), but not part of
# FAMILIES: they are used by tests/test_backbones_current.py and tests/test_backbones_video.py.
#
# | family | loads as | output | latent | merged token grid |
# |---|---|---|---|---|
# | ``sana`` | SanaPipeline (Gemma-2 text encoder, DC-AE) | 32 x 32 image | 16 x 16 x 4 | 16 x 16 (patch 1) |
# | ``wan`` | WanPipeline (UMT5 encoder, Wan VAE) | 9 frames of 64 x 64 | 3 x 8 x 8 x 16 | 3 x 4 x 4 (patch (1, 2, 2)) |
# | ``ltx`` | LTXPipeline (T5 encoder, LTX-Video VAE) | 9 frames of 32 x 32 | 3 x 8 x 8 x 8 | 3 x 8 x 8 (patch 1) |
# | ``cogvideox`` | CogVideoXPipeline (T5 encoder, CogVideoX VAE) | 9 frames of 64 x 64 | 3 x 8 x 8 x 4 | 3 x 4 x 4 (patch 2) |
CURRENT_CALL_DEFAULTS: dict[str, dict[str, Any]] = {
    "sana": {**_SIZE, "guidance_scale": 4.5, "max_sequence_length": 16, "use_resolution_binning": False,
             "clean_caption": False, "complex_human_instruction": None},
    "wan": {"height": 64, "width": 64, "num_frames": 9, "num_inference_steps": 2, "guidance_scale": 5.0,
            "max_sequence_length": 16},
    "ltx": {"height": 32, "width": 32, "num_frames": 9, "num_inference_steps": 3, "guidance_scale": 3.0,
            "max_sequence_length": 16},
    "cogvideox": {"height": 64, "width": 64, "num_frames": 9, "num_inference_steps": 3, "guidance_scale": 3.0,
                  "max_sequence_length": 16},
}


def _build_sana():
    from diffusers import AutoencoderDC, DPMSolverMultistepScheduler, SanaPipeline, SanaTransformer2DModel
    from transformers import Gemma2Config, Gemma2Model

    tokenizer = t5_tokenizer()  # any tokenizer: the pipeline only pads it to max_length on the right
    config = Gemma2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=64,
                          pad_token_id=tokenizer.pad_token_id)
    _seeded(1)
    text_encoder = Gemma2Model(config).eval()
    _seeded(0)
    transformer = SanaTransformer2DModel(
        in_channels=4, out_channels=4, num_attention_heads=4, attention_head_dim=8, num_layers=2,
        num_cross_attention_heads=2, cross_attention_head_dim=16, cross_attention_dim=32, caption_channels=32,
        mlp_ratio=2.5, sample_size=16, patch_size=1).eval()
    _seeded(2)
    vae = AutoencoderDC(
        in_channels=3, latent_channels=4, attention_head_dim=2, encoder_block_types=("ResBlock", "EfficientViTBlock"),
        decoder_block_types=("ResBlock", "EfficientViTBlock"), encoder_block_out_channels=(8, 8),
        decoder_block_out_channels=(8, 8), encoder_qkv_multiscales=((), (5,)), decoder_qkv_multiscales=((), (5,)),
        encoder_layers_per_block=(1, 1), decoder_layers_per_block=(1, 1), downsample_block_type="conv",
        upsample_block_type="interpolate", decoder_norm_types="rms_norm", decoder_act_fns="silu",
        scaling_factor=0.41407).eval()
    scheduler = DPMSolverMultistepScheduler(flow_shift=3.0, use_flow_sigmas=True, prediction_type="flow_prediction")
    return SanaPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, transformer=transformer,
                        scheduler=scheduler)


def _build_wan():
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel

    from transformers import UMT5Config, UMT5EncoderModel

    tokenizer = t5_tokenizer()
    config = UMT5Config(vocab_size=len(tokenizer), d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                        relative_attention_num_buckets=8, relative_attention_max_distance=32,
                        feed_forward_proj="gated-gelu", dropout_rate=0.0, pad_token_id=tokenizer.pad_token_id,
                        eos_token_id=tokenizer.eos_token_id, decoder_start_token_id=tokenizer.pad_token_id,
                        is_encoder_decoder=False, use_cache=False)
    _seeded(1)
    text_encoder = UMT5EncoderModel(config).eval()  # text_dim = d_model
    _seeded(0)
    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=16, out_channels=16,
        text_dim=32, freq_dim=32, ffn_dim=64, num_layers=2, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
        rope_max_seq_len=32).eval()
    _seeded(2)
    vae = AutoencoderKLWan(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                           temperal_downsample=[False, True, True]).eval()
    return WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae,
                       scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), transformer=transformer)


def _build_ltx():
    from diffusers import AutoencoderKLLTXVideo, FlowMatchEulerDiscreteScheduler, LTXPipeline, LTXVideoTransformer3DModel

    tokenizer = t5_tokenizer()
    text_encoder = _t5(tokenizer, 32, seed=1)  # caption_channels = d_model
    _seeded(0)
    transformer = LTXVideoTransformer3DModel(
        in_channels=8, out_channels=8, patch_size=1, patch_size_t=1, num_attention_heads=4, attention_head_dim=8,
        cross_attention_dim=32, num_layers=2, caption_channels=32).eval()
    _seeded(2)
    # spatial compression 4 (two 2x stages), temporal 4: 9 frames of 32 x 32 -> a 3 x 8 x 8 latent
    vae = AutoencoderKLLTXVideo(
        latent_channels=8, block_out_channels=(8, 8, 8, 8), decoder_block_out_channels=(8, 8, 8, 8),
        layers_per_block=(1, 1, 1, 1, 1), decoder_layers_per_block=(1, 1, 1, 1, 1),
        spatio_temporal_scaling=(True, True, False, False), decoder_spatio_temporal_scaling=(True, True, False, False),
        decoder_inject_noise=(False,) * 5, upsample_residual=(False,) * 4, upsample_factor=(1,) * 4,
        patch_size=1, patch_size_t=1).eval()
    return LTXPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=text_encoder,
                       tokenizer=tokenizer, transformer=transformer)


def _build_cogvideox():
    from diffusers import AutoencoderKLCogVideoX, CogVideoXDDIMScheduler, CogVideoXPipeline, CogVideoXTransformer3DModel

    tokenizer = t5_tokenizer()
    text_encoder = _t5(tokenizer, 32, seed=1)  # text_embed_dim = d_model
    _seeded(0)
    transformer = CogVideoXTransformer3DModel(
        num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4, time_embed_dim=16,
        text_embed_dim=32, num_layers=2, patch_size=2, sample_height=8, sample_width=8, sample_frames=9,
        max_text_seq_length=16, use_rotary_positional_embeddings=True).eval()
    _seeded(2)
    # spatial compression 8 (three 2x stages), temporal 4: 9 frames of 64 x 64 -> a 3 x 8 x 8 latent
    vae = AutoencoderKLCogVideoX(block_out_channels=(8, 8, 8, 8), latent_channels=4, layers_per_block=1,
                                 norm_num_groups=2, temporal_compression_ratio=4, sample_height=64,
                                 sample_width=64).eval()
    return CogVideoXPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, transformer=transformer,
                             scheduler=CogVideoXDDIMScheduler())


_BUILDERS.update({"sana": _build_sana, "wan": _build_wan, "ltx": _build_ltx, "cogvideox": _build_cogvideox})


# ---------------------------------------------------------------------- editing pipelines (input images)
# | family | loads as | input image | output | merged token grid |
# |---|---|---|---|---|
# | ``flux_kontext`` | FluxKontextPipeline (the ``flux`` components) | any size (a multiple of 4) | 32 x 32 | 8 x 8 target tokens; the input image's tokens are context |
#
# ``max_area`` keeps the output at 32 x 32 (Kontext scales height and width to it, default 1024^2) and
# ``_auto_resize=False`` the input image at its own size (not one of Kontext's preferred resolutions).
EDIT_CALL_DEFAULTS: dict[str, dict[str, Any]] = {
    "flux_kontext": {**_SIZE, "guidance_scale": 2.5, "max_sequence_length": 16, "max_area": 32 * 32,
                     "_auto_resize": False},
}


def _build_flux_kontext():
    from diffusers import FluxKontextPipeline

    return FluxKontextPipeline(**_build_flux().components)  # Kontext is a FLUX.1 transformer with reference tokens


_BUILDERS.update({"flux_kontext": _build_flux_kontext})
