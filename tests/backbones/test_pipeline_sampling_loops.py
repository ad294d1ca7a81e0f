"""The hand-written backbones (`unet`, `sd3`, `flux`, `pixart`, `dit`, `native_dit`) x the strategies and schedules of
``STRATEGIES``, end to end inside a real sampling loop.

Backbones run in the diffusers pipeline of their family, assembled from tiny random-weight components
(no download: the pipelines get ``prompt_embeds`` and no tokenizer or text encoder; the VAE is a
one-level ``AutoencoderKL`` from a config and only DiT's pipeline decodes with it). The native DiT has
no diffusers pipeline and runs in :func:`tomerge.experiments.sources.sampling.sample`.

Checked for each backbone x strategy: a 4-step generation merges and stays finite; ratio 0 and
``remove()`` are bit-identical to the unpatched pipeline; the step index comes from the pipeline's
scheduler (``clock.num_steps`` is the step count, the records cover steps ``0..S-1``); the ``sdtm``
schedule switches phase at the configured progress with the cosine ratio curve and ``toma`` skips the
first blocks of each kind and the steps it is told to; batched classifier-free guidance equals split
guidance (model level, several steps, so merge streaks, received attention and plan reuse are in play);
a batch of two samples equals the samples generated alone; fp16 pipelines run. Then SD3's skip-layer
guidance (a second transformer call per step) and ToMeSD's random destinations with per-(step, layer)
generators.

The text pipelines of diffusers import ``transformers``: without it those backbones are skipped
(DiT and the native DiT still run).
"""

from __future__ import annotations

import copy
import functools
import math
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import tomerge

# DPMSolverMultistepScheduler (PixArt) builds numpy arrays the way numpy 2 deprecates; not ours.
pytestmark = pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning")

STEPS = 4
STRATEGIES = ["tomesd", "ssm", "idm", "facility_location", "sdtm", "toma"]
BACKBONES = ["unet", "sd3", "flux", "pixart", "dit", "native_dit"]

# Options of the generation test. sdtm: the authors' "SDTM*" curve (0.5 at the first step, 0.1 at the
# last), switch at progress 0.4 (4 steps: structure 0, 1; detail 2, 3). toma: skip the first block of
# each kind and merge every other step. facility location: 4 tiles (the grids have 64 or 256 tokens).
RATIO = {"sdtm": 0.3}
OPTIONS: dict[str, dict[str, Any]] = {
    "facility_location": {"num_tiles": 4},
    "sdtm": {"deviation": 0.2, "switch": 0.4},
    "toma": {"num_tiles": 4, "skip_first": 1, "merge_every": 2},
}
# Options of the batch and guidance tests: batch-independent (tomesd without random destinations, as an
# odd batch, e.g. one branch of split guidance, disables them in tomesd), and toma with plan reuse
# across blocks and steps.
INDEPENDENT: dict[str, dict[str, Any]] = {
    "tomesd": {"use_rand": False},
    "facility_location": {"num_tiles": 4},
    "sdtm": {"deviation": 0.2},
    "toma": {"num_tiles": 4, "group_size": 2, "recompute_every": 2},
}


# ---------------------------------------------------------------------- conditioning
def _randn(shape: tuple[int, ...], seed: int) -> Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _stack(ids: tuple[int, ...], shape: tuple[int, ...], salt: int, dtype: torch.dtype) -> Tensor:
    """Per-sample conditioning: sample ``k`` always gets the same tensor, whatever batch it is in."""
    return torch.stack([_randn(shape, 1000 * salt + k) for k in ids]).to(dtype)


def _generators(ids: tuple[int, ...]) -> list[torch.Generator]:
    """One generator per sample: the pipelines draw each sample's initial noise from its own."""
    return [torch.Generator().manual_seed(k) for k in ids]


def _dtype(module: nn.Module) -> torch.dtype:
    return next(module.parameters()).dtype


# ---------------------------------------------------------------------- tiny components
def tiny_vae(latent_channels: int = 4) -> nn.Module:
    """One-level AutoencoderKL: scale factor 1, so the latent is as large as the image."""
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    return AutoencoderKL(in_channels=3, out_channels=3, latent_channels=latent_channels, block_out_channels=(8,),
                         down_block_types=("DownEncoderBlock2D",), up_block_types=("UpDecoderBlock2D",),
                         norm_num_groups=8, layers_per_block=1).eval()


def tiny_dit_transformer(seed: int = 0) -> nn.Module:
    """diffusers DiT with the 1000 ImageNet classes DiTPipeline assumes (its null class is 1000)."""
    from diffusers import DiTTransformer2DModel

    torch.manual_seed(seed)
    return DiTTransformer2DModel(num_attention_heads=4, attention_head_dim=8, in_channels=4, out_channels=8,
                                 num_layers=2, sample_size=16, patch_size=1, num_embeds_ada_norm=1000).eval()


def tiny_native_dit(seed: int = 0) -> nn.Module:
    """Native DiT, 8 x 8 tokens, with random non-zero weights (the DiT init zeroes adaLN and the output)."""
    from tomerge.backbones.timm_dit import DiT, DiTConfig

    model = DiT(DiTConfig(input_size=16, patch_size=2, in_channels=4, hidden_size=32, depth=2, num_heads=2,
                          num_classes=10, learn_sigma=False)).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return model


def build_pipeline(backbone: str) -> Any:
    """The backbone's pipeline from tiny components (the native DiT: the model itself)."""
    from diffusers import DDIMScheduler, FlowMatchEulerDiscreteScheduler

    ddim = dict(steps_offset=1, clip_sample=False)
    if backbone == "unet":
        from diffusers import StableDiffusionPipeline
        from helpers.models import tiny_unet

        pipe = StableDiffusionPipeline(vae=tiny_vae(), text_encoder=None, tokenizer=None, unet=tiny_unet(),
                                       scheduler=DDIMScheduler(**ddim), safety_checker=None, feature_extractor=None,
                                       requires_safety_checker=False)
    elif backbone == "sd3":
        from diffusers import StableDiffusion3Pipeline
        from helpers.models import tiny_sd3

        pipe = StableDiffusion3Pipeline(transformer=tiny_sd3(), scheduler=FlowMatchEulerDiscreteScheduler(),
                                        vae=tiny_vae(), text_encoder=None, tokenizer=None, text_encoder_2=None,
                                        tokenizer_2=None, text_encoder_3=None, tokenizer_3=None)
    elif backbone == "flux":
        from diffusers import FluxPipeline
        from helpers.models import tiny_flux

        pipe = FluxPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=tiny_vae(2), text_encoder=None,
                            tokenizer=None, text_encoder_2=None, tokenizer_2=None, transformer=tiny_flux())
    elif backbone == "pixart":
        from diffusers import DPMSolverMultistepScheduler, PixArtAlphaPipeline
        from helpers.models import tiny_pixart

        pipe = PixArtAlphaPipeline(tokenizer=None, text_encoder=None, vae=tiny_vae(), transformer=tiny_pixart(),
                                   scheduler=DPMSolverMultistepScheduler())
    elif backbone == "dit":
        from diffusers import DiTPipeline

        pipe = DiTPipeline(transformer=tiny_dit_transformer(), vae=tiny_vae(), scheduler=DDIMScheduler(**ddim))
    else:
        return tiny_native_dit()
    pipe.set_progress_bar_config(disable=True)
    return pipe


def model_of(pipe: Any) -> nn.Module:
    for attr in ("unet", "transformer"):
        if isinstance(getattr(pipe, attr, None), nn.Module):
            return getattr(pipe, attr)
    return pipe


@functools.cache
def pipeline(backbone: str, dtype: torch.dtype = torch.float32) -> Any:
    """Built once per backbone and dtype (every dtype from the same float32 weights)."""
    if dtype == torch.float32:
        return build_pipeline(backbone)
    return copy.deepcopy(pipeline(backbone)).to(dtype)


# ---------------------------------------------------------------------- generation
def generate(backbone: str, pipe: Any, ids: tuple[int, ...] = (0,), steps: int = STEPS, **extra: Any) -> Tensor:
    """``steps`` denoising steps with guidance for the samples ``ids``; the final latents (DiT: images)."""
    model = model_of(pipe)
    dtype = _dtype(model)
    common = dict(num_inference_steps=steps, generator=_generators(ids), **extra)
    if backbone == "unet":
        return pipe(prompt_embeds=_stack(ids, (7, 32), 1, dtype), negative_prompt_embeds=_stack(ids, (7, 32), 2, dtype),
                    height=16, width=16, output_type="latent", **common).images
    if backbone == "sd3":
        return pipe(prompt_embeds=_stack(ids, (7, 24), 1, dtype), negative_prompt_embeds=_stack(ids, (7, 24), 2, dtype),
                    pooled_prompt_embeds=_stack(ids, (16,), 3, dtype),
                    negative_pooled_prompt_embeds=_stack(ids, (16,), 4, dtype),
                    height=16, width=16, output_type="latent", **common).images
    if backbone == "flux":  # no guidance embedding: one transformer call per step
        return pipe(prompt_embeds=_stack(ids, (7, 32), 1, dtype), pooled_prompt_embeds=_stack(ids, (32,), 3, dtype),
                    height=16, width=16, output_type="latent", **common).images
    if backbone == "pixart":
        mask = torch.tensor([[1] * 5 + [0] * 2, [1] * 7])[list(ids)]  # [B, 7]: sample 0 has a padded prompt
        return pipe(prompt_embeds=_stack(ids, (7, 24), 1, dtype), prompt_attention_mask=mask, negative_prompt=None,
                    negative_prompt_embeds=_stack(ids, (7, 24), 2, dtype),
                    negative_prompt_attention_mask=torch.ones_like(mask), height=16, width=16,
                    use_resolution_binning=False, output_type="latent", **common).images
    if backbone == "dit":
        images = pipe(class_labels=[3 + k for k in ids], guidance_scale=2.0, output_type="np", **common).images
        return torch.from_numpy(images)
    from tomerge.experiments.sources.sampling import sample

    noise = torch.stack([_randn((4, 16, 16), k) for k in ids]).to(dtype)
    return sample(model, torch.tensor([3 + k for k in ids]), num_steps=steps, cfg_scale=2.0, noise=noise)


def adapter_options(backbone: str) -> dict[str, Any]:
    """``apply``'s ``adapter=`` argument for ``backbone`` (as keywords to splat)."""
    return {"adapter": {"max_downsample": 2}} if backbone == "unet" else {}


def attach(backbone: str, pipe: Any, strategy: str, ratio: float, options: dict[str, Any],
           steps: int = STEPS) -> tomerge.MergeHandle:
    """``tomerge.apply`` on the pipeline (the native DiT: on the model, with the step count given)."""
    extra = {"num_steps": steps} if backbone == "native_dit" else {}
    return tomerge.apply(pipe, strategy, ratio=ratio, **adapter_options(backbone), **options, **extra)


@functools.cache
def baseline(backbone: str) -> Tensor:
    return generate(backbone, pipeline(backbone))


def no_hooks_left(model: nn.Module) -> bool:
    return all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def kind_positions(handle: tomerge.MergeHandle) -> dict[int, int]:
    """layer -> position of the block among the blocks of its kind (Flux: double 0, 1; single 0, 1)."""
    counts: dict[str, int] = {}
    out = {}
    for block in handle.adapter.blocks():
        out[block.layer] = counts.get(block.kind, 0)
        counts[block.kind] = out[block.layer] + 1
    return out


# ---------------------------------------------------------------------- every backbone x every strategy
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("backbone", BACKBONES)
def test_generation_merges_records_the_steps_and_ratio_zero_and_remove_are_bit_identical(backbone, strategy):
    pipe, before = pipeline(backbone), baseline(backbone)
    model = model_of(pipe)
    zero = {k: v for k, v in OPTIONS.get(strategy, {}).items() if k != "deviation"}
    with tomerge.merging(pipe, strategy, ratio=0.0, **adapter_options(backbone), **zero,
                         **({"num_steps": STEPS} if backbone == "native_dit" else {})):
        assert torch.equal(generate(backbone, pipe), before)

    handle = attach(backbone, pipe, strategy, RATIO.get(strategy, 0.5), OPTIONS.get(strategy, {}))
    try:
        merged = generate(backbone, pipe)
        records, clock = handle.state.records, handle.state.clock
        positions = kind_positions(handle)
    finally:
        handle.remove()
    assert torch.equal(generate(backbone, pipe), before)
    assert no_hooks_left(model) and "_tomerge_handle" not in model.__dict__

    assert merged.shape == before.shape and torch.isfinite(merged).all() and not torch.equal(merged, before)
    assert handle.stats["tokens_removed"] > 0
    # The step index: the scheduler's position of each call's timestep (every step has the same calls).
    assert clock.num_steps == STEPS
    steps = [r.step for r in records]
    assert steps == sorted(steps) and set(steps) == set(range(STEPS))
    assert len({steps.count(s) for s in range(STEPS)}) == 1

    for r in records:
        p = r.step / (STEPS - 1)
        if strategy == "sdtm":
            assert r.ratio == pytest.approx(0.1 + 0.4 * math.cos(p * math.pi / 2))
            if p <= 0.4:
                assert (r.label, r.sublayers) == ("structure", ("attn", "mlp"))
            else:
                assert (r.label, r.sublayers) == ("detail", ("mlp",))
            assert r.num_removed > 0
        elif strategy == "toma":
            if positions[r.layer] < 1:
                assert (r.label, r.num_removed) == ("skip_block", 0)
            elif r.step % 2:
                assert (r.label, r.num_removed) == ("skip_step", 0)
            else:
                assert r.label == "merge" and r.num_removed == r.num_tokens // 2
        else:
            assert r.label == strategy and r.num_removed > 0
    if strategy == "sdtm":
        assert [r.label for r in records if r.layer == 0] == ["structure"] * 2 + ["detail"] * 2
    if strategy == "toma" and backbone == "flux":  # skip_first counts double and single blocks separately
        assert {r.layer for r in records if r.label == "skip_block"} == {0, 2}


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("backbone", BACKBONES)
def test_a_batch_of_two_equals_the_samples_generated_alone(backbone, strategy):
    """float64, so that the only difference between batch sizes, kernel rounding, stays far below the
    tolerance (in float32 facility location's greedy pick flips between near-tied candidates of these
    tiny models when a batch-size change perturbs the last bit, see test_sd3_pixart_dit.py)."""
    pipe = pipeline(backbone, torch.float64)
    options = INDEPENDENT.get(strategy, {})
    if strategy not in ("sdtm", "toma"):
        assert not tomerge.get_strategy(strategy, **options).uses_generator  # no draw shared by the batch
    outs = []
    for ids in ((0, 1), (0,), (1,)):
        with tomerge.merging(pipe, strategy, ratio=RATIO.get(strategy, 0.5), **adapter_options(backbone), **options,
                             **({"num_steps": STEPS} if backbone == "native_dit" else {})) as handle:
            outs.append(generate(backbone, pipe, ids))
            assert handle.stats["tokens_removed"] > 0
    both, first, second = outs
    torch.testing.assert_close(both, torch.cat([first, second]), rtol=1e-9, atol=1e-9)


# ---------------------------------------------------------------------- batched vs split guidance
def model_inputs(backbone: str, ids: tuple[int, ...], step: int, dtype: torch.dtype) -> dict[str, Any]:
    """Model inputs of a guidance batch at denoising ``step``: sample 0 is conditional, 1 unconditional
    (null class for DiTs); both share the latent, as in classifier-free guidance."""
    B = len(ids)
    t = 900.0 - 300.0 * step
    latent = _randn((1, 4, 16, 16), 7).to(dtype).expand(B, -1, -1, -1).clone()
    if backbone == "unet":
        return dict(sample=latent, timestep=torch.tensor(t), encoder_hidden_states=_stack(ids, (7, 32), 1, dtype))
    if backbone == "sd3":
        return dict(hidden_states=latent, timestep=torch.full((B,), t), encoder_hidden_states=_stack(ids, (7, 24), 1, dtype),
                    pooled_projections=_stack(ids, (16,), 3, dtype))
    if backbone == "flux":
        from helpers.models import image_ids

        return dict(hidden_states=_randn((1, 64, 8), 7).to(dtype).expand(B, -1, -1).clone(),
                    encoder_hidden_states=_stack(ids, (7, 32), 1, dtype), pooled_projections=_stack(ids, (32,), 3, dtype),
                    timestep=torch.full((B,), t / 1000, dtype=dtype), img_ids=image_ids(8, 8), txt_ids=torch.zeros(7, 3))
    if backbone == "pixart":
        mask = torch.tensor([[1] * 5 + [0] * 2, [1] * 7])[list(ids)]
        return dict(hidden_states=latent, encoder_hidden_states=_stack(ids, (7, 24), 1, dtype),
                    encoder_attention_mask=mask, timestep=torch.full((B,), t),
                    added_cond_kwargs={"resolution": None, "aspect_ratio": None})
    labels = torch.tensor([3 if k == 0 else (1000 if backbone == "dit" else 10) for k in ids])
    if backbone == "dit":
        return dict(hidden_states=latent, timestep=torch.full((B,), t), class_labels=labels)
    return dict(x=latent, t=torch.full((B,), t / 1000, dtype=dtype), y=labels)


def call_model(model: nn.Module, inputs: dict[str, Any]) -> Tensor:
    with torch.no_grad():
        out = model(**inputs)
    return out if isinstance(out, Tensor) else out.sample


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("backbone", BACKBONES)
def test_batched_guidance_equals_split_guidance(backbone, strategy):
    """Three steps of (cond, uncond) calls, batched vs one call per branch at the same timestep, each on a
    fresh application: per-sample plans, merge streaks, received attention and (toma) plans reused across
    blocks and steps must not mix the branches. float64 for the reason given above."""
    model = model_of(pipeline(backbone, torch.float64))
    options = {**adapter_options(backbone), **INDEPENDENT.get(strategy, {})}
    runs = []
    for split in (False, True):
        with tomerge.merging(model, strategy, ratio=RATIO.get(strategy, 0.5), num_steps=3, **options) as handle:
            outs = []
            for step in range(3):
                if split:
                    outs.append(torch.cat([call_model(model, model_inputs(backbone, (k,), step, torch.float64))
                                           for k in (0, 1)]))
                else:
                    outs.append(call_model(model, model_inputs(backbone, (0, 1), step, torch.float64)))
            assert handle.stats["tokens_removed"] > 0
            assert {r.step for r in handle.state.records} == {0, 1, 2}
        runs.append(torch.stack(outs))
    torch.testing.assert_close(runs[1], runs[0], rtol=1e-9, atol=1e-9)


# ---------------------------------------------------------------------- fp16
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("backbone", BACKBONES)
def test_fp16_generation_runs(backbone, strategy):
    """CPU runs every op of these pipelines in fp16 with torch 2.14 (bf16: test_sd3_pixart_dit.py)."""
    pipe = pipeline(backbone, torch.float16)
    handle = attach(backbone, pipe, strategy, RATIO.get(strategy, 0.5), OPTIONS.get(strategy, {}))
    seen: list[torch.dtype] = []
    probe = model_of(pipe).register_forward_hook(
        lambda m, a, out: seen.append((out if isinstance(out, Tensor) else out[0]).dtype))
    try:
        out = generate(backbone, pipe)
        assert handle.stats["tokens_removed"] > 0
    finally:
        probe.remove()
        handle.remove()
    assert torch.isfinite(out).all() and seen and set(seen) == {torch.float16}


# ---------------------------------------------------------------------- several calls per step
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_sd3_skip_layer_guidance_calls_share_the_step(strategy):
    """StableDiffusion3Pipeline with skip-layer guidance calls the transformer twice on steps 1..3 (the
    guidance batch, then the conditional batch without block 1): both calls record the same step."""
    pipe = pipeline("sd3")
    calls: list[float] = []
    counter = pipe.transformer.register_forward_pre_hook(
        lambda m, a, kw: calls.append(float(kw["timestep"].flatten()[0])), with_kwargs=True)
    handle = attach("sd3", pipe, strategy, RATIO.get(strategy, 0.5), OPTIONS.get(strategy, {}))
    try:
        out = generate("sd3", pipe, skip_guidance_layers=[1], skip_layer_guidance_start=0.0,
                       skip_layer_guidance_stop=1.0)
        records, clock = handle.state.records, handle.state.clock
    finally:
        counter.remove()
        handle.remove()
    assert torch.isfinite(out).all()
    assert len(calls) == STEPS + (STEPS - 1)  # skip-layer guidance on steps i > 0
    assert clock.num_steps == STEPS
    # Step 0: blocks 0, 1 of the guidance call. Steps 1..3: blocks 0, 1, then block 0 of the skip-layer call.
    assert [r.step for r in records] == [0, 0] + [s for s in range(1, STEPS) for _ in range(3)]
    assert [r.layer for r in records] == [0, 1] + [0, 1, 0] * (STEPS - 1)
    for s in range(STEPS):
        labels = {r.label for r in records if r.step == s and r.layer == 0}
        assert len(labels) == 1  # the schedule saw the same step in both calls
    if strategy == "sdtm":
        assert [r.label for r in records if r.layer == 0] == ["structure"] + ["structure"] * 2 + ["detail"] * 4


# ---------------------------------------------------------------------- ToMeSD's random destinations
def test_tomesd_random_destinations_per_step_and_layer_are_batch_independent_across_guidance_pairs():
    """With ``rng="per_step_layer"`` a guidance pair draws the same destinations whether it is batched
    with another pair or alone (one draw for the batch, seeded by step and layer). A single branch of
    split guidance is an odd batch, where tomesd (and so this strategy) uses no randomness."""
    model = model_of(pipeline("sd3", torch.float64))
    options = dict(use_rand=True, rng="per_step_layer", num_steps=2)

    def run(ids: tuple[int, ...]) -> Tensor:  # [steps, B, ...]; samples 0, 1: one prompt's pair, 2, 3: another's
        return torch.stack([call_model(model, model_inputs("sd3", ids, step, torch.float64)) for step in range(2)])

    outs = {}
    for ids in ((0, 1, 2, 3), (0, 1), (2, 3)):
        with tomerge.merging(model, "tomesd", ratio=0.5, **options) as handle:
            outs[ids] = run(ids)
            assert handle.stats["tokens_removed"] > 0
    both = outs[(0, 1, 2, 3)]
    torch.testing.assert_close(both[:, :2], outs[(0, 1)], rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(both[:, 2:], outs[(2, 3)], rtol=1e-9, atol=1e-9)
    with tomerge.merging(model, "tomesd", ratio=0.5, use_rand=False, num_steps=2):
        fixed = run((0, 1))
    assert not torch.equal(fixed, outs[(0, 1)])  # the random layout is really used
