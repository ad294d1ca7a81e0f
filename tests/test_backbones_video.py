"""The declared adapters of video transformers on ``(T, H, W)`` token grids: `wan` (Wan 2.1/2.2 text- and
image-to-video), `hunyuan_video` (HunyuanVideo), `hunyuan_video15` (HunyuanVideo 1.5) and `ltx` (LTX-Video),
on random-weight diffusers models built from their released configurations with fewer heads and 1-2 blocks
of each kind (see each builder). The checks are those of ``test_backbones_current.py`` (whose helpers this
file uses), on frames x height x width grids, plus the video specifics: per-token timesteps, the
image-to-video inputs, HunyuanVideo's joint key mask.
"""

from __future__ import annotations

import dataclasses
import math
import types

import pytest
import torch
from torch import nn

import tomerge
from tomerge.registry import backbone_class
from test_backbones_current import (ALL_SUBLAYERS, Family, Permute, check_batch_equals_samples,
                                    check_inference_mode, check_bit_identical,
                                    check_flops, check_odd_grid_merges, check_permutation_is_exact, generate,
                                    load_tiny_pipeline, run)


def _seed(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------------- families
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
    g = _seed(seed)
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
    g = _seed(seed)
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
    g = _seed(seed)
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
    g = _seed(seed)
    T, H, W = grid
    mask = torch.ones(batch, text, dtype=torch.long)
    mask[1:, text - 3:] = 0
    return dict(hidden_states=torch.randn(batch, T * H * W, 128, generator=g).to(dtype),  # packed [B, N, C]
                encoder_hidden_states=torch.randn(batch, text, 4096, generator=g).to(dtype),
                timestep=torch.full((batch,), 500.0, dtype=dtype), encoder_attention_mask=mask,
                num_frames=T, height=H, width=W, rope_interpolation_scale=(8 / 25, 32, 32))


FAMILIES = {
    "wan": Family("wan", build_wan, wan_inputs, ("blocks",), ("wan", "wan"), (2, 4, 4), (1, 4, 4), (3, 5, 7)),
    "wan_i2v": Family("wan", build_wan_i2v, wan_inputs, ("blocks",), ("wan", "wan"), (2, 4, 4), (1, 4, 4),
                      (3, 5, 7)),
    "hunyuan_video": Family("hunyuan_video", build_hunyuan_video, hunyuan_video_inputs,
                            ("transformer_blocks", "single_transformer_blocks"), ("double", "single"), (2, 4, 4),
                            (1, 4, 4), (3, 5, 7)),
    "hunyuan_video15": Family("hunyuan_video15", build_hunyuan_video15, hunyuan_video15_inputs,
                              ("transformer_blocks",), ("double", "double"), (2, 4, 4), (1, 4, 4), (3, 5, 7)),
    "ltx": Family("ltx", build_ltx, ltx_inputs, ("transformer_blocks",), ("ltx", "ltx"), (2, 4, 4), (1, 4, 4),
                  (3, 5, 7)),
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


@pytest.mark.parametrize("strategy", ["tomesd", "ssm"])
@pytest.mark.parametrize("name", FAMILIES)
def test_ratio_zero_and_remove_are_bit_identical(models, name, strategy):
    model = models[name]
    check_bit_identical(model, FAMILIES[name].inputs(model), strategy,
                        **({"use_rand": False} if strategy == "tomesd" else {}))


@pytest.mark.parametrize("name", FAMILIES)
def test_half_ratio_is_finite_right_shape_and_merges_the_video_grid(models, name):
    family, model = FAMILIES[name], models[name]
    inputs = family.inputs(model)
    before = run(model, inputs)
    with tomerge.merging(model, "ssm", ratio=0.5, round_windows=1, **ALL_SUBLAYERS) as handle:
        out = run(model, inputs)
        assert handle.adapter.grid_size == family.grid  # (T, H, W)
        records = handle.state.records
    assert out.shape == before.shape and torch.isfinite(out).all()
    assert [r.block_kind for r in records] == list(family.kinds) and all(r.num_removed > 0 for r in records)


@pytest.mark.parametrize("name", FAMILIES)
def test_half_ratio_blocks_cost_what_half_the_tokens_cost(models, name):
    check_flops(models[name], FAMILIES[name], name)


@pytest.mark.parametrize("name", FAMILIES)
def test_permuted_slots_give_the_unpatched_output(models, name, monkeypatch):
    """Exact only if every slot carries its token's 3-D RoPE position (Wan's [1, N, 1, d] table, HunyuanVideo's
    image rows and its joint key mask, LTX's batched [B, N, C] table)."""
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


@pytest.mark.tie_sensitive
@pytest.mark.parametrize("name", FAMILIES)
def test_a_batch_equals_its_samples_alone(models, name):
    family, model = FAMILIES[name], models[name]
    check_batch_equals_samples(model, family.inputs(model, seed=5))


@pytest.mark.parametrize("name", FAMILIES)
def test_grids_with_leftover_rows_and_frames_merge(models, name):
    check_odd_grid_merges(models[name], FAMILIES[name])


# ---------------------------------------------------------------------- family specifics
def test_wan_odd_latent_sizes_floor_like_the_patch_embedding(models):
    model = models["wan"]
    inputs = wan_inputs(model, grid=(2, 4, 4))
    inputs["hidden_states"] = torch.randn(2, 16, 2, 9, 11, generator=_seed(2))  # 9 x 11 latent -> 4 x 5 patches
    with tomerge.merging(model, "tomesd", ratio=0.5, use_rand=False) as handle:
        out = run(model, inputs)
        assert handle.adapter.grid_size == (2, 4, 5) and handle.stats["tokens_removed"] > 0
    assert out.shape == (2, 16, 2, 8, 10) and torch.isfinite(out).all()


def test_wan_per_token_timesteps_give_the_step_by_their_largest_value(models):
    """Wan 2.2 TI2V passes a timestep per token ([B, N]; 0 on the conditioning frame)."""
    model = models["wan"]
    with tomerge.merging(model, "tomesd", ratio=0.5, num_steps=3) as handle:
        for t in (999.0, 500.0):
            inputs = wan_inputs(model)
            timestep = torch.full((2, 32), t)
            timestep[:, :16] = 0.0  # first frame: the conditioning image
            adapter_t = handle.adapter.call_timestep((), dict(inputs, timestep=timestep))
            assert adapter_t.tolist() == [t, t]
            handle.state.begin_model_call(adapter_t)
        assert handle.state.clock.step == 1


def test_hunyuan_video_joint_key_mask_follows_the_slots(models):
    """HunyuanVideo masks padded text keys in a [B, 1, 1, N + T] mask over [image, text]: merged calls gather
    its image columns, so the second (padded) prompt is masked as before (the permutation test is exact with
    it); a wrong mask length would raise inside SDPA."""
    model = models["hunyuan_video"]
    seen = []
    with tomerge.merging(model, "tomesd", ratio=0.5, use_rand=False, **ALL_SUBLAYERS):
        attn = model.transformer_blocks[0].attn
        hook = attn.register_forward_pre_hook(lambda m, a, k: seen.append(k["attention_mask"]), with_kwargs=True)
        try:
            run(model, hunyuan_video_inputs(model))
        finally:
            hook.remove()
    mask = seen[0]  # [B, 1, 1, M + T]
    assert mask.shape == (2, 1, 1, 16 + 8)
    assert mask[0].all() and mask[1, 0, 0, :21].all() and not mask[1, 0, 0, 21:].any()


# ---------------------------------------------------------------------- a pipeline from a local folder
@pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning")
def test_wan_pipeline_loaded_from_a_local_folder_merges_and_is_restored(monkeypatch):
    """WanPipeline (UMT5, Wan VAE, flow-matching Euler) saved and loaded offline: 9 frames of 64 x 64 are a
    3 x 4 x 4 token grid; the pipeline calls the transformer twice per step (conditional, unconditional), and
    both calls share the scheduler's step; the video changes and is bit-identical again afterwards."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    pipe = load_tiny_pipeline("wan")
    assert type(pipe).__name__ == "WanPipeline"
    before = generate(pipe, "wan")
    with tomerge.merging(pipe, "tomesd", ratio=0.5, use_rand=False, merge_mlp=True) as handle:
        merged = generate(pipe, "wan")
        assert handle.model is pipe.transformer and handle.adapter.name == "wan"
        assert handle.adapter.grid_size == (3, 4, 4)
        assert [r.step for r in handle.state.records] == [0] * 4 + [1] * 4 and handle.state.clock.num_steps == 2
        assert all(r.num_tokens == 48 and r.num_removed == 24 for r in handle.state.records)
    assert merged.shape == before.shape == (2, 9, 3, 64, 64) and torch.isfinite(merged).all()
    assert not torch.equal(merged, before)
    assert torch.equal(generate(pipe, "wan"), before)


@pytest.mark.parametrize("name", FAMILIES)
def test_merging_runs_under_inference_mode(models, name):
    """Inference tensors (``torch.inference_mode``, what benchmarks and pipelines use) have no version
    counter: the adapters must not read one. The result equals the ``no_grad`` one."""
    check_inference_mode(models[name], FAMILIES[name].inputs(models[name]))


@pytest.mark.parametrize("name", ["wan", "ltx", "hunyuan_video", "hunyuan_video15"])
def test_idm_and_sdtm_record_received_attention(models, name):
    """Every video family declares a probe (Wan and LTX-Video on their image self-attention, HunyuanVideo on
    its joint attention: tests/test_probes.py): idm (the attention variant) gets the received attention of the
    same block call and merges, and so does sdtm's detail phase."""
    family, model = FAMILIES[name], models[name]
    inputs = family.inputs(model)
    before = run(model, inputs)
    with tomerge.merging(model, "idm", ratio=0.5) as handle:
        out = run(model, inputs)
        assert set(handle.state.attention) == {0, 1}  # both blocks recorded, [B, N] each
        assert all(a.shape == (2, math.prod(family.grid)) for a in handle.state.attention.values())
        assert all(r.num_removed > 0 for r in handle.state.records)
    assert torch.isfinite(out).all() and not torch.equal(out, before)
    assert torch.equal(run(model, inputs), before)
    with tomerge.merging(model, "sdtm", ratio=0.5, order="detail_first", switch=1.0, num_steps=2) as handle:
        run(model, inputs)
        assert {r.label for r in handle.state.records} == {"detail"}
