"""What the trajectory is combined with (issue 42): img2img and inpainting with ``strength < 1``, Wan 2.2's two
experts, batches and guidance, diffusers' own caches, ``compile_repeated_blocks``.

Every pipeline is a tiny random-weight one saved to a folder and loaded with ``from_pretrained(...,
local_files_only=True)`` as a user's weights are (tests/helpers/local_pipelines.py). Each cell runs ``tomesd``,
``toma``, ``sdtm_release``, ``fora``, ``first_block_cache`` and ``fora`` around ``tomesd``: at their neutral setting
(ratio 0; ``interval=1``, ``threshold=0``) the images equal the unaccelerated run bit for bit; engaged, they are finite,
differ, and ``handle.stats`` counts merged or reused calls; ``handle.remove()`` leaves the pipeline bit-exact. The step
lists are written by hand from each schedule's rule (docs/schedules.md, "The step clock").
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers import local_pipelines
import tomerge

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning",
                                        "ignore:__array__ implementation:DeprecationWarning")

NO_RAND = {"use_rand": False}
# name -> (method, engaged options, neutral options: the unaccelerated images bit for bit)
METHODS = {
    "tomesd": ("tomesd", dict(ratio=0.5, **NO_RAND), dict(ratio=0.0, **NO_RAND)),
    "toma": ("toma", dict(ratio=0.5, num_tiles=4), dict(ratio=0.0, num_tiles=4)),
    "sdtm_release": ("sdtm_release", dict(ratio=0.5), dict(ratio=0.0, deviation=0.0)),
    "fora": ("fora", {}, dict(interval=1)),
    "first_block_cache": ("first_block_cache", dict(threshold=1e9), dict(threshold=0.0)),
    "fora+tomesd": ("fora", dict(merge="tomesd", ratio=0.5, merge_options=NO_RAND),
                    dict(interval=1, merge="tomesd", ratio=0.0, merge_options=NO_RAND)),
}
# Per-sample methods: a batch of 2 gives what two runs of 1 give. Not first_block_cache (one decision for the whole
# batch, from the change over every sample) nor toma (per sample, but its facility-location gains tie within float32
# rounding, so a batch's rounding can pick another destination: docs/strategies.md, "Float32 ties change plans").
PER_SAMPLE = ("tomesd", "sdtm_release", "fora", "fora+tomesd")
BATCH_TOLERANCE = 1e-5  # the unaccelerated batch of 2 differs from its runs of 1 by ~1.5e-6 (batched kernels' rounding)


def load(pipeline_class: str, family: str):
    import diffusers

    pipe = getattr(diffusers, pipeline_class).from_pretrained(local_pipelines.pipeline_folder(family),
                                                               local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def defaults(family: str) -> dict:
    return {**local_pipelines.CALL_DEFAULTS, **local_pipelines.CURRENT_CALL_DEFAULTS}.get(family)


def labels(handle, layer: int = 0) -> list[tuple[int, str]]:
    """``(step, label)`` of every call of block ``layer``, in call order."""
    return [(r.step, r.label) for r in handle.state.records if r.layer == layer]


def engaged(handle) -> bool:
    stats = [h.stats for h in handle.experts]
    return all(s["merged_calls"] + s["reused_calls"] > 0 for s in stats)


def check_cell(run, pipe, name: str, base: np.ndarray) -> None:
    """Neutral: bit-identical; engaged: finite, different, merged or reused calls counted; remove(): bit-exact."""
    method, options, neutral = METHODS[name]
    with tomerge.merging(pipe, method, **neutral) as handle:
        np.testing.assert_array_equal(run(), base)
        assert handle.stats["block_calls"] > 0
    handle = tomerge.apply(pipe, method, **options)
    try:
        out = run()
        assert np.isfinite(out).all() and not np.array_equal(out, base)
        assert engaged(handle), [h.stats for h in handle.experts]
    finally:
        handle.remove()
    np.testing.assert_array_equal(run(), base)


# ---------------------------------------------------------------------- img2img and inpainting, strength < 1
IMAGE = torch.rand(1, 3, 32, 32, generator=torch.Generator().manual_seed(3))
MASK = torch.zeros(1, 1, 32, 32)
MASK[..., 8:24, 8:24] = 1.0

# SD3 img2img, 10 steps at strength 0.5: the pipeline runs the last 5 timesteps, which the clock counts 0..4 of 5.
# FluxInpaint, 8 steps at strength 0.875: the last 7, counted 0..6 of 7. One model call per step (SD3 batches its
# guidance; FLUX.1 is guidance-distilled).
LATE = {
    "sd3_img2img": ("StableDiffusion3Img2ImgPipeline", "sd3", dict(num_inference_steps=10, strength=0.5), 5),
    "flux_inpaint": ("FluxInpaintPipeline", "flux", dict(num_inference_steps=8, strength=0.875, mask_image=MASK), 7),
}
C, R, P, S, D = "compute", "reuse", "protected", "structure", "detail"
# (method, options) -> block -> the labels of the steps run, by hand from each rule over k = 5 and k = 7 steps
LATE_STEPS = {
    # fora: the first step, then every step whose countdown k - 1 - t is a multiple of 3 (the last one included)
    ("fora", ()): {0: {5: [C, C, R, R, C], 7: [C, R, R, C, R, R, C]}},
    # taylorseer: the first 2 steps, then every 4th from step 1: 5 (forecast in between)
    ("taylorseer", ()): {0: {5: [C, C, "forecast", "forecast", "forecast"], 7: [C, C, "forecast", "forecast",
                                                                               "forecast", C, "forecast"]}},
    # sdtm_release: every 3rd step from the first one run is protected (runs unmerged), structure phase throughout
    # (switch_step=20 is past both trajectories)
    ("sdtm_release", ()): {0: {5: [P, S, S, P, S], 7: [P, S, S, P, S, S, P]}},
    # sdtm: structure while t / (k - 1) <= 0.4 (k = 5: 0, 0.25; k = 7: 0, 1/6, 1/3), then detail
    ("sdtm", ()): {0: {5: [S, S, D, D, D], 7: [S, S, S, D, D, D, D]}},
    # toma: recompute_every=1 plans anew each step, merge_every=1 merges each step
    ("toma", (("num_tiles", 4),)): {0: {5: ["merge"] * 5, 7: ["merge"] * 7}},
    # first_block_cache (threshold never reached): the first block always runs; the second runs on the first step
    # run (nothing to reuse yet) and reuses after; accumulate=True (TeaCache) also runs the last step
    ("first_block_cache", (("threshold", 1e9),)): {0: {5: [C] * 5, 7: [C] * 7},
                                                    1: {5: [C, R, R, R, R], 7: [C] + [R] * 6}},
    ("first_block_cache", (("threshold", 1e9), ("accumulate", True))): {1: {5: [C, R, R, R, C], 7: [C] + [R] * 5 + [C]}},
    # fora around tomesd: the computed steps merge
    ("fora", (("merge", "tomesd"), ("ratio", 0.5))): {0: {5: ["tomesd", "tomesd", R, R, "tomesd"],
                                                         7: ["tomesd", R, R, "tomesd", R, R, "tomesd"]}},
}


@pytest.fixture(scope="module", params=list(LATE))
def late(request):
    """``(run, pipe, base, k)``: an img2img / inpainting pipeline, its call, its unaccelerated images and the number
    of steps the call runs."""
    pipeline_class, family, call, k = LATE[request.param]
    pipe = load(pipeline_class, family)
    kwargs = {**defaults(family), **call, "image": IMAGE, "output_type": "np"}

    def run(**extra):
        return pipe("a photo of a cat", generator=torch.Generator().manual_seed(0), **{**kwargs, **extra}).images
    return run, pipe, run(), k


@pytest.mark.parametrize("method, options", list(LATE_STEPS), ids=lambda v: v if isinstance(v, str) else
                         "-".join(f"{k}={x}" for k, x in v))
def test_strength_below_one_counts_the_steps_actually_run(late, method, options):
    """The clock counts the steps the pipeline runs, from 0 at the first one: fora's and first_block_cache's first
    step computes, sdtm's fractions and protected steps, taylorseer's warm-up and toma's windows are over them."""
    run, pipe, base, k = late
    with tomerge.merging(pipe, method, **dict(options)) as handle:
        out = run()
        for layer, expected in LATE_STEPS[(method, options)].items():
            assert labels(handle, layer) == list(enumerate(expected[k])), layer
        assert (handle.stats["step"], handle.stats["num_steps"]) == (k - 1, k)
        assert np.isfinite(out).all()


@pytest.mark.parametrize("name", list(METHODS))
def test_strength_below_one_cell(late, name):
    run, pipe, base, k = late
    check_cell(run, pipe, name, base)


def test_each_call_counts_its_own_strength_and_step_count(late):
    """One handle over calls of other strengths and step counts: each trajectory is counted from its first step."""
    run, pipe, base, k = late
    with tomerge.merging(pipe, "fora") as handle:
        for steps, strength, ran in ((10, 0.5, 5), (4, 1.0, 4), (6, 0.5, 3)):
            first = len(labels(handle))
            run(num_inference_steps=steps, strength=strength)
            assert [step for step, _ in labels(handle)[first:]] == list(range(ran)), (steps, strength)
            assert handle.stats["num_steps"] == ran


# ---------------------------------------------------------------------- Wan 2.2: two experts
@pytest.fixture(scope="module")
def wan22():
    pipe = load("WanPipeline", "wan22")
    kwargs = {**local_pipelines.CALL_DEFAULTS["wan22"], "output_type": "np"}

    def run():
        return pipe("a photo of a cat", generator=torch.Generator().manual_seed(0), **kwargs).frames
    return run, pipe, run()


# 8 steps, boundary 875: transformer runs t = 1000, 947.5, 882.8 (its steps 0..2 of 3), transformer_2 the other 5
# (its steps 0..4 of 5); two model calls per step (WanPipeline runs guidance as two calls: cond, then uncond).
WAN22_STEPS = {
    ("fora", ()): ([C, R, C], [C, C, R, R, C]),
    ("sdtm_release", ()): ([P, S, S], [P, S, S, P, S]),
    ("sdtm", ()): ([S, D, D], [S, S, D, D, D]),  # t / (k - 1) <= 0.4: k = 3: 0; k = 5: 0, 0.25
    ("taylorseer", ()): ([C, C, "forecast"], [C, C, "forecast", "forecast", "forecast"]),
}


@pytest.mark.parametrize("method, options", list(WAN22_STEPS), ids=lambda v: v if isinstance(v, str) else "")
def test_wan22_each_expert_counts_its_own_steps(wan22, method, options):
    """``apply(pipe)`` merges both experts, each with its own clock over the steps it runs (docs/backbones/wan.md)."""
    run, pipe, base = wan22
    with tomerge.merging(pipe, method, **dict(options)) as handle:
        run()
        assert [h.model for h in handle.experts] == [pipe.transformer, pipe.transformer_2]
        for expert, expected, k in zip(handle.experts, WAN22_STEPS[(method, options)], (3, 5)):
            assert labels(expert) == [(t, label) for t, label in enumerate(expected) for _ in range(2)]
            assert (expert.stats["num_steps"], expert.stats["model_calls"]) == (k, 2 * k)


@pytest.mark.parametrize("name", list(METHODS))
def test_wan22_cell(wan22, name):
    run, pipe, base = wan22
    check_cell(run, pipe, name, base)
    assert all(not m._forward_hooks and not m._forward_pre_hooks
               for model in (pipe.transformer, pipe.transformer_2) for m in model.modules())


def test_wan22_refuses_a_transformer_2_already_applied_and_leaves_nothing(wan22):
    run, pipe, base = wan22
    with tomerge.merging(pipe.transformer_2, "tomesd", ratio=0.5):
        with pytest.raises(RuntimeError, match="already applied to this WanTransformer3DModel"):
            tomerge.apply(pipe, "tomesd", ratio=0.5)
        assert all(not m._forward_hooks and not m._forward_pre_hooks for m in pipe.transformer.modules())
    np.testing.assert_array_equal(run(), base)


# ---------------------------------------------------------------------- batches and guidance
# sd3 batches its guidance into one call of 2 x batch; qwenimage runs true CFG as two calls per step (cond, then the
# negative prompt), with one negative prompt's text (batch 1) broadcast over the batch.
BATCHED = {"sd3": "StableDiffusion3Pipeline", "qwenimage": "QwenImagePipeline"}
PROMPTS = ["a photo of a cat", "a painting of a dog"]


@pytest.fixture(scope="module", params=list(BATCHED))
def batched(request):
    family = request.param
    pipe = load(BATCHED[family], family)
    kwargs = {**defaults(family), "num_inference_steps": 4, "negative_prompt": "blurry", "output_type": "np"}

    def pair():
        return pipe(PROMPTS, generator=[torch.Generator().manual_seed(s) for s in (0, 1)], **kwargs).images

    def one(prompt, seed):
        return pipe(prompt, generator=torch.Generator().manual_seed(seed), **kwargs).images[0]

    def per_prompt():  # num_images_per_prompt=2
        return pipe(PROMPTS[0], num_images_per_prompt=2, generator=[torch.Generator().manual_seed(s) for s in (0, 1)],
                    **kwargs).images
    return family, pipe, pair, one, per_prompt, (pair(), per_prompt())


@pytest.mark.parametrize("name", list(METHODS))
def test_batch_and_guidance_cell(batched, name):
    """A batch of 2 prompts (and 2 images per prompt) with a negative prompt: neutral bit-identical, engaged
    different, remove() bit-exact; per-sample methods give each image what a run of 1 gives."""
    family, pipe, pair, one, per_prompt, (base_pair, base_per_prompt) = batched
    check_cell(lambda: np.concatenate([pair(), per_prompt()]), pipe, name,
               np.concatenate([base_pair, base_per_prompt]))
    if name not in PER_SAMPLE:
        return
    method, options, _ = METHODS[name]
    with tomerge.merging(pipe, method, **options) as handle:
        together, images = pair(), per_prompt()
        calls_per_step = handle.stats["model_calls"] // 4
        alone = [one(PROMPTS[0], 0), one(PROMPTS[1], 1), one(PROMPTS[0], 1)]
    assert calls_per_step == (2 if family == "qwenimage" else 1) * 2  # the pair's and the per-prompt call's
    np.testing.assert_allclose(together, np.stack(alone[:2]), rtol=0, atol=BATCH_TOLERANCE)
    np.testing.assert_allclose(images, np.stack([alone[0], alone[2]]), rtol=0, atol=BATCH_TOLERANCE)


def test_true_cfg_calls_share_the_step_and_the_decision(batched):
    """Split guidance: both calls of a step get the step and the decision (per call index: their own caches)."""
    family, pipe, pair, one, per_prompt, _ = batched
    with tomerge.merging(pipe, "fora") as handle:
        pair()
    per_step = 2 if family == "qwenimage" else 1
    assert labels(handle) == [(t, label) for t, label in enumerate([C, R, R, C]) for _ in range(per_step)]


# ---------------------------------------------------------------------- diffusers' own caches
@pytest.fixture(scope="module")
def flux():
    pipe = load("FluxPipeline", "flux")
    kwargs = {**local_pipelines.CALL_DEFAULTS["flux"], "num_inference_steps": 4, "output_type": "np"}

    def run():
        return pipe("a photo of a cat", generator=torch.Generator().manual_seed(0), **kwargs).images
    return run, pipe, run()


TIMESTEP = dict(current_timestep_callback=lambda: 500)
DIFFUSERS_CACHES = {"FirstBlockCacheConfig": {}, "TaylorSeerCacheConfig": {}, "FasterCacheConfig": TIMESTEP,
                    "PyramidAttentionBroadcastConfig": TIMESTEP, "MagCacheConfig": dict(num_inference_steps=4, calibrate=True), "SeaCacheConfig": {},
                    "TextKVCacheConfig": {}}


def hooks_of(model) -> list:
    return [(dict(m._forward_pre_hooks), dict(m._forward_hooks)) for m in model.modules()]


@pytest.mark.parametrize("config", list(DIFFUSERS_CACHES))
def test_diffusers_cache_is_refused_in_either_order(flux, config):
    """``enable_cache`` before ``apply``: apply refuses; after it: the first call refuses. Both name the cache and
    what to do; nothing of tomerge stays, and the pipeline is bit-exact once the cache is disabled."""
    import diffusers.hooks

    run, pipe, base = flux
    cache = getattr(diffusers.hooks, config)(**DIFFUSERS_CACHES[config])
    before = hooks_of(pipe.transformer)
    pipe.transformer.enable_cache(cache)
    try:
        with pytest.raises(RuntimeError, match=rf"diffusers' {config} cache is enabled on this FluxTransformer2DModel "
                                               r"\(enable_cache\).*disable_cache\(\)"):
            tomerge.apply(pipe, "tomesd", ratio=0.5)
        assert "_tomerge_handle" not in pipe.transformer.__dict__
    finally:
        pipe.transformer.disable_cache()
    assert hooks_of(pipe.transformer) == before
    handle = tomerge.apply(pipe, "fora", merge="tomesd", ratio=0.5)
    pipe.transformer.enable_cache(cache)
    try:
        with pytest.raises(RuntimeError, match=rf"{config} cache was enabled after tomerge.apply on this"):
            run()
        assert handle.stats["block_calls"] == 0
    finally:
        handle.remove()
        pipe.transformer.disable_cache()
    np.testing.assert_array_equal(run(), base)


# ---------------------------------------------------------------------- compile_repeated_blocks after apply
@pytest.mark.parametrize("name", ["tomesd", "fora+tomesd"])
def test_compile_repeated_blocks_after_apply(flux, name):
    """diffusers' regional compilation after ``apply`` (``aot_eager``: inductor takes minutes per graph on this CPU):
    the compiled blocks run the merge hooks (the images equal eager merging), and after ``remove()`` the recompiled
    blocks give the unaccelerated images and record nothing."""
    run, pipe, base = flux
    method, options, _ = METHODS[name]
    blocks = [*pipe.transformer.transformer_blocks, *pipe.transformer.single_transformer_blocks]
    with tomerge.merging(pipe, method, **options) as handle:
        eager = run()
        eager_stats = {k: v for k, v in handle.stats.items() if k.endswith("_calls")}
        pipe.transformer.compile_repeated_blocks(backend="aot_eager")
        try:
            compiled = run()
            assert all(b._compiled_call_impl is not None for b in blocks)
            assert {k: v - eager_stats[k] for k, v in handle.stats.items() if k.endswith("_calls")} == eager_stats
            np.testing.assert_array_equal(compiled, eager)
            assert not np.array_equal(compiled, base)
        except BaseException:
            _uncompile(blocks)
            raise
    records = len(handle.state.records)
    try:
        np.testing.assert_array_equal(run(), base)
        assert len(handle.state.records) == records
    finally:
        _uncompile(blocks)


def _uncompile(blocks) -> None:
    for block in blocks:
        block._compiled_call_impl = None
    torch._dynamo.reset()
