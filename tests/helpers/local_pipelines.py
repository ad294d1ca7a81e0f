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
# FAMILIES: loaded by tests/backbones/test_sana.py and test_wan.py (``load_tiny_pipeline``) and by ablation tests.
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


# ---------------------------------------------------------------------- video pipelines
# Video families of tests/experiments/test_ablate_video_pipelines.py (call defaults in CURRENT_CALL_DEFAULTS).
#
# | family | loads as | output | latent | merged token grid |
# |---|---|---|---|---|
# | ``hunyuan_video`` | HunyuanVideoPipeline (Llama + CLIP, HunyuanVideo VAE, 1 double + 1 single block) | 9 frames of 64 x 64 | 3 x 8 x 8 x 4 | 3 x 8 x 8 (patch 1); text tokens are context |
# | ``mochi`` | MochiPipeline (T5 encoder, Mochi VAE: temporal compression 6) | 13 frames of 64 x 64 | 3 x 8 x 8 x 12 | 3 x 4 x 4 (patch 2); the text stream is context |
# | ``latte`` | LattePipeline (T5 encoder, image AutoencoderKL per frame; frame count ``video_length``) | 9 frames of 32 x 32 | 9 x 16 x 16 x 4 | 8 x 8 per frame (patch 2; spatial blocks merged, temporal blocks not) |
# | ``kandinsky5`` | Kandinsky5T2VPipeline (Qwen2.5-VL + CLIP, HunyuanVideo VAE; 1 text block, 2 video blocks) | 9 frames of 64 x 64 | 3 x 8 x 8 x 4 | 3 x 4 x 4 (patch (1, 2, 2)); text refined apart, then cross-attended |
#
# ``hunyuan_video`` and ``kandinsky5`` wrap every prompt in a chat template (a system message, then the prompt as the
# user message) and drop the template's first tokens from the encoder's output, a count fixed for the released
# tokenizers: HunyuanVideo's ``crop_start`` = 95 (Llama-3), Kandinsky's ``prompt_template_encode_start_idx`` = 128
# (Qwen2.5, set in ``__init__``, no call argument). Their tokenizers here (:func:`byte_bpe_tokenizer`) learn BPE
# merges from that template with the released tokenizer's pre-tokenizer split, so the template's prefix is exactly
# that many tokens and the cropped output starts at the prompt.
LLAMA3_SPECIAL_TOKENS = ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                         "<|eot_id|>", "<pad>")
QWEN2_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                        "<|image_pad|>", "<|video_pad|>")
# The pre-tokenizer splits of Meta-Llama-3's and Qwen2's tokenizer.json: letters, digits (1-3 for Llama-3, 1 for
# Qwen2), punctuation, newline runs.
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")


def byte_bpe_backend(texts: tuple[str, ...], special_tokens: tuple[str, ...], split: str = QWEN2_SPLIT, *,
                     unmerged: frozenset[str] = frozenset()):
    """A byte-level BPE ``tokenizers.Tokenizer`` in the layout of Llama-3's and Qwen2's: the 256 byte characters,
    the pre-tokenizer ``split``, ``special_tokens`` as single tokens, and merges learnt from ``texts`` (special
    tokens cut out first): every word of ``texts`` is one token, except the words of ``unmerged`` (two tokens:
    their last merge is left out); any other text falls back to smaller pieces."""
    import json
    import re

    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    trainer = trainers.BpeTrainer(vocab_size=4096, min_frequency=1, show_progress=False,
                                  special_tokens=list(special_tokens),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    specials = "|".join(map(re.escape, special_tokens))
    backend.train_from_iterator([part for text in texts for part in re.split(specials, text) if part], trainer)
    if unmerged:
        state = json.loads(backend.to_str())
        state["model"]["merges"] = [m for m in state["model"]["merges"] if "".join(m) not in unmerged]
        backend = Tokenizer.from_str(json.dumps(state))
    backend.decoder = decoders.ByteLevel()
    return backend


def byte_bpe_tokenizer(texts: tuple[str, ...], special_tokens: tuple[str, ...], split: str, *,
                       unmerged: frozenset[str] = frozenset(), bos: str | None = None, eos: str, pad: str):
    """:func:`byte_bpe_backend` as a ``PreTrainedTokenizerFast``; ``bos``, when given, is prepended to every text."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    backend = byte_bpe_backend(texts, special_tokens, split, unmerged=unmerged)
    if bos is not None:
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, backend.token_to_id(bos))])
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=bos, eos_token=eos, pad_token=pad,
                                   model_max_length=1024)


def llama3_tokenizer(texts: tuple[str, ...] = ()):
    """Llama-3's layout (:func:`byte_bpe_tokenizer`): ``<|begin_of_text|>`` prepended, ``<pad>`` for padding."""
    return byte_bpe_tokenizer(texts, LLAMA3_SPECIAL_TOKENS, LLAMA3_SPLIT, bos="<|begin_of_text|>",
                              eos="<|end_of_text|>", pad="<pad>")


def kandinsky5_template() -> str:
    """The chat template Kandinsky5T2VPipeline sets in its ``__init__`` (read from a pipeline built without models)."""
    from diffusers import Kandinsky5T2VPipeline

    return Kandinsky5T2VPipeline(None, None, None, None, None, None, None).prompt_template


CURRENT_CALL_DEFAULTS.update({
    "hunyuan_video": {"height": 64, "width": 64, "num_frames": 9, "num_inference_steps": 3,  # toca reuses on step 2
                      "guidance_scale": 6.0, "max_sequence_length": 16},
    "mochi": {"height": 64, "width": 64, "num_frames": 13, "num_inference_steps": 2, "guidance_scale": 4.5,
              "max_sequence_length": 16},
    "latte": {**_SIZE, "video_length": 9, "guidance_scale": 7.5, "clean_caption": False},
    "kandinsky5": {"height": 64, "width": 64, "num_frames": 9, "num_inference_steps": 2, "guidance_scale": 5.0,
                   "max_sequence_length": 16},
})


def _build_hunyuan_video():
    from diffusers import (AutoencoderKLHunyuanVideo, FlowMatchEulerDiscreteScheduler, HunyuanVideoPipeline,
                           HunyuanVideoTransformer3DModel)
    from diffusers.pipelines.hunyuan_video.pipeline_hunyuan_video import DEFAULT_PROMPT_TEMPLATE
    from transformers import LlamaConfig, LlamaModel

    tokenizer = llama3_tokenizer((DEFAULT_PROMPT_TEMPLATE["template"],))
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    _seeded(1)
    text_encoder = LlamaModel(config).eval()             # text_embed_dim = Llama hidden
    clip = clip_tokenizer()
    text_encoder_2 = _clip_text(clip, 16, seed=2)       # pooled_projection_dim = CLIP hidden (pooler_output)
    _seeded(0)
    transformer = HunyuanVideoTransformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=16, num_layers=1,
        num_single_layers=1, num_refiner_layers=1, mlp_ratio=2.0, patch_size=1, patch_size_t=1, guidance_embeds=True,
        text_embed_dim=32, pooled_projection_dim=16, rope_axes_dim=(4, 6, 6)).eval()
    _seeded(3)
    # spatial compression 8 (three 2x stages), temporal 4: 9 frames of 64 x 64 -> a 3 x 8 x 8 latent
    vae = AutoencoderKLHunyuanVideo(
        in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8, 8, 8, 8), layers_per_block=1,
        norm_num_groups=4, scaling_factor=0.476986, spatial_compression_ratio=8, temporal_compression_ratio=4).eval()
    return HunyuanVideoPipeline(text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer, vae=vae,
                                scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0), text_encoder_2=text_encoder_2,
                                tokenizer_2=clip)


def _build_mochi():
    from diffusers import AutoencoderKLMochi, FlowMatchEulerDiscreteScheduler, MochiPipeline, MochiTransformer3DModel

    tokenizer = t5_tokenizer()
    text_encoder = _t5(tokenizer, 32, seed=1)  # text_embed_dim = d_model
    _seeded(0)
    transformer = MochiTransformer3DModel(
        patch_size=2, num_attention_heads=2, attention_head_dim=16, num_layers=2, pooled_projection_dim=16,
        in_channels=12, qk_norm="rms_norm", text_embed_dim=32, time_embed_dim=8, activation_fn="swiglu",
        max_sequence_length=16).eval()
    with torch.no_grad():
        transformer.pos_frequencies.normal_()  # [3, heads, head_dim / 2]: zeros at init, i.e. no RoPE
    _seeded(2)
    # spatial compression 8, temporal 6 (GroupNorm of 32 groups: 32 channels at least): 13 frames of 64 x 64 ->
    # a 3 x 8 x 8 latent
    vae = AutoencoderKLMochi(latent_channels=12, out_channels=3, encoder_block_out_channels=(32,) * 4,
                             decoder_block_out_channels=(32,) * 4, layers_per_block=(1,) * 5).eval()
    # inverted sigmas, as genmo/mochi-1-preview's scheduler: the model's t rises from noise to data
    return MochiPipeline(scheduler=FlowMatchEulerDiscreteScheduler(invert_sigmas=True), vae=vae,
                         text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer)


def _build_latte():
    from diffusers import DDIMScheduler, LattePipeline, LatteTransformer3DModel

    tokenizer = t5_tokenizer()
    text_encoder = _t5(tokenizer, 32, seed=1)  # caption_channels = d_model
    _seeded(0)
    transformer = LatteTransformer3DModel(  # Latte-1's block layout; out_channels 2 x latent: learned variance
        num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=8, num_layers=2,
        cross_attention_dim=32, attention_bias=True, sample_size=16, patch_size=2, activation_fn="gelu-approximate",
        num_embeds_ada_norm=1000, norm_type="ada_norm_single", norm_elementwise_affine=False, norm_eps=1e-6,
        caption_channels=32, video_length=9).eval()  # the temporal position table has exactly video_length rows
    vae = _vae(4, seed=2, scaling_factor=0.18215)  # per frame: 9 frames of 32 x 32 -> 9 latents of 16 x 16
    # DDIM has no learned variance: the pipeline keeps the first (noise) half of the model's output
    scheduler = DDIMScheduler(beta_start=0.0001, beta_end=0.02, beta_schedule="linear", clip_sample=False)
    return LattePipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, transformer=transformer,
                         scheduler=scheduler)


def _build_kandinsky5():
    from diffusers import (AutoencoderKLHunyuanVideo, FlowMatchEulerDiscreteScheduler, Kandinsky5T2VPipeline,
                           Kandinsky5Transformer3DModel)
    from transformers import (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLImageProcessor,
                              Qwen2VLProcessor, Qwen2VLVideoProcessor)

    # three words of the template left as two tokens each: with every other word whole, the template's prefix
    # is 128 tokens, the count of the released Qwen2.5 tokenizer
    tokenizer = byte_bpe_tokenizer((kandinsky5_template(),), QWEN2_SPECIAL_TOKENS, QWEN2_SPLIT,
                                   unmerged=frozenset({"Ġdynamism", "Ġpostprocessing", "Ġscren"}),
                                   eos="<|im_end|>", pad="<|endoftext|>")
    processor = Qwen2VLProcessor(image_processor=Qwen2VLImageProcessor(), tokenizer=tokenizer,
                                 video_processor=Qwen2VLVideoProcessor())  # the pipeline calls it with text only
    token_id = tokenizer.convert_tokens_to_ids
    text = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                vocab_size=len(tokenizer), max_position_embeddings=1024, pad_token_id=tokenizer.pad_token_id,
                bos_token_id=token_id("<|endoftext|>"), eos_token_id=tokenizer.eos_token_id,
                rope_scaling={"mrope_section": [2, 3, 3], "rope_type": "default", "type": "default"})  # head_dim 16
    config = Qwen2_5_VLConfig(
        text_config=text, vision_config=dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2,
                                             out_hidden_size=32),
        image_token_id=token_id("<|image_pad|>"), video_token_id=token_id("<|video_pad|>"),
        vision_start_token_id=token_id("<|vision_start|>"), vision_end_token_id=token_id("<|vision_end|>"))
    _seeded(1)
    text_encoder = Qwen2_5_VLForConditionalGeneration(config).eval()  # in_text_dim = hidden 32
    clip = clip_tokenizer()
    text_encoder_2 = _clip_text(clip, 32, seed=2)                      # in_text_dim2 = CLIP hidden (pooler_output)
    _seeded(0)
    transformer = Kandinsky5Transformer3DModel(
        in_visual_dim=4, in_text_dim=32, in_text_dim2=32, time_dim=32, out_visual_dim=4, patch_size=(1, 2, 2),
        model_dim=48, ff_dim=96, num_text_blocks=1, num_visual_blocks=2, axes_dims=(8, 8, 8), visual_cond=False).eval()
    with torch.no_grad():  # the modulations are zero at init (every gate 0: each block the identity)
        for name, module in transformer.named_modules():
            if name.endswith("modulation"):
                torch.nn.init.normal_(module.out_layer.weight, std=0.02)
                torch.nn.init.normal_(module.out_layer.bias, std=0.2)
    _seeded(3)
    # spatial compression 8 (three 2x stages), temporal 4: 9 frames of 64 x 64 -> a 3 x 8 x 8 latent
    vae = AutoencoderKLHunyuanVideo(
        in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8, 8, 8, 8), layers_per_block=1,
        norm_num_groups=4, spatial_compression_ratio=8, temporal_compression_ratio=4).eval()
    return Kandinsky5T2VPipeline(transformer=transformer, vae=vae, text_encoder=text_encoder, tokenizer=processor,
                                 text_encoder_2=text_encoder_2, tokenizer_2=clip,
                                 scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0))


_BUILDERS.update({"hunyuan_video": _build_hunyuan_video, "mochi": _build_mochi, "latte": _build_latte,
                  "kandinsky5": _build_kandinsky5})


# ---------------------------------------------------------------------- single-stream and mixture-of-experts image pipelines
# | family | loads as | image | latent | merged token grid |
# |---|---|---|---|---|
# | ``lumina2`` | Lumina2Pipeline (Gemma-2 text encoder) | 128 x 128 | 16 x 16 x 4 | 8 x 8 (patch 2); caption refiner unmerged, the image after each sample's caption |
# | ``z_image`` | ZImagePipeline (Qwen3 text encoder, chat template) | 32 x 32 | 16 x 16 x 16 | 8 x 8 (patch 2); image first, caption after |
# | ``cogview4`` | CogView4Pipeline (GLM text encoder) | 32 x 32 | 16 x 16 x 16 | 8 x 8 (patch 2); text first |
# | ``hidream`` | HiDreamImagePipeline (2 CLIP with projection + T5 + Llama) | 32 x 32 | 16 x 16 x 16 | 8 x 8 (patch 2); 4 routed experts, 2 active |
#
# Lumina2Pipeline fixes its VAE scale factor at 8 whatever the VAE, so its VAE has four levels and the image is
# 128 x 128; ``system_prompt=""`` keeps the prompt inside 32 tokens (the default system prompt alone is longer).
# HiDreamImagePipeline rescales every call to the area ``(default_sample_size * vae_scale_factor) ** 2`` with
# ``default_sample_size = 128`` set in its ``__init__`` (256 x 256 with this VAE): callers that want 32 x 32 set
# ``default_sample_size = 16`` on the loaded pipeline (tests/experiments/test_ablate_single_stream_images.py).
CURRENT_CALL_DEFAULTS.update({
    "lumina2": {"height": 128, "width": 128, "num_inference_steps": 2, "guidance_scale": 4.0, "system_prompt": "",
                "max_sequence_length": 32},
    "z_image": {**_SIZE, "guidance_scale": 4.0, "max_sequence_length": 16},
    "cogview4": {**_SIZE, "num_inference_steps": 3, "guidance_scale": 3.5,  # 3 steps: toca caches on the middle one
                 "max_sequence_length": 16},
    "hidream": {**_SIZE, "guidance_scale": 5.0, "max_sequence_length": 16},
})

# The chat template ZImagePipeline applies to every prompt (a role tag before the text, so that a templated
# prompt differs from the caller's).
Z_IMAGE_CHAT_TEMPLATE = "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}{% endfor %}"


def _decoder_text_config(config_class, tokenizer, **config: Any):
    """A 2-layer decoder-only text model config (hidden 32, grouped-query heads 2/1 of width 16)."""
    return config_class(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=64,
                        pad_token_id=tokenizer.pad_token_id, **config)


def _build_lumina2():
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, Lumina2Pipeline, Lumina2Transformer2DModel
    from transformers import Gemma2Config, Gemma2Model

    tokenizer = t5_tokenizer()  # padded on the right to max_length; the attention mask marks each caption's length
    _seeded(1)
    text_encoder = Gemma2Model(_decoder_text_config(Gemma2Config, tokenizer)).eval()  # cap_feat_dim = hidden 32
    _seeded(0)
    transformer = Lumina2Transformer2DModel(
        sample_size=16, patch_size=2, in_channels=4, hidden_size=32, num_layers=2, num_refiner_layers=1,
        num_attention_heads=2, num_kv_heads=1, multiple_of=16, axes_dim_rope=(4, 6, 6), axes_lens=(64, 32, 32),
        cap_feat_dim=32).eval()
    _seeded(2)
    # four levels (scale factor 8, the factor Lumina2Pipeline assumes): 128 x 128 -> a 16 x 16 latent
    vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8, 8, 8, 8),
                        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                        norm_num_groups=8, layers_per_block=1, sample_size=128, scaling_factor=0.3611,
                        shift_factor=0.1159).eval()
    return Lumina2Pipeline(transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(shift=6.0), vae=vae,
                           text_encoder=text_encoder, tokenizer=tokenizer)


def _build_z_image():
    from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel
    from transformers import Qwen3Config, Qwen3Model

    tokenizer = t5_tokenizer()
    tokenizer.chat_template = Z_IMAGE_CHAT_TEMPLATE  # saved with the tokenizer; apply_chat_template needs one
    _seeded(1)
    text_encoder = Qwen3Model(_decoder_text_config(Qwen3Config, tokenizer)).eval()  # cap_feat_dim = hidden 32
    _seeded(0)
    transformer = ZImageTransformer2DModel(
        all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=32, n_layers=2, n_refiner_layers=1, n_heads=2,
        n_kv_heads=2, qk_norm=True, cap_feat_dim=32, axes_dims=[4, 6, 6], axes_lens=[64, 32, 32]).eval()
    vae = _vae(16, seed=2, scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False)
    return ZImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), vae=vae, text_encoder=text_encoder,
                          tokenizer=tokenizer, transformer=transformer)


def _build_cogview4():
    from diffusers import CogView4Pipeline, CogView4Transformer2DModel, FlowMatchEulerDiscreteScheduler
    from transformers import GlmConfig, GlmModel

    tokenizer = t5_tokenizer()  # the pipeline left-pads the ids to a multiple of 16 itself
    _seeded(1)
    text_encoder = GlmModel(_decoder_text_config(GlmConfig, tokenizer)).eval()  # text_embed_dim = hidden 32
    _seeded(0)
    transformer = CogView4Transformer2DModel(
        patch_size=2, in_channels=16, out_channels=16, num_layers=2, attention_head_dim=16, num_attention_heads=2,
        text_embed_dim=32, time_embed_dim=16, condition_dim=8, pos_embed_max_size=16, sample_size=16,
        rope_axes_dim=(32, 32)).eval()
    vae = _vae(16, seed=2, scaling_factor=1.0, shift_factor=0.0, use_quant_conv=False, use_post_quant_conv=False)
    scheduler = FlowMatchEulerDiscreteScheduler(base_shift=0.25, max_shift=0.75, base_image_seq_len=256,
                                                use_dynamic_shifting=True, time_shift_type="linear")
    return CogView4Pipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, transformer=transformer,
                            scheduler=scheduler)


def _build_hidream():
    from diffusers import FlowMatchEulerDiscreteScheduler, HiDreamImagePipeline, HiDreamImageTransformer2DModel
    from transformers import LlamaConfig, LlamaForCausalLM

    clip, t5, llama = clip_tokenizer(), t5_tokenizer(), t5_tokenizer()  # the pipeline pads Llama's with its eos
    text_encoder = _clip_text(clip, 32, projection=32, seed=1)       # pooled 32
    text_encoder_2 = _clip_text(clip, 32, projection=32, seed=2)     # pooled 32: text_emb_dim = 32 + 32
    text_encoder_3 = _t5(t5, d_model=32, seed=3)                     # caption_channels[0]
    _seeded(4)
    text_encoder_4 = LlamaForCausalLM(_decoder_text_config(LlamaConfig, llama)).eval()  # caption_channels[1]
    _seeded(0)
    transformer = HiDreamImageTransformer2DModel(
        patch_size=2, in_channels=16, out_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16,
        num_attention_heads=2, caption_channels=[32, 32], text_emb_dim=64, num_routed_experts=4,
        num_activated_experts=2, axes_dims_rope=(8, 4, 4), max_resolution=(16, 16),
        llama_layers=[0, 1]).eval()  # one Llama layer per block (1 double + 1 single)
    vae = _vae(16, seed=5, scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False)
    return HiDreamImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), vae=vae, text_encoder=text_encoder, tokenizer=clip,
        text_encoder_2=text_encoder_2, tokenizer_2=clip_tokenizer(), text_encoder_3=text_encoder_3, tokenizer_3=t5,
        text_encoder_4=text_encoder_4, tokenizer_4=llama, transformer=transformer)


_BUILDERS.update({"lumina2": _build_lumina2, "z_image": _build_z_image, "cogview4": _build_cogview4,
                  "hidream": _build_hidream})


# ---------------------------------------------------------------------- joint-attention image pipelines
# | family | loads as | image | latent | merged token grid |
# |---|---|---|---|---|
# | ``qwenimage`` | QwenImagePipeline (Qwen2.5-VL text encoder, Qwen2 tokenizer, Qwen-Image VAE; true CFG) | 32 x 32 | 16 x 16 x 16 | 8 x 8 (packed 2 x 2); text first |
# | ``qwenimage_edit`` | QwenImageEditPipeline (the ``qwenimage`` components + a Qwen2-VL processor) | 32 x 32 | 16 x 16 x 16 | 8 x 8 target tokens; the input image's tokens are context |
# | ``flux2`` | Flux2Pipeline (Mistral-3 text encoder, Pixtral processor, FLUX.2 VAE) | 32 x 32 | 16 x 16 x 8 | 8 x 8 (patchified 2 x 2); text first |
# | ``chroma`` | ChromaPipeline (T5 only, no pooled CLIP) | 32 x 32 | 16 x 16 x 16 | 8 x 8 (packed 2 x 2); text first |
#
# The Qwen2 and Mistral tokenizers are byte-level BPE trained in memory on the pipelines' own prompt templates
# (:func:`qwen2_tokenizer`, :func:`mistral_processor`): every template word is one token, so Qwen-Image's
# template prefix is 34 tokens, as QwenImagePipeline's ``prompt_template_encode_start_idx`` assumes, and the
# prompt survives a short ``max_sequence_length``. Flux2Pipeline pads every prompt to ``max_sequence_length``
# after its system message (30 tokens here, with its markers) and stacks the hidden states of
# ``text_encoder_out_layers`` (3 layers of width 32: ``joint_attention_dim`` 96).
# QwenImageEditPipeline scales the input image to a fixed ~1024^2 area (``calculate_dimensions(1024 * 1024,
# ratio)`` in ``__call__``) before encoding it; callers patch ``calculate_dimensions`` of
# ``diffusers.pipelines.qwenimage.pipeline_qwenimage_edit`` (tests/experiments/test_ablate_joint_attention_images.py), and
# call it with ``true_cfg_scale: 1`` (a string ``negative_prompt`` with a batch > 1 fails inside diffusers).
CURRENT_CALL_DEFAULTS.update({
    "qwenimage": {**_SIZE, "true_cfg_scale": 4.0, "negative_prompt": " ", "max_sequence_length": 16},
    "flux2": {**_SIZE, "num_inference_steps": 3, "guidance_scale": 4.0,  # 3 steps: toca caches on the middle one
              "max_sequence_length": 48, "text_encoder_out_layers": [1, 2, 3]},
    "chroma": {**_SIZE, "guidance_scale": 4.0, "max_sequence_length": 16},
})
EDIT_CALL_DEFAULTS.update({
    "qwenimage_edit": {**_SIZE, "true_cfg_scale": 1.0, "max_sequence_length": 16},
})

MISTRAL_SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]",
                          "[IMG]", "[IMG_BREAK]", "[IMG_END]")
# The sentences of the pipelines' templates and system messages (Qwen-Image, Qwen-Image-Edit, FLUX.2), the
# training text of the byte-level tokenizers.
_TEMPLATE_TEXT = (
    "system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, spatial relationships "
    "of the objects and background:\nuser\nassistant\n"
    "Describe the key features of the input image (color, shape, size, texture, objects, background), then explain "
    "how the user's text instruction should alter or modify the image. Generate a new image that meets the user's "
    "requirements while maintaining consistency with the original input where appropriate.\n"
    "You are an AI that reasons about image descriptions. You give structured responses focusing on object "
    "relationships, object\nattribution and actions without speculation.")
# A Mistral-style chat template (system message, then each user text in [INST] ... [/INST]).
MISTRAL_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% for part in message['content'] %}"
    "{% if message['role'] == 'system' %}[SYSTEM_PROMPT]{{ part['text'] }}[/SYSTEM_PROMPT]"
    "{% elif part['type'] == 'text' %}[INST]{{ part['text'] }}[/INST]{% else %}[IMG]{% endif %}"
    "{% endfor %}{% endfor %}")
# The training text of the Qwen2 and Mistral tokenizers (:func:`byte_bpe_backend`): the templates and the T5 words.
_TEMPLATE_VOCABULARY_TEXT = (_TEMPLATE_TEXT, _T5_WORDS, " " + _T5_WORDS)


def qwen2_tokenizer():
    """A ``Qwen2Tokenizer`` (byte-level BPE, Qwen's chat and vision special tokens, pad ``<|endoftext|>``) whose
    vocabulary is :func:`byte_bpe_backend`'s on the templates."""
    import json

    from transformers import Qwen2Tokenizer

    model = json.loads(byte_bpe_backend(_TEMPLATE_VOCABULARY_TEXT, QWEN2_SPECIAL_TOKENS).to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    return Qwen2Tokenizer(vocab=model["vocab"], merges=merges,
                          additional_special_tokens=list(QWEN2_SPECIAL_TOKENS[1:]))


def _qwen2_5_vl(tokenizer, seed: int = 1):
    """Qwen2_5_VLForConditionalGeneration: a 2-layer text model (hidden 32, heads 2/1 of width 16, M-RoPE sections
    (2, 2, 4)) and a 1-block vision tower (width 16, patch 14, 2 x 2 merge) projecting to 32."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    ids = tokenizer.convert_tokens_to_ids
    config = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                         rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 2, 4]),
                         bos_token_id=None, eos_token_id=ids("<|im_end|>"), pad_token_id=tokenizer.pad_token_id),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56,
                           fullatt_block_indexes=[0]),
        image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"))
    _seeded(seed)
    return Qwen2_5_VLForConditionalGeneration(config).eval()


def _qwenimage_components() -> dict[str, Any]:
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel

    tokenizer = qwen2_tokenizer()
    text_encoder = _qwen2_5_vl(tokenizer, seed=1)  # joint_attention_dim = text hidden 32
    _seeded(0)
    transformer = QwenImageTransformer2DModel(
        patch_size=2, in_channels=64, out_channels=16, num_layers=2, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=32, axes_dims_rope=(4, 6, 6)).eval()
    _seeded(2)
    # one downsampling level (scale factor 2): 32 x 32 -> a 16 x 16 x 16 latent, packed 2 x 2 into 8 x 8 tokens
    vae = AutoencoderKLQwenImage(base_dim=4, z_dim=16, dim_mult=[1, 1], num_res_blocks=1,
                                 temperal_downsample=[False]).eval()
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9, base_image_seq_len=256,
        max_image_seq_len=8192, shift_terminal=0.02, time_shift_type="exponential")  # Qwen-Image's scheduler
    return dict(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                transformer=transformer)


def _build_qwenimage():
    from diffusers import QwenImagePipeline

    return QwenImagePipeline(**_qwenimage_components())


def _build_qwenimage_edit():
    from diffusers import QwenImageEditPipeline
    from transformers import Qwen2VLImageProcessor, Qwen2VLProcessor, Qwen2VLVideoProcessor

    components = _qwenimage_components()
    # the prompt image (at most 56 x 56 pixels: 4 x 4 patches of 14, merged 2 x 2 into 4 image-pad tokens)
    sizes = dict(min_pixels=28 * 28, max_pixels=56 * 56, patch_size=14, merge_size=2, temporal_patch_size=2)
    processor = Qwen2VLProcessor(image_processor=Qwen2VLImageProcessor(**sizes), tokenizer=components["tokenizer"],
                                 video_processor=Qwen2VLVideoProcessor(**sizes))
    return QwenImageEditPipeline(processor=processor, **components)


def mistral_processor():
    """A ``PixtralProcessor``: a fast tokenizer (:func:`byte_bpe_backend` on the templates with Mistral's special tokens, pad
    ``<pad>``), :data:`MISTRAL_CHAT_TEMPLATE` and a Pixtral image processor (patch 8, longest edge 64)."""
    from transformers import PixtralImageProcessor, PixtralProcessor, PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=byte_bpe_backend(_TEMPLATE_VOCABULARY_TEXT, MISTRAL_SPECIAL_TOKENS), unk_token="<unk>", bos_token="<s>",
        eos_token="</s>", pad_token="<pad>", additional_special_tokens=list(MISTRAL_SPECIAL_TOKENS[4:]))
    return PixtralProcessor(image_processor=PixtralImageProcessor(size={"longest_edge": 64}, patch_size=8),
                            tokenizer=tokenizer, patch_size=8, spatial_merge_size=1,
                            chat_template=MISTRAL_CHAT_TEMPLATE)


def _build_flux2():
    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2Pipeline, Flux2Transformer2DModel
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    processor = mistral_processor()
    tokenizer = processor.tokenizer
    config = Mistral3Config(
        text_config=dict(model_type="mistral", vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                         num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                         max_position_embeddings=256, pad_token_id=tokenizer.pad_token_id,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id),
        vision_config=dict(model_type="pixtral", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                           num_attention_heads=2, head_dim=8, patch_size=8, image_size=64),
        image_token_index=tokenizer.convert_tokens_to_ids("[IMG]"), spatial_merge_size=1)
    _seeded(1)
    text_encoder = Mistral3ForConditionalGeneration(config).eval()
    _seeded(0)
    transformer = Flux2Transformer2DModel(  # joint_attention_dim = 3 stacked text layers x hidden 32
        patch_size=1, in_channels=32, num_layers=1, num_single_layers=1, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=96, timestep_guidance_channels=32, mlp_ratio=2.0,
        axes_dims_rope=(4, 4, 4, 4), rope_theta=2000, guidance_embeds=True).eval()
    _seeded(2)
    # one downsampling level (scale factor 2): 32 x 32 -> a 16 x 16 x 8 latent, patchified 2 x 2 into 8 x 8 x 32
    vae = AutoencoderKLFlux2(block_out_channels=(8, 16), down_block_types=("DownEncoderBlock2D",) * 2,
                             up_block_types=("UpDecoderBlock2D",) * 2, layers_per_block=1, latent_channels=8,
                             norm_num_groups=8, sample_size=32).eval()
    return Flux2Pipeline(scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True), vae=vae,
                         text_encoder=text_encoder, tokenizer=processor, transformer=transformer)


def _build_chroma():
    from diffusers import ChromaPipeline, ChromaTransformer2DModel, FlowMatchEulerDiscreteScheduler

    t5 = t5_tokenizer()
    text_encoder = _t5(t5, d_model=32, seed=1)  # joint_attention_dim = T5 d_model; no pooled text embedding
    _seeded(0)
    transformer = ChromaTransformer2DModel(
        patch_size=1, in_channels=64, num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=32, axes_dims_rope=(4, 6, 6), approximator_num_channels=16, approximator_hidden_dim=32,
        approximator_layers=1).eval()
    vae = _vae(16, seed=3, scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False,
               use_post_quant_conv=False)
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, base_shift=0.5,
                                                max_shift=1.15, base_image_seq_len=256, max_image_seq_len=4096)
    return ChromaPipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=t5,
                          transformer=transformer)


_BUILDERS.update({"qwenimage": _build_qwenimage, "qwenimage_edit": _build_qwenimage_edit, "flux2": _build_flux2,
                  "chroma": _build_chroma})


# ---------------------------------------------------------------------- skip connections, diffusion forcing and audio-video pipelines
# | family | loads as | output | latent | merged token grid |
# |---|---|---|---|---|
# | ``hunyuan_dit`` | HunyuanDiTPipeline (BERT + T5 encoders, 4 blocks: block 3 fuses block 0's output) | 64 x 64 image | 8 x 8 x 4 | 8 x 8 (patch 1) |
# | ``skyreels_v2`` | SkyReelsV2DiffusionForcingPipeline (the ``wan`` UMT5 encoder and Wan VAE) | 9 frames of 64 x 64 | 3 x 8 x 8 x 16 | 3 x 4 x 4 (patch (1, 2, 2)) |
# | ``ltx2`` | LTX2Pipeline (Gemma-3 encoder, text connectors, LTX-2 video VAE, audio VAE, vocoder) | 9 frames of 32 x 32 and 0.375 s of audio | 3 x 8 x 8 x 8 video, 9 x 4 audio | 3 x 8 x 8 video tokens (patch 1); the 9 audio tokens are context |
#
# HunyuanDiTPipeline builds its RoPE tables for an ``height // 8 // patch`` grid whatever the VAE, so the tiny VAE has
# four levels (scale factor 8); it tokenizes to 77 (BERT) and 256 (T5) tokens whatever ``max_sequence_length``, and
# the transformer's ``text_len`` / ``text_len_t5`` match them. ``use_resolution_binning=False``: its bins are 768+.
# SkyReels-V2 runs diffusion forcing asynchronously (``ar_step=1``, causal blocks of one latent frame: each frame one
# step behind the previous, 3 + 2 denoising calls); its pipelines call ``ftfy`` whether installed or not. LTX-2 runs
# its released guidance: a doubled classifier-free guidance batch, then a spatio-temporal guidance call (block 1
# perturbed) and a modality isolation call on the single batch, every step.
CURRENT_CALL_DEFAULTS.update({
    "hunyuan_dit": {"height": 64, "width": 64, "num_inference_steps": 2, "guidance_scale": 5.0,
                    "use_resolution_binning": False},
    "skyreels_v2": {"height": 64, "width": 64, "num_frames": 9, "num_inference_steps": 3, "guidance_scale": 5.0,
                    "max_sequence_length": 16, "ar_step": 1, "causal_block_size": 1},
    "ltx2": {"height": 32, "width": 32, "num_frames": 9, "num_inference_steps": 3, "guidance_scale": 3.0,
             "max_sequence_length": 16, "spatio_temporal_guidance_blocks": [1]},
})


def bert_tokenizer():
    """A WordPiece tokenizer in BERT's layout (``[PAD]`` 0, ``[UNK]``, ``[CLS]``, ``[SEP]``, ``[MASK]``, lowercase): the
    words of :func:`t5_tokenizer` and every printable ASCII character, also as a ``##`` continuation, so any
    ASCII text tokenizes."""
    from transformers import BertTokenizer

    tokens = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *_T5_WORDS.split()]
    ascii_chars = [chr(c) for c in range(33, 127) if not chr(c).isupper()]
    tokens += [c for c in ascii_chars if c not in tokens] + ["##" + c for c in ascii_chars]
    return BertTokenizer(vocab={t: i for i, t in enumerate(tokens)})


def _build_hunyuan_dit():
    from diffusers import AutoencoderKL, DDPMScheduler, HunyuanDiT2DModel, HunyuanDiTPipeline
    from transformers import BertConfig, BertModel

    bert, t5 = bert_tokenizer(), t5_tokenizer()
    config = BertConfig(vocab_size=len(bert), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=80, pad_token_id=bert.pad_token_id)
    _seeded(1)
    text_encoder = BertModel(config).eval()      # cross_attention_dim = BERT hidden
    text_encoder_2 = _t5(t5, 32, seed=2)         # cross_attention_dim_t5 = d_model (its pooler has 8 heads)
    _seeded(0)
    transformer = HunyuanDiT2DModel(  # 4 blocks: block 3 fuses block 0's output (its long skip)
        num_attention_heads=2, attention_head_dim=16, in_channels=4, patch_size=1, sample_size=8, hidden_size=32,
        num_layers=4, mlp_ratio=2.0, learn_sigma=True, cross_attention_dim=32, cross_attention_dim_t5=32,
        pooled_projection_dim=32, text_len=77, text_len_t5=256, use_style_cond_and_image_meta_size=False).eval()
    _seeded(3)
    vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8, 8, 8, 8),
                        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                        norm_num_groups=4, layers_per_block=1, sample_size=64, scaling_factor=0.13025).eval()
    scheduler = DDPMScheduler(beta_start=0.00085, beta_end=0.03, beta_schedule="scaled_linear", steps_offset=1,
                              clip_sample=False, prediction_type="v_prediction")
    return HunyuanDiTPipeline(vae=vae, text_encoder=text_encoder, tokenizer=bert, transformer=transformer,
                              scheduler=scheduler, safety_checker=None, feature_extractor=None,
                              requires_safety_checker=False, text_encoder_2=text_encoder_2, tokenizer_2=t5)



def _build_skyreels_v2():
    from diffusers import SkyReelsV2DiffusionForcingPipeline, SkyReelsV2Transformer3DModel, UniPCMultistepScheduler

    wan = _build_wan()  # its UMT5 encoder (width 32), tokenizer and Wan VAE (spatial 8, temporal 4)
    _seeded(0)
    transformer = SkyReelsV2Transformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=16, out_channels=16,
        text_dim=32, freq_dim=32, ffn_dim=64, num_layers=2, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
        rope_max_seq_len=32).eval()
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=8.0)
    return SkyReelsV2DiffusionForcingPipeline(tokenizer=wan.tokenizer, text_encoder=wan.text_encoder,
                                              transformer=transformer, vae=wan.vae, scheduler=scheduler)



def _build_ltx2():
    from diffusers import (AutoencoderKLLTX2Audio, AutoencoderKLLTX2Video, FlowMatchEulerDiscreteScheduler,
                           LTX2Pipeline, LTX2VideoTransformer3DModel)
    from diffusers.pipelines.ltx2 import LTX2TextConnectors
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3TextConfig, SiglipVisionConfig

    tokenizer = t5_tokenizer()  # the pipeline pads it on the left to max_sequence_length, as Gemma's
    text = Gemma3TextConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=64,
                            sliding_window=16, pad_token_id=tokenizer.pad_token_id)
    vision = SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                image_size=16, patch_size=8)  # unused by text prompts; part of the class
    _seeded(1)
    text_encoder = Gemma3ForConditionalGeneration(Gemma3Config(text_config=text, vision_config=vision,
                                                               mm_tokens_per_image=4)).eval()
    _seeded(2)
    # The connectors read the 3 hidden states (embeddings + 2 layers) of width 32 and return width 4 x 8 = 32 text
    # tokens for each stream (caption_channels of the transformer).
    connectors = LTX2TextConnectors(
        caption_channels=32, text_proj_in_factor=3, video_connector_num_attention_heads=4,
        video_connector_attention_head_dim=8, video_connector_num_layers=1,
        video_connector_num_learnable_registers=None, audio_connector_num_attention_heads=4, audio_connector_attention_head_dim=8, audio_connector_num_layers=1,
        audio_connector_num_learnable_registers=None, connector_rope_base_seq_len=32, rope_double_precision=False,
        rope_type="split").eval()
    _seeded(0)
    transformer = LTX2VideoTransformer3DModel(  # video width 2 x 8, audio width 2 x 4
        in_channels=8, out_channels=8, patch_size=1, patch_size_t=1, num_attention_heads=2, attention_head_dim=8,
        cross_attention_dim=16, audio_in_channels=4, audio_out_channels=4, audio_num_attention_heads=2,
        audio_attention_head_dim=4, audio_cross_attention_dim=8, num_layers=2, qk_norm="rms_norm_across_heads",
        caption_channels=32, rope_double_precision=False, rope_type="split").eval()
    _seeded(3)
    # spatial compression 4, temporal 4 (two spatiotemporal stages): 9 frames of 32 x 32 -> a 3 x 8 x 8 latent
    vae = AutoencoderKLLTX2Video(
        in_channels=3, out_channels=3, latent_channels=8, block_out_channels=(8, 8), decoder_block_out_channels=(8, 8),
        layers_per_block=(1, 1, 1), decoder_layers_per_block=(1, 1, 1), spatio_temporal_scaling=(True, True),
        decoder_spatio_temporal_scaling=(True, True), decoder_inject_noise=(False, False, False),
        downsample_type=("spatiotemporal", "spatiotemporal"), upsample_type=("spatiotemporal", "spatiotemporal"),
        upsample_residual=(False, False), upsample_factor=(1, 1), timestep_conditioning=False, patch_size=1,
        patch_size_t=1, encoder_causal=True, decoder_causal=False).eval()
    _seeded(4)
    # 8 mel bins, 2 latent channels, mel compression 4: audio tokens of 2 x 2 = 4 channels, 25 per second
    audio_vae = AutoencoderKLLTX2Audio(
        base_channels=4, output_channels=2, ch_mult=(1,), num_res_blocks=1, attn_resolutions=None, in_channels=2,
        resolution=32, latent_channels=2, norm_type="pixel", causality_axis="height", dropout=0.0,
        mid_block_add_attention=False, sample_rate=16000, mel_hop_length=160, is_causal=True, mel_bins=8).eval()
    _seeded(5)
    vocoder = LTX2Vocoder(in_channels=2 * 8, hidden_channels=32, out_channels=2, upsample_kernel_sizes=[4, 4],
                          upsample_factors=[2, 2], resnet_kernel_sizes=[3], resnet_dilations=[[1, 3, 5]],
                          output_sampling_rate=16000).eval()
    return LTX2Pipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, audio_vae=audio_vae,
                        text_encoder=text_encoder, tokenizer=tokenizer, connectors=connectors,
                        transformer=transformer, vocoder=vocoder)


_BUILDERS.update({"hunyuan_dit": _build_hunyuan_dit, "skyreels_v2": _build_skyreels_v2, "ltx2": _build_ltx2})


# ---------------------------------------------------------------------- Wan 2.2 A14B: two experts
# | ``wan22`` | WanPipeline with ``transformer`` (high noise) and ``transformer_2`` (low noise), ``boundary_ratio=0.875`` | 9 frames of 64 x 64 | as ``wan`` | as ``wan`` |
CALL_DEFAULTS["wan22"] = {**CURRENT_CALL_DEFAULTS["wan"], "num_inference_steps": 8}


def _build_wan22():
    """Wan 2.2 A14B's layout: ``wan``'s components and a second transformer of another seed, switched at
    ``boundary_ratio * 1000`` (0.875, Wan2.2-T2V-A14B's): of 8 steps (FlowMatchEuler, shift 3: timesteps 1000,
    947.5, 882.8, 800.8, 693.8, 548.0, 338.0, 8.9) the first 3 (t >= 875) run ``transformer``, the last 5
    ``transformer_2``."""
    from diffusers import WanPipeline, WanTransformer3DModel

    wan = _build_wan()
    _seeded(7)
    transformer_2 = WanTransformer3DModel(**dict(wan.transformer.config)).eval()
    return WanPipeline(tokenizer=wan.tokenizer, text_encoder=wan.text_encoder, vae=wan.vae, scheduler=wan.scheduler,
                       transformer=wan.transformer, transformer_2=transformer_2, boundary_ratio=0.875)


_BUILDERS.update({"wan22": _build_wan22})


# ---------------------------------------------------------------------- ControlNet pipelines and LoRA files
# tests/core/test_combinations_weights.py: the sd3 and flux pipelines above with a tiny ControlNet (one block of the
# transformer's width; its zero-initialised output projections re-drawn, so that the residuals it adds between
# the transformer's blocks change the image), and LoRA files written with the pipeline's ``save_lora_weights``.
#
# | family | loads as | control image |
# |---|---|---|
# | ``sd3_controlnet`` | StableDiffusion3ControlNetPipeline (SD3ControlNetModel, 1 joint block) | 32 x 32 RGB, VAE-encoded |
# | ``flux_controlnet`` | FluxControlNetPipeline (FluxControlNetModel, 1 double + 1 single block) | 32 x 32 RGB, VAE-encoded and packed |
# | ``sd3_medium`` | StableDiffusion3Pipeline, SD3-Medium's transformer layout (no q/k norm, no dual attention) | none |
CONTROLNET_CALL_DEFAULTS: dict[str, dict[str, Any]] = {
    "sd3_controlnet": {**CALL_DEFAULTS["sd3"], "controlnet_conditioning_scale": 1.0},
    "flux_controlnet": {**CALL_DEFAULTS["flux"], "controlnet_conditioning_scale": 1.0},
}


def control_image(seed: int = 0):
    """A 32 x 32 RGB PIL image of random pixels (the control input)."""
    from PIL import Image

    pixels = torch.randint(0, 256, (32, 32, 3), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)
    return Image.fromarray(pixels.numpy())


def _redraw_zero_projections(controlnet: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Random weights for the ControlNet's zero-initialised output projections (``controlnet_blocks``, ...)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in controlnet.named_parameters():
            if name.startswith(("controlnet_blocks.", "controlnet_single_blocks.", "controlnet_x_embedder.",
                                "pos_embed_input.")):
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.2)
    return controlnet


def _build_sd3_controlnet():
    from diffusers import SD3ControlNetModel, StableDiffusion3ControlNetPipeline

    base = _build_sd3()
    _seeded(5)
    controlnet = SD3ControlNetModel(
        sample_size=16, patch_size=2, in_channels=16, out_channels=16, num_layers=1, attention_head_dim=8,
        num_attention_heads=4, joint_attention_dim=64, caption_projection_dim=32, pooled_projection_dim=64,
        pos_embed_max_size=16).eval()
    components = {k: v for k, v in base.components.items() if k not in ("image_encoder", "feature_extractor")}
    return StableDiffusion3ControlNetPipeline(**components, controlnet=_redraw_zero_projections(controlnet, 6))


def _build_flux_controlnet():
    from diffusers import FluxControlNetModel, FluxControlNetPipeline

    base = _build_flux()
    _seeded(5)
    controlnet = FluxControlNetModel(
        patch_size=1, in_channels=64, num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=32, pooled_projection_dim=32, guidance_embeds=True, axes_dims_rope=(4, 6, 6)).eval()
    components = {k: v for k, v in base.components.items() if k not in ("image_encoder", "feature_extractor")}
    return FluxControlNetPipeline(**components, controlnet=_redraw_zero_projections(controlnet, 6))


def _build_sd3_medium():
    """SD3-Medium's layout: no q/k norm (the received-attention probe reads ``to_k``/``add_q_proj`` themselves,
    the layers a LoRA wraps) and no dual attention."""
    from diffusers import SD3Transformer2DModel

    pipe = _build_sd3()
    _seeded(0)
    pipe.transformer = SD3Transformer2DModel(
        sample_size=16, patch_size=2, in_channels=16, out_channels=16, num_layers=2, attention_head_dim=8,
        num_attention_heads=4, joint_attention_dim=64, caption_projection_dim=32, pooled_projection_dim=64,
        pos_embed_max_size=16).eval()
    return pipe


_BUILDERS.update({"sd3_controlnet": _build_sd3_controlnet, "flux_controlnet": _build_flux_controlnet,
                  "sd3_medium": _build_sd3_medium})

#: The LoRA's target modules, as trainers of SD3 and FLUX.1 LoRAs pick them: the attentions' image and text
#: projections, the feed-forwards, and FLUX.1's single-stream ``proj_mlp``/``proj_out`` (merge points themselves).
LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "ff.net.0.proj",
                "ff.net.2", "proj_mlp", "proj_out")


def save_tiny_lora(family: str, folder: str | Path, seed: int = 0, rank: int = 4) -> Path:
    """A rank-``rank`` LoRA of the family's transformer (``sd3``, ``sd3_medium`` or ``flux``) with random A and B (peft's
    ``init_lora_weights=False``, drawn from ``seed``), written by the pipeline class's ``save_lora_weights`` into
    ``folder/pytorch_lora_weights.safetensors``, as a trainer writes one; ``pipe.load_lora_weights(folder)`` loads
    it."""
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    pipe = build_tiny_pipeline(family)
    _seeded(seed)
    pipe.transformer.add_adapter(LoraConfig(r=rank, lora_alpha=rank, target_modules=list(LORA_TARGETS),
                                            init_lora_weights=False))
    layers = get_peft_model_state_dict(pipe.transformer)
    folder = Path(folder)
    type(pipe).save_lora_weights(folder, transformer_lora_layers=layers, safe_serialization=True)
    return folder


@functools.cache
def lora_folder(family: str, seed: int = 0) -> Path:
    """The family's tiny LoRA drawn from ``seed``, saved once per process into a temporary folder removed at exit."""
    return save_tiny_lora(family, _temp_dir(f"tomerge-tiny-lora-{family}-{seed}-"), seed=seed)


# ---------------------------------------------------------------------- loading and generating
def load_tiny_pipeline(family: str):
    """The family's tiny pipeline (saved once into ``pipeline_folder``) loaded from its folder, offline, as
    ``DiffusionPipeline.from_pretrained(folder, local_files_only=True)`` loads a researcher's weights."""
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(pipeline_folder(family), local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def generate(pipe, family: str, seeds=(0, 1)) -> torch.Tensor:
    """A 2-prompt generation of a current family's tiny pipeline with ``CURRENT_CALL_DEFAULTS[family]`` and one
    generator per image (images or video frames)."""
    out = pipe(prompt=["a photo of a cat", "a red car in the city"], output_type="pt",
               generator=[torch.Generator().manual_seed(s) for s in seeds], **CURRENT_CALL_DEFAULTS[family])
    return out.images if hasattr(out, "images") else out.frames
