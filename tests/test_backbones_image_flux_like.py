"""The declared adapters of current text-to-image transformers: `flux3` (FLUX.3), `chroma` (Chroma),
`qwenimage21` (Qwen-Image 2.1), `z_image` (Z-Image), `hunyuan_image` (HunyuanImage 2.1), `bria` (Bria 3.2),
`bria_fibo` (FIBO), `longcat_image` (LongCat-Image) and `ovis_image` (Ovis-Image), on random-weight diffusers
models built from their released configurations with fewer heads and 1-2 blocks of each kind (see each
builder).

The checks are those of ``test_backbones_current.py`` (whose helpers this file uses): ratio 0 and ``remove()``
bit-identical, ratio 0.5 finite and of the right shape, block FLOPs at ratio 0.5 those of half the tokens, a
per-sample permutation giving the plain output (and, as a control, a wrong one without the RoPE gather), a
batch equal to its samples alone (float64), grids with leftover rows; each received-attention probe against the
model's own attention (Qwen-Image 2.1's and Z-Image's: ``test_probes.py``); then the family specifics: masks,
reference images, Qwen-Image 2.1's condition images and prefix KV cache, Z-Image's padding, reversed timestep and
Omni calls. Every registered strategy and schedule runs on these families in ``test_every_strategy.py``.
"""

from __future__ import annotations

import dataclasses
import math
import types
from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn

import tomerge
from tomerge.backbones._gather import BatchedComplexTable, gather_pair_mask, gather_rope
from tomerge.registry import backbone_class
from test_backbones_current import (ALL_SUBLAYERS, Family, Permute, check_batch_equals_samples,
                                    check_inference_mode, check_bit_identical,
                                    check_flops, check_odd_grid_merges, check_permutation_is_exact, run, select,
                                    to_float64)
from test_probes import check_probe_matches_the_model


def _seed(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(g: torch.Generator, dtype: torch.dtype, *shape: int) -> Tensor:
    return torch.randn(*shape, generator=g).to(dtype)


def _ids(*axes: int) -> Tensor:
    """Raster-ordered position ids ``[prod(axes), len(axes)]``."""
    return torch.cartesian_prod(*[torch.arange(a) for a in axes])


def _text_mask(batch: int, text: int, padded: int = 3) -> Tensor:
    """``[B, T]`` bool: the samples after the first have ``padded`` padding tokens at the end."""
    mask = torch.ones(batch, text, dtype=torch.bool)
    mask[1:, text - padded:] = False
    return mask


def sharing(*keys: str) -> Callable[[dict, int], dict]:
    """``select`` for inputs whose ``keys`` are shared by the samples (position ids ``[N, 3]``): kept whole."""
    def pick(inputs: dict, i: int) -> dict:
        return {**select(inputs, i), **{k: inputs[k] for k in keys if k in inputs}}
    return pick


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
    g = _seed(seed)
    H, W = grid
    return dict(hidden_states=_randn(g, dtype, batch, H * W, 128),  # packed latent [B, N, 128]
                encoder_hidden_states=_randn(g, dtype, batch, text, 20480),
                timestep=torch.full((batch,), 0.5, dtype=dtype),
                img_ids=_ids(1, H, W, 1), txt_ids=_ids(1, 1, 1, text))  # (t, h, w, l), shared by the batch


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
    g = _seed(seed)
    H, W = grid
    # ChromaPipeline's mask: the T5 mask (float 0/1) with the image tokens' ones appended, [B, T + N]
    mask = torch.cat([_text_mask(batch, text), torch.ones(batch, H * W, dtype=torch.bool)], dim=1).to(dtype)
    return dict(hidden_states=_randn(g, dtype, batch, H * W, 64),
                encoder_hidden_states=_randn(g, dtype, batch, text, 4096),
                timestep=torch.full((batch,), 0.5, dtype=dtype),
                img_ids=_ids(1, H, W), txt_ids=torch.zeros(text, 3), attention_mask=mask)


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
    g = _seed(seed)
    H, W = grid
    vlm = torch.zeros(text, dtype=torch.bool)  # [T]: the prompt's image slots
    latents = [_randn(g, dtype, batch, H * W, 64)]
    shapes = [(1, H, W)]
    if condition is not None:
        h, w = condition
        vlm = torch.cat([vlm[: text // 2], torch.ones(h * w // 4, dtype=torch.bool), vlm[text // 2:]])
        latents.insert(0, _randn(g, dtype, batch, h * w, 64))
        shapes.insert(0, (1, h, w))
    img_mask = torch.cat([vlm, torch.ones(H * W // 4, dtype=torch.bool)])[None].expand(batch, -1)  # [B, S]
    prompt_mask = torch.ones(batch, vlm.shape[0], dtype=torch.bool)
    prompt_mask[1:, -2:] = False  # a padded prompt: its last text keys are excluded
    return dict(hidden_states=torch.cat(latents, dim=1), encoder_hidden_states=_randn(g, dtype, batch, vlm.shape[0],
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
    g = _seed(seed)
    H, W = grid
    lengths = [text] + [40] * (batch - 1)
    return dict(x=[_randn(g, dtype, 16, 1, 2 * H, 2 * W) for _ in range(batch)],
                t=torch.full((batch,), 0.5, dtype=dtype),
                cap_feats=[_randn(g, dtype, n, 2560) for n in lengths])


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
    g = _seed(seed)
    return dict(hidden_states=_randn(g, dtype, batch, 64, *grid), timestep=torch.full((batch,), 500.0, dtype=dtype),
                encoder_hidden_states=_randn(g, dtype, batch, text, 3584),
                encoder_attention_mask=_text_mask(batch, text).long(),
                encoder_hidden_states_2=_randn(g, dtype, batch, 4, 1472),
                encoder_attention_mask_2=_text_mask(batch, 4, padded=1).long())


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
        g = _seed(seed)
        H, W = grid
        return dict(hidden_states=_randn(g, dtype, batch, H * W, 64),
                    encoder_hidden_states=_randn(g, dtype, batch, text, width),
                    timestep=torch.full((batch,), t, dtype=dtype), img_ids=_ids(1, H, W), txt_ids=torch.zeros(text, 3))
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
    g = _seed(seed + 100)
    blocks = len(model.transformer_blocks) + len(model.single_transformer_blocks)
    mask = torch.cat([_text_mask(batch, text), torch.ones(batch, math.prod(grid), dtype=torch.bool)], dim=1)
    return dict(inputs, text_encoder_layers=[_randn(g, dtype, batch, text, 2048) for _ in range(blocks)],
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


_FLUX1 = ("transformer_blocks", "single_transformer_blocks")
_IDS = sharing("img_ids", "txt_ids")
FAMILIES = {
    "flux3": Family("flux3", build_flux3, flux3_inputs, ("mode_blocks.image", "single_transformer_blocks"),
                    ("mode", "single"), (8, 8), (8, 4), (5, 7)),
    "chroma": Family("chroma", build_chroma, chroma_inputs, _FLUX1, ("double", "single"), (8, 8), (8, 4), (5, 7)),
    "qwenimage21": Family("qwenimage21", build_qwenimage21, qwenimage21_inputs, ("transformer_blocks",),
                          ("joint", "joint"), (8, 8), (8, 4), (5, 4)),
    "z_image": Family("z_image", build_z_image, z_image_inputs, ("noise_refiner", "layers"),
                      ("refiner", "joint", "joint"), (8, 8), (8, 4), (5, 7)),
    "hunyuan_image": Family("hunyuan_image", build_hunyuan_image, hunyuan_image_inputs, _FLUX1, ("double", "single"),
                            (8, 8), (8, 4), (5, 7)),
    "bria": Family("bria", build_bria, bria_inputs, _FLUX1, ("double", "single"), (8, 8), (8, 4), (5, 7)),
    "bria_fibo": Family("bria_fibo", build_bria_fibo, bria_fibo_inputs, _FLUX1, ("double", "single"), (8, 8),
                        (8, 4), (5, 7)),
    "longcat_image": Family("longcat_image", build_longcat_image, flux1_like_inputs(3584, 0.5), _FLUX1,
                            ("double", "single"), (8, 8), (8, 4), (5, 7)),
    "ovis_image": Family("ovis_image", build_ovis_image, flux1_like_inputs(2048, 0.5), _FLUX1, ("double", "single"),
                         (8, 8), (8, 4), (5, 7)),
}
#: Sample ``i`` of a family's inputs (default: ``select``).
SELECT = {"flux3": _IDS, "chroma": _IDS, "bria": _IDS, "longcat_image": _IDS, "ovis_image": _IDS,
          "bria_fibo": select_fibo}


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
        assert [s.module for s in specs] == [b for c in family.containers for b in model.get_submodule(c)]


@pytest.mark.parametrize("name", FAMILIES)
def test_ratio_zero_and_remove_are_bit_identical(models, name):
    model = models[name]
    check_bit_identical(model, FAMILIES[name].inputs(model), "tomesd", use_rand=False)


@pytest.mark.parametrize("name", FAMILIES)
def test_half_ratio_is_finite_of_the_right_shape_and_merges_every_block(models, name):
    family, model = FAMILIES[name], models[name]
    inputs = family.inputs(model)
    before = run(model, inputs)
    with tomerge.merging(model, "ssm", ratio=0.5, round_windows=1, **ALL_SUBLAYERS) as handle:
        out = run(model, inputs)
        assert handle.adapter.grid_size == family.grid
        records = handle.state.records
    assert out.shape == before.shape and torch.isfinite(out).all()
    assert [r.block_kind for r in records] == list(family.kinds)
    assert all(r.num_tokens == math.prod(family.grid) and r.num_removed > 0 for r in records)


@pytest.mark.parametrize("name", FAMILIES)
def test_half_ratio_blocks_cost_what_half_the_tokens_cost(models, name):
    check_flops(models[name], FAMILIES[name], name)


def without_rope(adapter: type) -> tuple:
    """The adapter's kinds with no RoPE gather: the control of the permutation test."""
    return tuple(dataclasses.replace(k, sites=tuple(dataclasses.replace(s, rope=None) for s in k.sites))
                 for k in adapter.kinds)


@pytest.mark.parametrize("name", FAMILIES)
def test_permuted_slots_give_the_unpatched_output(models, name, monkeypatch):
    """Exact only if every slot carries its token's rotary position (and, with masks, its mask rows/columns) and
    the text or context part of every joint sequence is kept in place."""
    family, model = FAMILIES[name], models[name]
    for grid in (family.grid, family.odd):
        check_permutation_is_exact(model, family.inputs(model, grid=grid, seed=4), None, math.prod(grid))
    # Control: without the RoPE gather the same permutation changes the output (positions matter here).
    inputs = family.inputs(model, seed=4)
    before = run(model, inputs)
    adapter = backbone_class(family.backbone)
    monkeypatch.setattr(adapter, "kinds", without_rope(adapter))
    with tomerge.merging(model, Permute(), ratio=0.5, **ALL_SUBLAYERS):
        assert (run(model, inputs) - before).abs().max() > 1e-3


@pytest.mark.tie_sensitive
@pytest.mark.parametrize("name", FAMILIES)
def test_a_batch_equals_its_samples_alone(models, name):
    family, model = FAMILIES[name], models[name]
    check_batch_equals_samples(model, family.inputs(model, seed=5), SELECT.get(name, select))


@pytest.mark.parametrize("name", FAMILIES)
def test_grids_with_leftover_rows_merge(models, name):
    check_odd_grid_merges(models[name], FAMILIES[name])


@pytest.mark.parametrize("name", FAMILIES)
def test_merging_runs_under_inference_mode(models, name):
    """Inference tensors have no version counter: the adapters must not read one; the result equals no_grad's."""
    check_inference_mode(models[name], FAMILIES[name].inputs(models[name]))


# ---------------------------------------------------------------------- family specifics
def test_flux3_mode_block_probe_records_the_attention_each_image_token_receives(models):
    """FLUX.3's mode-block attention unflattens its heads before the q/k norms ([B, N, heads, d]); idm's record
    equals the softmax attention computed here from the same projections, averaged over heads and queries."""
    model = models["flux3"]
    inputs = flux3_inputs(model)
    attn = model.mode_blocks["image"][0].attn
    seen: list[Tensor] = []
    hook = attn.register_forward_pre_hook(lambda m, args, kwargs: seen.append(kwargs["hidden_states"]),
                                          with_kwargs=True)
    try:
        with tomerge.merging(model, "idm", ratio=0.5) as handle:  # idm merges the MLP: the attention runs in full
            run(model, inputs)
            recorded = handle.state.attention[0]  # [B, N]: layer 0 is the image mode block
            assert handle.stats["tokens_removed"] > 0
    finally:
        hook.remove()
    x = seen[0]  # [B, N, C], the attention's input
    q = attn.norm_q(attn.to_q(x).unflatten(-1, (attn.heads, -1)).float()).transpose(1, 2)  # [B, h, N, d]
    k = attn.norm_k(attn.to_k(x).unflatten(-1, (attn.heads, -1)).float()).transpose(1, 2)
    expected = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).softmax(-1).mean(dim=(1, 2))  # [B, N]
    torch.testing.assert_close(recorded, expected, rtol=1e-5, atol=1e-7)


def _attentions(*containers: str) -> Callable[[nn.Module], dict[int, nn.Module]]:
    """``{layer: attention}`` of the blocks in ``containers`` (dotted paths), in layer order."""
    def find(model: nn.Module) -> dict[int, nn.Module]:
        blocks = [block for c in containers for block in model.get_submodule(c)]
        return {layer: block.attn for layer, block in enumerate(blocks)}
    return find


JOINT = {  # family: (the attentions of its merged blocks, text first, the inputs mask padded text)
    "flux3": (_attentions("single_transformer_blocks"), True, False),
    "chroma": (_attentions(*_FLUX1), True, True),
    "hunyuan_image": (_attentions(*_FLUX1), False, True),
    "bria": (_attentions(*_FLUX1), True, False),
    "bria_fibo": (_attentions(*_FLUX1), True, True),
    "longcat_image": (_attentions(*_FLUX1), True, False),
    "ovis_image": (_attentions(*_FLUX1), True, False),
}


@pytest.mark.parametrize("name", JOINT)
def test_joint_probe_equals_the_models_attention(models, name, monkeypatch):
    """float64: the received attention idm records in every joint attention equals the probe's rule computed from
    the model's own SDPA call (``test_probes.py``): Chroma's query-by-key mask (additive 0/1, as ChromaPipeline
    passes it), FIBO's and HunyuanImage's key masks, text-first and text-last sequences. FLUX.3 is checked on its
    single blocks here (its mode blocks' self-attention probe has its own test)."""
    family, model = FAMILIES[name], models[name]
    attentions, text_first, masked = JOINT[name]
    if name == "flux3":
        adapter = backbone_class("flux3")
        monkeypatch.setattr(adapter, "kinds", adapter.kinds[1:])  # the single blocks alone: layer 0
    check_probe_matches_the_model(model, to_float64(family.inputs(model)), attentions, math.prod(family.grid),
                                  text_first=text_first, masked=masked)


@pytest.mark.filterwarnings("ignore:tomerge. no block")
def test_flux3_reference_image_calls_are_not_merged(models):
    """With reference images (image_cond_hidden_states) the single blocks' content is [image, reference]: the
    call runs unmerged, with a warning, and gives the unpatched output."""
    model = models["flux3"]
    inputs = flux3_inputs(model, grid=(4, 4))
    g = _seed(9)
    inputs.update(image_cond_hidden_states=torch.randn(2, 16, 128, generator=g),
                  image_cond_ids=_ids(1, 4, 4, 1) + torch.tensor([10, 0, 0, 0]))  # Flux3 reference ids: t = 10
    before = run(model, inputs)
    with tomerge.merging(model, "tomesd", ratio=0.5) as handle:
        with pytest.warns(UserWarning, match="reference-image"):
            out = run(model, inputs)
        assert handle.stats["tokens_removed"] == 0
    assert torch.equal(out, before)


@pytest.mark.filterwarnings("ignore:tomerge. no block")
@pytest.mark.parametrize("name", ["bria_fibo", "longcat_image"])
def test_editing_reference_ids_are_not_merged(models, name):
    """FIBO Edit and LongCat-Image Edit append the reference image's tokens and ids (another modality index, the
    same rows and columns): the ids are no single grid, so the call runs unmerged with a warning."""
    family, model = FAMILIES[name], models[name]
    inputs = family.inputs(model, grid=(4, 4))
    inputs["hidden_states"] = torch.cat([inputs["hidden_states"]] * 2, dim=1)
    inputs["img_ids"] = torch.cat([inputs["img_ids"], inputs["img_ids"] + torch.tensor([1.0, 0, 0])])
    if name == "bria_fibo":  # its key mask covers the reference tokens too
        mask = inputs["joint_attention_kwargs"]["attention_mask"]
        inputs["joint_attention_kwargs"] = {"attention_mask": torch.cat([mask, mask[..., -16:]], dim=-1)}
    before = run(model, inputs)
    with tomerge.merging(model, "tomesd", ratio=0.5) as handle:
        with pytest.warns(UserWarning, match="token grid of this"):
            out = run(model, inputs)
        assert handle.stats["tokens_removed"] == 0
    assert torch.equal(out, before)


def test_chroma_query_by_key_mask_is_gathered_on_both_axes(models):
    """Chroma's blocks turn the [B, T + N] mask into m[:, None, :, None] * m[:, None, None, :]: the merged call's
    mask is that product over [text, merged image] (the image rows and columns of the slots' tokens)."""
    model = models["chroma"]
    inputs = chroma_inputs(model)
    seen: list[Tensor] = []
    with tomerge.merging(model, "tomesd", ratio=0.5, use_rand=False, **ALL_SUBLAYERS) as handle:
        attn = model.transformer_blocks[0].attn
        hook = attn.register_forward_pre_hook(lambda m, a, k: seen.append(k["attention_mask"]), with_kwargs=True)
        try:
            run(model, inputs)
        finally:
            hook.remove()
        assert handle.stats["tokens_removed"] > 0
    m = inputs["attention_mask"][:, : 8 + 32]  # [B, T + M]: the image columns are ones, like any gather of them
    assert torch.equal(seen[0], m[:, None, :, None] * m[:, None, None, :])


def test_qwenimage21_editing_merges_the_target_and_keeps_the_condition_image(models):
    """A condition image sits inside the prompt; the target is last: the grid is the target's, every block
    removes target tokens only, and the permutation is exact (the condition tokens and their rotary rows stay)."""
    model = models["qwenimage21"]
    inputs = qwenimage21_inputs(model, grid=(4, 6), condition=(4, 4), seed=2)
    with tomerge.merging(model, "tomesd", ratio=0.5, use_rand=False) as handle:
        run(model, inputs)
        assert handle.adapter.grid_size == (4, 6)
        assert all(r.num_tokens == 24 and r.num_removed > 0 for r in handle.state.records)
    check_permutation_is_exact(model, inputs, None, 24)


def test_qwenimage21_prefix_kv_cache_steps_merge_exactly(models):
    """The pipeline's KV cache: the first step stores the prefix keys ("extract"), later steps run the target
    alone against them ("cached", a [B, 1, 1, P + N] key mask). A per-sample permutation gives the plain outputs
    of both steps, and tomesd merges both."""
    from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21KVCache

    model = models["qwenimage21"]
    inputs = qwenimage21_inputs(model, seed=3)

    def steps(strategy: str | tomerge.MergeStrategy | None = None) -> tuple[list[Tensor], list]:
        """The two steps' target outputs (merged with ``strategy``) and the merge records."""
        cache = QwenImage21KVCache(len(model.transformer_blocks))
        calls = [dict(inputs, kv_cache=cache, kv_cache_mode="extract"),
                 dict(inputs, timestep=torch.full((2,), 0.3), kv_cache=cache, kv_cache_mode="cached")]
        if strategy is None:
            return [qwenimage21_output(model, c) for c in calls], []
        with tomerge.merging(model, strategy, ratio=0.5, **ALL_SUBLAYERS) as handle:
            return [qwenimage21_output(model, c) for c in calls], handle.state.records

    plain, _ = steps()
    assert plain[1].shape == (2, 64, 64)  # cached steps return the target alone
    permuted, records = steps(Permute())
    assert [(r.step, r.num_tokens) for r in records] == [(0, 64), (0, 64), (1, 64), (1, 64)]
    for out, ref in zip(permuted, plain):
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    merged, records = steps("tomesd")
    assert all(r.num_removed > 0 for r in records) and all(torch.isfinite(out).all() for out in merged)


def test_qwenimage21_flex_block_mask_is_refused_on_merged_calls(models):
    """QwenImage21FlexAttnProcessor's BlockMask is built for the unmerged sequence: a merged call raises. Its
    prefill calls flex attention, not SDPA, so idm's probe (the target queries' SDPA call) raises too."""
    from diffusers.models.transformers.transformer_qwenimage21 import (QwenImage21AttnProcessor,
                                                                       QwenImage21FlexAttnProcessor)

    model = models["qwenimage21"]
    model.set_attn_processor(QwenImage21FlexAttnProcessor())
    try:
        with tomerge.merging(model, "tomesd", ratio=0.5):
            with pytest.raises(ValueError, match="BlockMask"):
                run(model, qwenimage21_inputs(model, grid=(4, 4)))
        with tomerge.merging(model, "idm", ratio=0.5):  # the attention runs unmerged, with the BlockMask
            with pytest.raises(RuntimeError, match="expected one call of .*scaled_dot_product_attention over the "
                                                   "most keys, got 0"):
                run(model, qwenimage21_inputs(model, grid=(4, 4)))
    finally:
        model.set_attn_processor(QwenImage21AttnProcessor())


def test_z_image_reports_the_schedulers_timestep_direction(models):
    """ZImagePipeline calls the model with t = (1000 - timestep) / 1000 (1 at the clean image): the adapter gives
    1 - t, so the clock's progress rises along the trajectory."""
    model = models["z_image"]
    with tomerge.merging(model, "tomesd", ratio=0.5) as handle:
        inputs = z_image_inputs(model, grid=(4, 4))
        assert handle.adapter.call_timestep((), dict(inputs, t=torch.full((2,), 0.25))).tolist() == [0.75, 0.75]
        for t in (0.1, 0.6):
            run(model, dict(inputs, t=torch.full((2,), t)))
        assert handle.state.clock.step == 1 and handle.state.clock.progress == pytest.approx(0.6)


def test_z_image_pads_and_captions_stay_in_place(models):
    """On a 5 x 7 grid every sample's 35 image tokens are padded to 64 and its caption follows: the refiner and
    the main blocks merge the 35 image tokens alone (the permutation test is exact on this grid too)."""
    model = models["z_image"]
    inputs = z_image_inputs(model, grid=(5, 7))
    seen: list[tuple[int, int]] = []
    with tomerge.merging(model, "tomesd", ratio=0.5, use_rand=False, **ALL_SUBLAYERS) as handle:
        hooks = [block.attention.register_forward_pre_hook(lambda m, a, k: seen.append(tuple(a[0].shape[:2])),
                                                           with_kwargs=True)
                 for block in (model.noise_refiner[0], model.layers[0])]
        try:
            run(model, inputs)
        finally:
            for h in hooks:
                h.remove()
        removed = [r.num_removed for r in handle.state.records]
    assert all(r > 0 for r in removed)
    M = 35 - removed[0]
    assert seen == [(2, M + 29), (2, M + 29 + 64)]  # merged image + image padding (+ captions padded to 64)


@pytest.mark.filterwarnings("ignore:tomerge. no block")
def test_z_image_omni_calls_are_not_merged(models):
    """Z-Image Omni's nested lists (condition images before the target) are no single grid: unmerged, a warning."""
    model = models["z_image"]
    g = _seed(8)
    inputs = dict(x=[[_randn(g, torch.float32, 16, 1, 8, 8), _randn(g, torch.float32, 16, 1, 8, 8)]],
                  t=torch.full((1,), 0.5), cap_feats=[[_randn(g, torch.float32, 8, 2560)] * 2],
                  siglip_feats=[None], image_noise_mask=[[0, 1]])
    before = run(model, inputs)
    with tomerge.merging(model, "tomesd", ratio=0.5) as handle:
        with pytest.warns(UserWarning, match="Omni"):
            out = run(model, inputs)
        assert handle.stats["tokens_removed"] == 0
    assert torch.equal(out, before)


# ---------------------------------------------------------------------- the gathers
def test_gather_pair_mask_follows_the_slots_on_both_axes():
    m = torch.tensor([[1.0, 0, 2, 3, 4]])  # 2 text, then 3 image tokens: distinct values
    pairs = (m[:, :, None] * 10 + m[:, None, :])[:, None]  # [1, 1, 5, 5]: entry (q, k) = 10 m_q + m_k
    out = gather_pair_mask(pairs, torch.tensor([[2, 0]]), 3, "first")[0, 0]  # slots: image tokens 2, 0
    kept = torch.tensor([1.0, 0, 4, 2])  # text, then the slots' tokens
    assert torch.equal(out, kept[:, None] * 10 + kept[None, :])
    last = gather_pair_mask(pairs, torch.tensor([[1]]), 3, "last")[0, 0]  # image first: tokens 0-2, text 3-4
    kept = torch.tensor([0.0, 3, 4])
    assert torch.equal(last, kept[:, None] * 10 + kept[None, :])


def test_gather_rope_complex_tables_keep_their_other_rows():
    table = torch.arange(5.0).to(torch.complex64)[:, None]  # [L = 2 other + 3 image, 1]
    dst = torch.tensor([[2, 0], [1, 1]])
    shared = gather_rope(table, dst[:1], 3, "complex")  # prefix first (Qwen-Image 2.1)
    assert torch.equal(shared[:, 0].real, torch.tensor([0.0, 1, 4, 2]))
    per_sample = gather_rope(table, dst, 3, "complex")
    assert isinstance(per_sample, BatchedComplexTable)
    assert torch.equal(per_sample.unsqueeze(1)[:, :, 0, 0].real, torch.tensor([[0.0, 1, 4, 2], [0, 1, 3, 3]]))
    batched = torch.stack([table, table + 10])  # [B, L, 1], image first (Z-Image): tokens 0-2, then 2 others
    out = gather_rope(batched, dst, 3, "complex", text_side="last")
    assert torch.equal(out[..., 0].real, torch.tensor([[2.0, 0, 3, 4], [11, 11, 13, 14]]))
