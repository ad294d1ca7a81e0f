"""The declared adapters of more text-to-image transformers: `cogview4` (CogView4), `glm_image` (GLM-Image's
diffusion decoder), `cogview3plus` (CogView3-Plus), `lumina2` (Lumina-Image 2.0), `auraflow` (AuraFlow),
`hunyuan_dit` (Hunyuan-DiT), `omnigen` (OmniGen), `ernie_image` (ERNIE-Image) and `hidream` (HiDream-I1), on
random-weight diffusers models built from their released configurations with fewer heads and 1-2 blocks of each
kind (see each builder).

The checks are those of ``test_backbones_current.py`` (whose helpers this file uses): ratio 0 and ``remove()``
bit-identical, finite output of the right shape at ratio 0.5, block FLOPs at half the tokens, a per-sample
permutation giving the plain output (exact only if every slot carries its token's rotary position and every joint
sequence keeps its text; a control without the rotary gather shows positions matter), a batch equal to its
samples alone (float64), grids with leftover rows, inference mode; the family specifics (shared feed-forwards,
ragged captions, reference-image passes, padded latents), the received-attention probes against each model's own
SDPA call, the declaration language's new gathers. Every registered strategy and schedule runs on these families
in ``test_every_strategy.py``.
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
from tomerge.backbones._declared import DeclaredCall, Rope, SelfKVPoint, Site
from tomerge.backbones._gather import gather_key_mask, gather_rope
from tomerge.registry import backbone_class
from test_backbones_current import (ALL_SUBLAYERS, Family, Permute, check_batch_equals_samples,
                                    check_inference_mode, check_bit_identical,
                                    check_flops, check_odd_grid_merges, check_permutation_is_exact, no_hooks_left,
                                    run, select, to_float64)


def _seed(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _ids(*axes: int) -> Tensor:
    """``[prod(axes), len(axes)]`` raster-order positions."""
    return torch.cartesian_prod(*[torch.arange(a) for a in axes]).float()


def _padded_text_mask(batch: int, text: int, padding: int) -> Tensor:
    """``[B, T]`` ones, the samples after the first with ``padding`` padded positions at the end."""
    mask = torch.ones(batch, text, dtype=torch.long)
    mask[1:, text - padding:] = 0
    return mask


# ---------------------------------------------------------------------- families
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
    g = _seed(seed)
    H, W = grid
    inputs = dict(hidden_states=torch.randn(batch, 16, 2 * H, 2 * W, generator=g).to(dtype),
                  encoder_hidden_states=torch.randn(batch, text, 4096, generator=g).to(dtype),
                  timestep=torch.full((batch,), 1000.0 * t, dtype=dtype),
                  original_size=_size_conditions(batch, grid, dtype)["target_size"], **_size_conditions(batch, grid, dtype))
    return dict(inputs, attention_mask=_padded_text_mask(batch, text, 3)) if masked else inputs


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
    g = _seed(seed)
    H, W = grid
    inputs = dict(hidden_states=torch.randn(batch, 16, 2 * H, 2 * W, generator=g).to(dtype),
                  encoder_hidden_states=torch.randn(batch, text, 1472, generator=g).to(dtype),
                  prior_token_id=torch.randint(0, 16384, (batch, H * W), generator=g),  # the AR model's image tokens
                  prior_token_drop=torch.zeros(batch, H * W, dtype=torch.bool),
                  timestep=torch.full((batch,), 1000.0 * t - 1, dtype=dtype), **_size_conditions(batch, grid, dtype))
    return dict(inputs, attention_mask=_padded_text_mask(batch, text, 3)) if masked else inputs


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
    g = _seed(seed)
    H, W = grid
    inputs = dict(hidden_states=torch.randn(batch, 16, 2 * H, 2 * W, generator=g).to(dtype),
                  timesteps=torch.full((batch,), 1000.0 * t, dtype=dtype),
                  encoder_hidden_states_t5=torch.randn(batch, text, 4096, generator=g).to(dtype),
                  encoder_hidden_states_llama3=torch.randn(2, batch, 4, 4096, generator=g).to(dtype),  # [layers, B, T, C]
                  pooled_embeds=torch.randn(batch, 2048, generator=g).to(dtype))
    if H != W:
        latent = inputs["hidden_states"].unflatten(2, (H, 2)).unflatten(4, (W, 2))  # [B, C, H, 2, W, 2]
        inputs.update(hidden_states=latent.permute(0, 2, 4, 3, 5, 1).reshape(batch, H * W, 4 * 16),  # [B, N, p*p*C]
                      hidden_states_masks=torch.ones(batch, H * W, dtype=dtype),
                      img_ids=torch.cat([torch.zeros(H * W, 1), _ids(H, W)], dim=1)[None].expand(batch, -1, -1),
                      img_sizes=torch.tensor([[H, W]] * batch))
    return inputs


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
    g = _seed(seed)
    H, W = grid
    return dict(hidden_states=torch.randn(batch, 16, 2 * H, 2 * W, generator=g).to(dtype),
                timestep=torch.full((batch,), 1.0 - t, dtype=dtype),  # the pipeline's 1 - t / 1000
                encoder_hidden_states=torch.randn(batch, text, 2304, generator=g).to(dtype),
                encoder_attention_mask=_padded_text_mask(batch, text, padding))


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
    g = _seed(seed)
    H, W = grid
    return dict(hidden_states=torch.randn(batch, 4, 2 * H, 2 * W, generator=g).to(dtype),
                encoder_hidden_states=torch.randn(batch, text, 2048, generator=g).to(dtype),
                timestep=torch.full((batch,), t, dtype=dtype))  # the pipeline's t / 1000


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

    g = _seed(seed)
    H, W = grid
    cos, sin = get_2d_rotary_pos_embed(88, ((0, 0), (H, W)), (H, W), output_type="pt")  # [N, 88] each
    return dict(hidden_states=torch.randn(batch, 4, 2 * H, 2 * W, generator=g).to(dtype),
                timestep=torch.full((batch,), 1000.0 * t, dtype=dtype),
                encoder_hidden_states=torch.randn(batch, 4, 1024, generator=g).to(dtype),
                text_embedding_mask=_padded_text_mask(batch, 4, 2),
                encoder_hidden_states_t5=torch.randn(batch, 4, 2048, generator=g).to(dtype),
                text_embedding_mask_t5=_padded_text_mask(batch, 4, 1),
                image_rotary_emb=(cos.to(dtype), sin.to(dtype)))


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
    g = _seed(seed)
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
    g = _seed(seed)
    return dict(hidden_states=torch.randn(batch, 128, *grid, generator=g).to(dtype),
                timestep=torch.full((batch,), 1000.0 * t, dtype=dtype),
                text_bth=torch.randn(batch, text, 3072, generator=g).to(dtype),
                text_lens=torch.tensor([text] + [text - 3] * (batch - 1)))  # shorter prompts: padding masked


FAMILIES = {
    "cogview4": Family("cogview4", build_cogview4, cogview4_inputs, ("transformer_blocks",),
                       ("cogview4", "cogview4"), (8, 8), (8, 4), (5, 7)),
    "glm_image": Family("glm_image", build_glm_image, glm_image_inputs, ("transformer_blocks",),
                        ("glm_image", "glm_image"), (8, 8), (8, 4), (7, 5)),
    "cogview3plus": Family("cogview3plus", build_cogview3plus, cogview3plus_inputs, ("transformer_blocks",),
                           ("cogview3plus", "cogview3plus"), (8, 8), (8, 4), (5, 7), rope=False),
    # HiDream merges square latents only (a non-square one is padded with a key mask): its grid with leftover rows
    # is 7 x 7 and its 8 x 4 FLOP reference goes in as patchified tokens (hidream_inputs).
    "lumina2": Family("lumina2", build_lumina2, lumina2_inputs, ("noise_refiner", "layers"),
                      ("refiner", "joint", "joint"), (8, 8), (8, 4), (5, 7)),
    "auraflow": Family("auraflow", build_auraflow, auraflow_inputs, ("joint_transformer_blocks",
                       "single_transformer_blocks"), ("joint", "single"), (8, 8), (8, 4), (5, 7), rope=False),
    "hunyuan_dit": Family("hunyuan_dit", build_hunyuan_dit, hunyuan_dit_inputs, ("blocks",), ("hunyuan_dit",) * 4,
                          (8, 8), (8, 4), (5, 7)),
    "omnigen": Family("omnigen", build_omnigen, omnigen_inputs, ("layers",), ("omnigen", "omnigen"), (8, 8),
                      (8, 4), (5, 7)),
    "ernie_image": Family("ernie_image", build_ernie_image, ernie_image_inputs, ("layers",),
                          ("ernie_image", "ernie_image"), (8, 8), (8, 4), (5, 7)),
    "hidream": Family("hidream", build_hidream, hidream_inputs, ("double_stream_blocks", "single_stream_blocks"),
                      ("double", "single"), (8, 8), (8, 4), (7, 7)),
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
        specs = handle.adapter.blocks()
        assert [s.kind for s in specs] == list(family.kinds)
        assert [s.module for s in specs] == [b for c in family.containers for b in getattr(model, c)]


@pytest.mark.parametrize("name", FAMILIES)
def test_ratio_zero_and_remove_are_bit_identical(models, name):
    model = models[name]
    check_bit_identical(model, FAMILIES[name].inputs(model), "tomesd", use_rand=False)


@pytest.mark.parametrize("name", FAMILIES)
def test_half_ratio_is_finite_of_the_right_shape_and_merges_every_block(models, name):
    family, model = FAMILIES[name], models[name]
    inputs = family.inputs(model)
    before = run(model, inputs)
    with tomerge.merging(model, "tomesd", ratio=0.5, use_rand=False, **ALL_SUBLAYERS) as handle:
        out = run(model, inputs)
        assert handle.adapter.grid_size == family.grid
        records = handle.state.records
    assert out.shape == before.shape and torch.isfinite(out).all()
    assert [r.block_kind for r in records] == list(family.kinds) and all(r.num_removed > 0 for r in records)


@pytest.mark.parametrize("name", FAMILIES)
def test_half_ratio_blocks_cost_what_half_the_tokens_cost(models, name):
    check_flops(models[name], FAMILIES[name], name)


@pytest.mark.parametrize("name", FAMILIES)
def test_permuted_slots_give_the_unpatched_output(models, name, monkeypatch):
    """Exact only if every slot carries its token's rotary position and every joint sequence keeps its text."""
    family, model = FAMILIES[name], models[name]
    for grid in (family.grid, family.odd):
        check_permutation_is_exact(model, family.inputs(model, grid=grid, seed=4), None, math.prod(grid))
    if not family.rope:
        return
    # Control: without the rotary gather the same permutation changes the output (positions matter here).
    inputs = family.inputs(model, seed=4)
    before = run(model, inputs)
    adapter = backbone_class(family.backbone)
    kinds = tuple(dataclasses.replace(k, sites=tuple(dataclasses.replace(s, rope=None) for s in k.sites))
                  for k in adapter.kinds)
    monkeypatch.setattr(adapter, "kinds", kinds)
    with tomerge.merging(model, Permute(), ratio=0.5, **ALL_SUBLAYERS):
        assert (run(model, inputs) - before).abs().max() > 1e-3


def select_sample(inputs: dict, i: int) -> dict:
    """Sample ``i`` of a batch of keyword inputs; HiDream's Llama states ``[layers, B, T, C]`` by their second axis."""
    sample = select(inputs, i)
    if "encoder_hidden_states_llama3" in inputs:
        sample["encoder_hidden_states_llama3"] = inputs["encoder_hidden_states_llama3"][:, i:i + 1]
    return sample


# Hunyuan-DiT runs its FP32LayerNorms and FP32SiLU in float32 even in a float64 model: its batch and its samples
# alone differ by ~1e-7 unmerged already.
FLOAT32_INSIDE = {"hunyuan_dit"}


@pytest.mark.tie_sensitive
@pytest.mark.parametrize("name", FAMILIES)
def test_a_batch_equals_its_samples_alone(models, name):
    family, model = FAMILIES[name], models[name]
    inputs = family.inputs(model, seed=5)
    if name not in FLOAT32_INSIDE:
        check_batch_equals_samples(model, inputs, select_sample)
        return
    # As close as the unpatched model gets: another plan in the batch than alone would differ by ~1e-2.
    model64, inputs64 = copy.deepcopy(model).double(), to_float64(inputs)

    def batch_minus_samples() -> float:
        alone = torch.cat([run(model64, select_sample(inputs64, i)) for i in range(2)])
        return float((run(model64, inputs64) - alone).abs().max())

    unmerged = batch_minus_samples()
    with tomerge.merging(model64, "tomesd", ratio=0.5, use_rand=False, **ALL_SUBLAYERS) as handle:
        merged = batch_minus_samples()
        assert handle.stats["tokens_removed"] > 0
    assert unmerged < 1e-5 and merged <= 10 * unmerged, (merged, unmerged)


@pytest.mark.parametrize("name", FAMILIES)
def test_grids_with_leftover_rows_merge(models, name):
    check_odd_grid_merges(models[name], FAMILIES[name])


@pytest.mark.parametrize("name", FAMILIES)
def test_merging_runs_under_inference_mode(models, name):
    """Inference tensors have no version counter: the adapters must not read one; the result equals ``no_grad``'s."""
    check_inference_mode(models[name], FAMILIES[name].inputs(models[name]))


# ---------------------------------------------------------------------- family specifics
@pytest.mark.parametrize("name", ["cogview4", "glm_image"])
def test_the_shared_feed_forward_merges_the_image_call_and_leaves_the_text_call(models, name):
    """CogView4 and GLM-Image call one ``ff`` on the image, then on the text stream: the first call runs on the
    merged image tokens, the second on all text tokens, and with only the MLP merged the text stream's output is
    that of the unpatched block (with the attention merged, text queries would see merged image keys)."""
    family, model = FAMILIES[name], models[name]
    inputs = family.inputs(model, seed=7)
    block = model.transformer_blocks[0]

    def observed() -> tuple[list[int], Tensor, Tensor]:
        seen, text_out = [], []
        hooks = [block.ff.register_forward_pre_hook(lambda m, args: seen.append(args[0].shape[1])),
                 block.register_forward_hook(lambda m, args, out: text_out.append(out[1]))]
        try:
            out = run(model, inputs)
        finally:
            for h in hooks:
                h.remove()
        return seen, text_out[0], out

    plain_seen, plain_text, _ = observed()
    with tomerge.merging(model, "tomesd", ratio=0.5, use_rand=False, merge_attn=False, merge_mlp=True) as handle:
        seen, text, out = observed()  # hooks registered after tomerge's: they see what the module gets
        assert handle.stats["tokens_removed"] > 0
    assert plain_seen == [64, 8] and seen == [32, 8]  # the image call on 32 slots, the text call on its 8 tokens
    assert torch.isfinite(out).all()
    torch.testing.assert_close(text, plain_text, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["cogview4", "glm_image"])
def test_a_text_mask_passes_through_merged_calls(models, name):
    """CogView4's and GLM-Image's processors join the text mask [B, T] with an all-ones image part of the call's
    own length: merged calls pass it as it is, and a permutation still gives the unpatched output."""
    family, model = FAMILIES[name], models[name]
    inputs = family.inputs(model, seed=12, masked=True)
    assert not torch.equal(run(model, inputs), run(model, family.inputs(model, seed=12)))  # the mask matters
    check_permutation_is_exact(model, inputs, None, 64)


@pytest.mark.filterwarnings("ignore:tomerge. no block")
def test_glm_image_condition_image_pass_is_not_merged_and_is_not_a_step(models):
    """GLM-Image's image-to-image calls first run each condition image with the key/value cache in ``"write"``
    mode: those tokens are reference context, stored at full length, and the call (timestep 0) is not a step."""
    from diffusers.models.transformers.transformer_glm_image import GlmImageKVCache

    model = models["glm_image"]
    caches = GlmImageKVCache(num_layers=2)
    caches.set_mode("write")
    condition = glm_image_inputs(model, batch=1, grid=(4, 4), seed=8, text=0)
    condition["timestep"] = torch.zeros(1)
    with tomerge.merging(model, "tomesd", ratio=0.5, use_rand=False, **ALL_SUBLAYERS) as handle:
        run(model, dict(condition, kv_caches=caches))
        assert handle.stats["tokens_removed"] == 0 and handle.state.clock.current is None
        assert caches[0].k_caches[0].shape[1] == 16  # all 4 x 4 reference tokens' keys
        caches.set_mode("read")
        out = run(model, dict(glm_image_inputs(model, batch=1, seed=9), kv_caches=caches))
        assert handle.stats["tokens_removed"] > 0 and torch.isfinite(out).all()


def test_lumina2_ragged_and_equal_caption_lengths_both_merge_exactly(models):
    """Lumina 2 joins only each caption's real tokens before the image: with a shorter second caption its image
    tokens start 3 rows earlier and a key mask is passed, with equal captions they start at one offset and no mask
    is passed. Both give the unpatched output under a permutation, which holds only if every sample's image part
    is found at its own offset; merged at ratio 0.5 the mask keeps each sample's caption and padding."""
    model = models["lumina2"]
    for padding in (3, 0):
        check_permutation_is_exact(model, lumina2_inputs(model, seed=10, padding=padding), None, 64)
    masks: list = []
    with tomerge.merging(model, "tomesd", ratio=0.5, use_rand=False, **ALL_SUBLAYERS):
        hook = model.layers[0].attn.register_forward_pre_hook(  # after tomerge's hooks: the merged call
            lambda m, args, kwargs: masks.append(kwargs["attention_mask"]), with_kwargs=True)
        try:
            for padding in (3, 0):
                run(model, lumina2_inputs(model, seed=10, padding=padding))
        finally:
            hook.remove()
    ragged, equal = masks
    assert ragged.shape == (2, 8 + 32) and ragged[0].all()
    assert ragged[1, :5 + 32].all() and not ragged[1, 5 + 32:].any()  # 5 caption tokens, 32 slots, 3 padding
    assert equal is None


def test_lumina2_timestep_counts_steps_from_the_noise():
    """Lumina 2's pipeline passes 1 - t / 1000, rising from 0 (noise) to 1: the adapter's timesteps fall, so a
    trajectory is one trajectory and its steps count up."""
    from tomerge.backbones.lumina2 import Lumina2Adapter

    adapter = Lumina2Adapter(build_lumina2(), None)
    seen = [float(adapter.call_timestep((), {"timestep": torch.tensor([x])})[0]) for x in (0.0, 0.25, 0.5)]
    assert seen == [1.0, 0.75, 0.5]


@pytest.mark.filterwarnings("ignore:tomerge. no block")
def test_hidream_non_square_latents_are_not_merged_with_a_reason(models):
    """A non-square HiDream latent is padded to max_resolution's 256 tokens with a key mask: not merged, and the
    warning says why (calls of square latents merge as before)."""
    model = models["hidream"]
    inputs = hidream_inputs(model, grid=(4, 4))
    inputs["hidden_states"] = torch.randn(2, 16, 8, 12, generator=_seed(11))  # 4 x 6 patches
    with tomerge.merging(model, "tomesd", ratio=0.5) as handle:
        with pytest.warns(UserWarning, match="non-square"):
            out = run(model, inputs)
        assert handle.stats["tokens_removed"] == 0
        run(model, hidream_inputs(model, grid=(4, 4)))
        assert handle.stats["tokens_removed"] > 0
    assert out.shape == (2, 16, 8, 12) and torch.isfinite(out).all()


def test_hunyuan_dit_idm_records_received_attention_in_every_block(models):
    """Hunyuan-DiT's image self-attention declares a probe: idm gets every block's received attention ([B, N]) in
    the same block call and merges (the second half's blocks after their skip connection too)."""
    model = models["hunyuan_dit"]
    inputs = hunyuan_dit_inputs(model)
    with tomerge.merging(model, "idm", ratio=0.5) as handle:
        out = run(model, inputs)
        assert set(handle.state.attention) == {0, 1, 2, 3}
        assert all(a.shape == (2, 64) and torch.allclose(a.sum(-1), torch.ones(2))
                   for a in handle.state.attention.values())
        assert all(r.num_removed > 0 for r in handle.state.records)
    assert torch.isfinite(out).all()


# ---------------------------------------------------------------------- received-attention probes
# (the joint families' probes against their own SDPA calls: JOINT in test_probes.py)
def test_lumina2_probe_equals_the_models_attention(models):
    """float64, from each block's own SDPA call (grouped-query keys repeated as SDPA's ``enable_gqa`` does): the
    refiner's record is the mean over heads and its 64 image queries of their softmax over the image keys; a joint
    layer's is, per sample, what its real caption tokens' queries give its image keys (at that sample's offset:
    captions of 8 and 5 tokens), renormalised, which is test_probes' rule on the sample without its padding."""
    from test_probes import record_sdpa, reference_received_attention

    model = copy.deepcopy(models["lumina2"]).double()
    modules = {0: model.noise_refiner[0].attn, 1: model.layers[0].attn, 2: model.layers[1].attn}
    seen, hooks = record_sdpa(modules)
    try:
        with tomerge.merging(model, "idm", ratio=0.5) as handle:
            run(model, to_float64(lumina2_inputs(model)))
            recorded = dict(handle.state.attention)
    finally:
        for hook in hooks:
            hook.remove()
    assert sorted(recorded) == [0, 1, 2]
    for layer, [call] in seen.items():
        q, k, mask, scale = (call[name] for name in ("query", "key", "attn_mask", "scale"))
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)  # 3 query heads per key head
        if layer == 0:  # the image self-attention
            weights = (torch.einsum("bhqd,bhkd->bhqk", q, k) * scale).softmax(-1)  # [B, h, N, N]
            reference = weights.mean(dim=(1, 2))
        else:
            assert mask is not None  # the shorter caption's padding is masked
            reference = torch.cat([reference_received_attention(q[b:b + 1, :, :T + 64], k[b:b + 1, :, :T + 64], None,
                                                                scale, 64, text_first=True)
                                   for b, T in enumerate((8, 5))])
        torch.testing.assert_close(recorded[layer].double(), reference, rtol=1e-5, atol=1e-8)
        assert (reference.max(-1).values - reference.min(-1).values > 1e-3).all()  # not uniform: real q and k


def test_the_sdpa_probe_refuses_an_attention_without_one_sdpa_call(models, monkeypatch):
    """The SDPA probe reads the processor's torch SDPA call: an attention that makes none (another kernel) raises
    instead of leaving idm without received attention."""
    import torch.nn.functional as F

    model = models["cogview3plus"]
    monkeypatch.setattr(F, "scaled_dot_product_attention", _sdpa_by_hand)
    with tomerge.merging(model, "idm", ratio=0.5):
        with pytest.raises(RuntimeError, match="expected one call of torch.nn.functional.scaled_dot_product_attention"):
            run(model, cogview3plus_inputs(model))
    assert no_hooks_left(model)


def _sdpa_by_hand(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **kwargs):
    """Attention without torch's SDPA (as a kernel of another library would run)."""
    weights = (query @ key.transpose(-1, -2) * (scale or query.shape[-1] ** -0.5)).softmax(-1)
    return weights @ value


# ---------------------------------------------------------------------- the declaration language
def test_batched_rotary_tables_keep_text_rows_on_their_side():
    """HiDream's one table [B, N + T, ...] (image first), ERNIE's likewise, Lumina 2's [B, T + N, ...] (text first):
    the image rows gathered per slot, the text rows kept; a tensor stays a tensor, a tuple a tuple."""
    dst = torch.tensor([[2, 0], [1, 1]])  # [B, M]
    image_first = torch.arange(5.0).view(1, 5, 1)  # N = 3 image rows, then 2 text rows
    out = gather_rope(image_first, dst, 3, "batched", text_side="last")
    assert isinstance(out, Tensor) and out[..., 0].tolist() == [[2.0, 0, 3, 4], [1, 1, 3, 4]]
    text_first = torch.arange(10.0).view(2, 5, 1)  # per sample: 2 text rows, then N = 3
    cos, sin = gather_rope((text_first, text_first), dst, 3, "batched")
    assert cos[..., 0].tolist() == [[0.0, 1, 4, 2], [5, 6, 8, 8]] and torch.equal(cos, sin)
    with pytest.raises(ValueError, match="R \\+ N"):
        gather_rope(torch.zeros(1, 2, 1), dst, 3, "batched")
    with pytest.raises(ValueError, match="text rows first"):
        Rope(layout="rows", text="last")


def test_ragged_gathers_follow_each_samples_text_length():
    """Per-sample text lengths (Lumina 2): sample b is [text_b, image, padding]; tokens, rotary rows and the key mask
    of the merged call keep each sample's text and padding and take the slots' rows at that sample's offset."""
    lengths, dst = torch.tensor([2, 1]), torch.tensor([[1, 0], [2, 2]])  # T = 2 (the longest), N = 3 -> M = 2
    table = torch.arange(10.0).view(2, 5, 1)  # sample 0: t t i i i; sample 1: t i i i p
    out = gather_rope(table, dst, 3, "batched", lengths=lengths)
    assert out[..., 0].tolist() == [[0.0, 1, 3, 2], [5, 8, 8, 9]]
    mask = torch.tensor([[True] * 5, [True] * 4 + [False]])
    assert gather_key_mask(mask, dst, 3, "first", lengths=lengths).tolist() == [[True] * 4, [True] * 3 + [False]]
    call = DeclaredCall()
    call.set_text(lengths)
    assert (call.text, call.lengths.tolist()) == (2, [2, 1])
    joint = torch.arange(10.0).view(2, 5, 1)
    assert call.stream(joint, "first", "test")[..., 0].tolist() == [[2.0, 3, 4], [6, 7, 8]]
    merged = call.with_stream(joint, torch.tensor([[[-1.0], [-2.0]], [[-3.0], [-4.0]]]), "first", "test")
    assert merged[..., 0].tolist() == [[0.0, 1, -1, -2], [5, -3, -4, 9]]  # sample 1 keeps its padding row last
    call.set_text(torch.tensor([3, 3]))
    assert (call.text, call.lengths) == (3, None)  # equal lengths: one text length
    with pytest.raises(ValueError, match="text first"):
        call.set_text(lengths)
        call.stream(joint, "last", "test")


def test_a_self_kv_site_refuses_keys_from_another_tensor():
    """A ``SelfKVPoint`` site (``attn(x, x)``) merges both arguments; if the keys' input is another tensor the
    declaration is wrong for this call: it raises instead of attending merged queries to unmerged keys."""
    point = SelfKVPoint("attn", nn.Identity(), site=Site("attn", "attn", point=SelfKVPoint), info=DeclaredCall())
    x = torch.zeros(1, 4, 2)
    args, kwargs = point.set_input((), {"hidden_states": x, "encoder_hidden_states": x}, x[:, :2])
    assert kwargs["hidden_states"] is kwargs["encoder_hidden_states"] and kwargs["hidden_states"].shape[1] == 2
    with pytest.raises(RuntimeError, match="another tensor"):
        point.set_input((), {"hidden_states": x, "encoder_hidden_states": x.clone()}, x[:, :2])
