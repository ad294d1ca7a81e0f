"""`tomerge ablate` on an editing pipeline: a tiny saved FluxKontextPipeline with an input image per prompt
(``prompts: {file: edits.jsonl, image_field: image}``), loaded from its folder as a researcher's weights are.

The generated image's 8 x 8 tokens are merged; the input image's tokens (another size) are context, so every
recorded block call counts the 64 target tokens only (``tests/backbones/test_reference_images.py`` checks the layout on
the transformer itself).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from PIL import Image

from helpers import local_pipelines
from helpers.pipeline_ablation import ablation_overrides, block_records, item_index, result_rows, write_edits
from helpers.pipeline_ablation import offline  # noqa: F401 (a fixture)
from tomerge.experiments.runs.ablation import run_ablation
from tomerge.experiments.config.load import load_config
from tomerge.experiments.config.schema import ConfigError
from tomerge.experiments.sources.items import Item

pytest.importorskip("transformers", reason="the text pipelines of diffusers import transformers")

pytestmark = pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning")

EDITS = [("make the car red", "car.png"), ("a cat in the snow", "cat.png")]
INPUT_SIZE = (40, 24)  # (width, height) of the input images: 10 x 6 reference tokens, the target has 8 x 8
TARGET_TOKENS = 64


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("edit_ablation")
    write_edits(root, EDITS, INPUT_SIZE)
    return root


def overrides(root: Path, name: str, *extra: str) -> list[str]:
    """The tiny FluxKontextPipeline on edits.jsonl (an input image per prompt) into the run ``name``."""
    return ablation_overrides(root, "flux_kontext", *extra, name=name)


def test_kontext_ablation_merges_the_generated_image_and_keeps_the_input_image_as_context(root):
    grid = "grid=[{strategy: tomesd, ratios: [0.0, 0.5], options: {use_rand: false}}]"
    config = load_config(None, overrides(root, "kontext", grid))
    assert [(i.prompt, Path(i.image).name) for i in config.items()] == [(p, f) for p, f in EDITS]
    folder = run_ablation(config, progress=False).path
    rows = result_rows(folder)
    assert [r["run"] for r in rows] == ["baseline", "tomesd-r0-use_rand=False", "tomesd-r0.5-use_rand=False"]
    baseline, ratio0, ratio5 = rows

    for run in ("baseline", ratio5["run"]):
        index = item_index(folder, run)
        assert [Path(i["image"]).name for i in index] == [f for _, f in EDITS]  # each item names its input image
        for item in index:
            with Image.open(folder / "images" / run / item["file"]) as image:
                assert image.size == (32, 32) and image.mode == "RGB"  # the target's size, not the input's

    records = block_records(folder, ratio5["run"])
    assert records and all(r["num_tokens"] == TARGET_TOKENS for r in records)  # the input image's 60 tokens: context
    assert all(r["num_removed"] == TARGET_TOKENS // 2 for r in records)
    assert ratio5["tokens_removed_mean"] == pytest.approx(0.5) and ratio0["tokens_removed_mean"] == 0
    assert ratio5["flops"] < ratio5["flops_base"] and ratio5["psnr"] < 100.0
    assert ratio0["psnr"] == baseline["psnr"] == 100.0  # ratio 0: the baseline's pixels
    name = "00000_seed0.png"
    assert (folder / "images" / "baseline" / name).read_bytes() == (folder / "images" / ratio0["run"] / name).read_bytes()


def test_the_input_image_changes_the_output(root):
    """The same prompt and seed with the other input image gives another image: the input images reach the model."""
    source = load_config(None, overrides(root, "kontext-source")).model.load()
    prompt = EDITS[0][0]
    first, second = (source.generate([Item(0, 0, prompt=prompt, image=str(root / f))]) for _, f in EDITS)
    assert first.shape == (1, 3, 32, 32) and (first - second).abs().max() > 1e-3


def test_input_image_problems_are_config_errors(root, tmp_path):
    (tmp_path / "missing.jsonl").write_text(json.dumps({"prompt": "a cat", "image": "nowhere.png"}) + "\n")
    with pytest.raises(ConfigError, match="input images of .* not found"):
        load_config(None, overrides(root, "missing", f"prompts={{file: {tmp_path / 'missing.jsonl'}, image_field: image}}"))
    (tmp_path / "edits.txt").write_text("a cat\n")
    with pytest.raises(ConfigError, match="image_field reads input images from a jsonl file"):
        load_config(None, overrides(root, "txt", f"prompts={{file: {tmp_path / 'edits.txt'}, image_field: image}}"))
    local_pipelines.save_tiny_pipeline("pixart", tmp_path / "tiny-pixart")  # a text-to-image pipeline
    with pytest.raises(ConfigError, match="PixArtAlphaPipeline takes no input image"):
        load_config(None, [f"model.pipeline={tmp_path / 'tiny-pixart'}", *overrides(root, "t2i")[1:]])
    with pytest.raises(ConfigError, match="tomerge sets per item"):
        load_config(None, overrides(root, "call-image", "model.call.image=car.png"))
