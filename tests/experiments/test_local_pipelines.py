"""The tiny saved pipelines of ``local_pipelines`` load offline as local weights, generate from text and merge.

For each family: ``DiffusionPipeline.from_pretrained(folder, local_files_only=True)`` resolves to the
family's pipeline class with its real tokenizers and text encoders; a 2-prompt, 2-step generation with
per-image generators is finite, in [0, 1], reproducible per seed and depends on the seed and on the
prompt; ``tomerge.merging(pipe, "tomesd", ...)`` changes the image and leaves it bit-identical after the
context; saving is deterministic. Then the tiny CLIP gives text and image embeddings.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from helpers import local_pipelines
import tomerge

# DPMSolver/Euler schedulers build numpy arrays the way numpy 2 deprecates; not ours.
pytestmark = pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning")

FAMILIES = local_pipelines.FAMILIES
PROMPTS = ["a photo of a cat riding a horse", "A painting of the city at night, high quality!"]
CLASSES = {"sd3": "StableDiffusion3Pipeline", "flux": "FluxPipeline", "pixart": "PixArtAlphaPipeline",
           "sdxl": "StableDiffusionXLPipeline", "sd": "StableDiffusionPipeline"}


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@functools.cache
def loaded(family: str) -> Any:
    from diffusers import DiffusionPipeline

    assert os.environ.get("HF_HUB_OFFLINE") == "1"
    pipe = DiffusionPipeline.from_pretrained(local_pipelines.pipeline_folder(family), local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def generate(family: str, seeds: tuple[int, ...] = (0, 1), prompts: list[str] = PROMPTS) -> torch.Tensor:
    generators = [torch.Generator().manual_seed(s) for s in seeds]
    return loaded(family)(prompt=prompts, generator=generators, output_type="pt",
                          **local_pipelines.CALL_DEFAULTS[family]).images


@functools.cache
def baseline(family: str) -> torch.Tensor:
    return generate(family)


@pytest.mark.parametrize("family", FAMILIES)
def test_folder_loads_as_the_family_pipeline_with_its_tokenizers_and_text_encoders(family):
    pipe = loaded(family)
    assert type(pipe).__name__ == CLASSES[family]
    clip, t5 = local_pipelines.clip_tokenizer(), local_pipelines.t5_tokenizer()
    expected = {"sd3": [("tokenizer", clip), ("tokenizer_2", clip), ("tokenizer_3", t5)],
                "flux": [("tokenizer", clip), ("tokenizer_2", t5)], "pixart": [("tokenizer", t5)],
                "sdxl": [("tokenizer", clip), ("tokenizer_2", clip)], "sd": [("tokenizer", clip)]}[family]
    for name, reference in expected:  # the saved tokenizers round-trip: same ids as the in-memory ones
        tokenizer = getattr(pipe, name)
        assert tokenizer(PROMPTS).input_ids == reference(PROMPTS).input_ids, name
        encoder = getattr(pipe, name.replace("tokenizer", "text_encoder"))
        assert encoder is not None and encoder.config.vocab_size == len(tokenizer), name
    for name, _ in expected:
        if "CLIP" in type(getattr(pipe, name)).__name__:
            assert getattr(pipe, name).model_max_length == 77


@pytest.mark.parametrize("family", FAMILIES)
def test_generation_is_finite_in_range_and_depends_on_seed_and_prompt(family):
    size = (local_pipelines.CALL_DEFAULTS[family]["height"], local_pipelines.CALL_DEFAULTS[family]["width"])
    images = baseline(family)
    assert images.shape == (2, 3, *size) and images.dtype == torch.float32
    assert torch.isfinite(images).all() and images.min() >= 0 and images.max() <= 1
    assert images.std() > 0.05  # not a flat or saturated image
    assert not torch.equal(images[0], images[1])
    assert torch.equal(generate(family), images)  # same seeds, same images
    assert not torch.equal(generate(family, seeds=(2, 1))[0], images[0])  # another seed, another image
    other = generate(family, prompts=["a dog", PROMPTS[1]])  # the prompt reaches the denoiser
    assert not torch.equal(other[0], images[0]) and torch.equal(other[1], images[1])


@pytest.mark.parametrize("family", FAMILIES)
def test_tomesd_merges_and_leaves_no_trace(family):
    before = baseline(family)
    pipe = loaded(family)
    with tomerge.merging(pipe, "tomesd", ratio=0.5, use_rand=False):
        merged = generate(family)
    assert merged.shape == before.shape and torch.isfinite(merged).all()
    assert not torch.equal(merged, before)
    assert torch.equal(generate(family), before)


def test_sdxl_merges_its_half_resolution_level_by_default():
    """SDXL has no attention at full resolution: the unet adapter's default picks the 1/2-resolution level
    (max_downsample=1, tomesd's default, merges nothing and says so)."""
    before = baseline("sdxl")
    with tomerge.merging(loaded("sdxl"), "tomesd", ratio=0.5, use_rand=False) as handle:
        merged = generate("sdxl")
        assert handle.adapter.max_downsample == 2 and handle.stats["tokens_removed"] > 0
    assert not torch.equal(merged, before)
    with pytest.warns(UserWarning, match="merged"):
        with tomerge.merging(loaded("sdxl"), "tomesd", ratio=0.5, use_rand=False, adapter={"max_downsample": 1}):
            merged = generate("sdxl")
    assert torch.equal(merged, before)


@pytest.mark.parametrize("family", FAMILIES)
def test_saving_is_deterministic(family, tmp_path):
    reference = local_pipelines.pipeline_folder(family)
    again = local_pipelines.save_tiny_pipeline(family, tmp_path / family)
    files = sorted(p.relative_to(reference) for p in reference.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(again) for p in again.rglob("*") if p.is_file())
    assert any(str(f).endswith(".safetensors") for f in files)
    for f in files:
        assert (reference / f).read_bytes() == (again / f).read_bytes(), f


def test_pipeline_folder_is_cached_and_unknown_families_fail():
    assert local_pipelines.pipeline_folder("sd") is local_pipelines.pipeline_folder("sd")
    with pytest.raises(ValueError, match="unknown family"):
        local_pipelines.pipeline_folder("kandinsky")


def test_tiny_clip_gives_text_and_image_embeddings():
    from transformers import CLIPModel, CLIPProcessor

    folder: Path = local_pipelines.clip_folder()
    assert folder == local_pipelines.clip_folder()
    model = CLIPModel.from_pretrained(folder, local_files_only=True).eval()
    processor = CLIPProcessor.from_pretrained(folder, local_files_only=True)
    images = baseline("sd")  # [2, 3, 32, 32] in [0, 1]
    inputs = processor(text=PROMPTS, images=list(images), return_tensors="pt", padding=True, do_rescale=False)
    assert inputs.pixel_values.shape == (2, 3, 32, 32)
    with torch.no_grad():
        out = model(**inputs)
    assert out.text_embeds.shape == (2, 32) and out.image_embeds.shape == (2, 32)
    assert torch.isfinite(out.text_embeds).all() and torch.isfinite(out.image_embeds).all()
    assert out.logits_per_image.shape == (2, 2)
    assert not torch.allclose(out.text_embeds[0], out.text_embeds[1])
