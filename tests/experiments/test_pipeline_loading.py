"""Loading a pipeline folder (`model: {pipeline: ...}`): through `accelerate`, a Wan pipeline saved with
``save_pretrained`` loads in bf16 with the modules its class keeps in fp32 left in fp32, and diffusers no longer
warns that `accelerate` is missing; `model.offload` is validated, and merging composes with accelerate's
offload hooks.
"""

from __future__ import annotations

import pytest
import torch

from helpers import local_pipelines
import tomerge
from tomerge.experiments.sources.devices import place_pipeline
from tomerge.experiments.sources.items import Item
from tomerge.experiments.sources.models import ModelSpec
from tomerge.experiments.sources.pipelines import PipelineSource

pytestmark = pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning")


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def test_a_wan_pipeline_loads_in_bf16_with_its_fp32_modules_kept_and_generates():
    from diffusers import WanTransformer3DModel

    folder = local_pipelines.pipeline_folder("wan")
    spec = ModelSpec(kind="pipeline", path=str(folder), dtype="bf16",
                     call={**local_pipelines.CURRENT_CALL_DEFAULTS["wan"], "num_inference_steps": 1})
    with local_pipelines.diffusers_log() as records:
        source = PipelineSource(spec)
    assert not [r.getMessage() for r in records if r.levelno >= 30], "diffusers warned while loading"

    keep = WanTransformer3DModel._keep_in_fp32_modules  # diffusers' rule: a name component of the submodule
    assert keep and "time_embedder" in keep
    dtypes = {name: p.dtype for name, p in source.pipe.transformer.named_parameters()}
    kept = {name for name in dtypes if any(k in name.split(".") for k in keep)}
    assert "condition_embedder.time_embedder.linear_1.weight" in kept and "scale_shift_table" in kept
    assert "blocks.0.attn1.to_q.weight" not in kept
    assert {name for name, dtype in dtypes.items() if dtype == torch.float32} == kept
    assert {dtypes[name] for name in set(dtypes) - kept} == {torch.bfloat16}
    for name in ("text_encoder", "vae"):
        assert {p.dtype for p in getattr(source.pipe, name).parameters()} == {torch.bfloat16}, name

    video = source.generate([Item(0, 0, prompt="a red car in the city")])  # [1, T, 3, H, W] in [-1, 1]
    assert video.shape == (1, local_pipelines.CURRENT_CALL_DEFAULTS["wan"]["num_frames"], 3, 64, 64)
    assert torch.isfinite(video).all() and video.std() > 0


# ---------------------------------------------------------------------- model.offload
@pytest.mark.parametrize("value, message", [
    ({"pipeline": "/m", "device": "cuda", "offload": "modle"},
     "model.offload must be model or sequential (or left out), got 'modle'; did you mean 'model'?"),
    ({"pipeline": "/m", "offload": "model"},
     "model.offload: model needs model.device: cuda (it keeps the pipeline's models in CPU memory and moves each to "
     "the GPU when it runs; with model.device 'cpu' they are in CPU memory already): set model.device: cuda, or "
     "remove model.offload"),
    ({"reference": "bundled", "device": "cuda", "offload": "sequential"},
     "model.offload is for pipeline folders (model: {pipeline: PATH, ...}); the reference DiT runs whole on "
     "model.device"),
])
def test_offload_values_that_make_no_sense_are_config_errors(value, message):
    spec, problems = ModelSpec.parse(value)
    assert problems == [message]
    assert spec is not None and spec.offload is None  # the rest of the model is still checked
    with pytest.raises(ValueError, match="model.offload"):
        ModelSpec.from_config(value)


@pytest.mark.parametrize("mode", ["model", "sequential"])
def test_offload_needs_a_gpu_that_torch_sees(mode):
    folder = local_pipelines.pipeline_folder("sd")
    spec = ModelSpec.from_config({"pipeline": str(folder), "device": "cuda:0", "offload": mode})
    assert spec.offload == mode and spec.to_dict()["offload"] == mode
    if torch.cuda.is_available():
        spec.check()
    else:
        with pytest.raises(ValueError, match=rf"model.offload: {mode} needs a CUDA GPU, and torch sees none"):
            spec.check()


def test_merging_composes_with_model_offload_hooks():
    """``place_pipeline(..., offload="model")`` on the CPU: accelerate's hooks wrap every model (moving nothing),
    so merged images are bit-identical to merged images without offload, and remove() gives the baseline."""
    def generate(pipe) -> torch.Tensor:
        generators = [torch.Generator().manual_seed(s) for s in (0, 1)]
        return pipe(prompt=["a photo of a cat", "a red car"], generator=generators, output_type="pt",
                    **local_pipelines.CALL_DEFAULTS["sd"]).images

    def load(offload: str | None):
        from diffusers import DiffusionPipeline

        pipe = DiffusionPipeline.from_pretrained(local_pipelines.pipeline_folder("sd"), local_files_only=True)
        pipe.set_progress_bar_config(disable=True)
        place_pipeline(pipe, "cpu", offload)
        return pipe

    plain = load(None)
    with tomerge.merging(plain, "tomesd", ratio=0.5, use_rand=False):
        expected = generate(plain)
    offloaded = load("model")
    assert hasattr(offloaded.unet, "_hf_hook") and hasattr(offloaded.text_encoder, "_hf_hook")
    baseline = generate(offloaded)
    with tomerge.merging(offloaded, "tomesd", ratio=0.5, use_rand=False) as handle:
        merged = generate(offloaded)
        assert handle.stats["tokens_removed"] > 0
    assert torch.equal(merged, expected) and not torch.equal(merged, baseline)
    assert torch.equal(generate(offloaded), baseline)
    with pytest.raises(ValueError, match="offload must be None, model or sequential"):
        place_pipeline(offloaded, "cpu", "layers")
