"""`tomerge ablate` on joint-attention image pipelines, each a tiny random-weight pipeline saved by
``local_pipelines`` and loaded from its folder (``DiffusionPipeline.from_pretrained(folder, local_files_only=True)``):
Qwen-Image (true CFG with a negative prompt), Qwen-Image-Edit (an input image per prompt), FLUX.2 (Mistral-3 text
encoder) and Chroma (T5 only).

Every merged block call is recorded in ``maps/<run>.json``; its ``num_tokens`` is what the merge saw, so a count of
64 (the 8 x 8 latent grid) in every record shows that the text tokens of the joint sequences (and Qwen-Image-Edit's
input-image tokens) stayed context.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml
from PIL import Image

import local_pipelines
from tomerge.experiments.ablate import run_ablation
from tomerge.experiments.config import load_config

pytest.importorskip("transformers", reason="the text pipelines of diffusers import transformers")

# FlowMatch schedulers build numpy arrays the way numpy 2 deprecates; not ours.
pytestmark = pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning")

PROMPTS = ["a photo of a cat", "a red car in the city"]
EDITS = [("make the car red", "car.png"), ("a cat in the snow", "cat.png")]
IMAGE_TOKENS = 64  # every family's 32 x 32 image is an 8 x 8 token grid
INPUT_SIZE = (64, 32)  # (width, height) of the edit inputs: a 16 x 8 grid of 128 reference tokens
EDIT_AREA = INPUT_SIZE[0] * INPUT_SIZE[1]
TOMESD = "{strategy: tomesd, ratios: [0.5], options: {use_rand: false}}"
SSM = "{strategy: ssm, ratios: [0.5]}"
TOCA = "{strategy: toca, ratios: [0.0]}"


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("joint_image_ablation")
    (root / "prompts.txt").write_text("\n".join(PROMPTS) + "\n")
    rng = np.random.default_rng(0)
    for _, name in EDITS:
        pixels = rng.integers(0, 256, (INPUT_SIZE[1], INPUT_SIZE[0], 3), dtype=np.uint8)
        Image.fromarray(pixels).save(root / name)
    (root / "edits.jsonl").write_text("".join(json.dumps({"prompt": p, "image": f}) + "\n" for p, f in EDITS))
    return root


def overrides(root: Path, family: str, *grid: str) -> list[str]:
    folder = root / f"tiny-{family}"
    if not folder.exists():
        local_pipelines.save_tiny_pipeline(family, folder)
    edit = family in local_pipelines.EDIT_CALL_DEFAULTS
    defaults = (local_pipelines.EDIT_CALL_DEFAULTS if edit else local_pipelines.CURRENT_CALL_DEFAULTS)[family]
    call = yaml.safe_dump(defaults, default_flow_style=True).strip()
    prompts = f"{{file: {root / 'edits.jsonl'}, image_field: image}}" if edit else root / "prompts.txt"
    return [f"model.pipeline={folder}", f"model.call={call}", f"prompts={prompts}", f"out_dir={root / 'runs'}",
            f"name={family}", f"grid=[{', '.join(grid)}]", "batch_size=2", "timing_batch=1", "warmup=0",
            "repeats=1", "wandb=disabled"]


def ablate(root: Path, family: str, *grid: str) -> tuple[Path, list[dict]]:
    folder = run_ablation(load_config(None, overrides(root, family, *grid)), progress=False).path
    return folder, [json.loads(line) for line in (folder / "results.jsonl").read_text().splitlines()]


def block_records(folder: Path, run: str) -> list[dict]:
    return json.loads((folder / "maps" / f"{run}.json").read_text())


def check_rows(folder: Path, rows: list[dict], runs: list[str], merging: list[str]) -> None:
    """The baseline is itself; every run differs from it and costs fewer FLOPs; merging runs remove tokens; every
    image has the requested 32 x 32 size."""
    baseline, *others = rows
    assert [r["run"] for r in rows] == ["baseline", *runs]
    assert baseline["psnr"] == 100.0 and baseline["n_images"] == 2
    for r in others:
        assert r["psnr"] < 100.0 and r["flops"] < r["flops_base"], r["run"]
        if r["run"] in merging:
            assert r["tokens_removed_mean"] > 0, r["run"]
    for run in ("baseline", *runs):
        files = sorted((folder / "images" / run).glob("*.png"))
        assert [f.name for f in files] == ["00000_seed0.png", "00001_seed1.png"]
        for file in files:
            with Image.open(file) as image:
                assert image.size == (32, 32) and image.mode == "RGB"


def test_qwenimage_pipeline_ablation_with_true_cfg(root):
    """Qwen-Image (Qwen2.5-VL text encoder, text first in the joint attention) with true CFG: the negative prompt's
    pass is a second model call at the same step, merged like the prompt's."""
    folder, rows = ablate(root, "qwenimage", TOMESD, SSM)
    runs = ["tomesd-r0.5-use_rand=False", "ssm-r0.5"]
    check_rows(folder, rows, runs, merging=runs)
    steps = local_pipelines.CURRENT_CALL_DEFAULTS["qwenimage"]["num_inference_steps"]
    for run in runs:
        records = block_records(folder, run)
        assert all(r["num_tokens"] == IMAGE_TOKENS and r["num_removed"] > 0 for r in records), run
        calls = sorted((r["step"], r["layer"]) for r in records)
        assert calls == sorted([(step, layer) for step in range(steps) for layer in range(2)] * 2), run


def test_qwenimage_edit_ablation_merges_the_generated_image_and_keeps_the_input_image_as_context(root, monkeypatch):
    """Qwen-Image-Edit with an input image per prompt: the transformer sees the target's 8 x 8 tokens followed by the
    input image's 16 x 8, and the merged blocks count the target's 64 only."""
    from diffusers import QwenImageTransformer2DModel
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit

    # Quirk: QwenImageEditPipeline scales the input image to calculate_dimensions(1024 * 1024, ratio) whatever the
    # call asks; a 64 x 32 area keeps the tiny model's reference image at its own size.
    dimensions = pipeline_qwenimage_edit.calculate_dimensions
    monkeypatch.setattr(pipeline_qwenimage_edit, "calculate_dimensions",
                        lambda target_area, ratio: dimensions(EDIT_AREA, ratio))
    sequence_lengths = []
    forward = QwenImageTransformer2DModel.forward

    def recording_forward(self, hidden_states, *args, **kwargs):
        sequence_lengths.append(hidden_states.shape[1])  # [B, target + reference tokens, C]
        return forward(self, hidden_states, *args, **kwargs)

    monkeypatch.setattr(QwenImageTransformer2DModel, "forward", recording_forward)
    folder, rows = ablate(root, "qwenimage_edit", TOMESD)
    run = "tomesd-r0.5-use_rand=False"
    check_rows(folder, rows, [run], merging=[run])
    reference_tokens = (INPUT_SIZE[0] // 4) * (INPUT_SIZE[1] // 4)  # VAE factor 2, packed 2 x 2
    assert sequence_lengths and set(sequence_lengths) == {IMAGE_TOKENS + reference_tokens}
    records = block_records(folder, run)
    assert records and all(r["num_tokens"] == IMAGE_TOKENS for r in records)  # the reference's 128: context
    assert all(r["num_removed"] == IMAGE_TOKENS // 2 for r in records)
    assert rows[1]["tokens_removed_mean"] == pytest.approx(0.5)
    index = [json.loads(line) for line in (folder / "images" / run / "prompts.jsonl").read_text().splitlines()]
    assert [Path(i["image"]).name for i in index] == [f for _, f in EDITS]  # each item names its input image


def test_flux2_pipeline_ablation_with_merging_and_token_wise_caching(root):
    """FLUX.2 (Mistral-3 text encoder through a Pixtral processor; double- and single-stream blocks, text first):
    merging, and token-wise caching, which reuses cached image tokens on the middle step."""
    folder, rows = ablate(root, "flux2", TOMESD, TOCA)
    merged, cached = "tomesd-r0.5-use_rand=False", "toca-r0"
    check_rows(folder, rows, [merged, cached], merging=[merged])
    records = block_records(folder, merged)
    assert {r["block_kind"] for r in records} == {"double", "single"}
    assert all(r["num_tokens"] == IMAGE_TOKENS and r["num_removed"] == IMAGE_TOKENS // 2 for r in records)
    # ToCa computes every token on the first and last steps and reuses cached ones on the middle step
    labels = {(r["step"], r["label"]) for r in block_records(folder, cached)}
    assert labels == {(0, "fresh"), (1, "toca"), (2, "fresh")}


def test_chroma_pipeline_ablation(root):
    """Chroma (T5 only, no pooled text embedding; FLUX.1-style double and single blocks, text first)."""
    folder, rows = ablate(root, "chroma", TOMESD, SSM)
    runs = ["tomesd-r0.5-use_rand=False", "ssm-r0.5"]
    check_rows(folder, rows, runs, merging=runs)
    for run in runs:
        records = block_records(folder, run)
        assert {r["block_kind"] for r in records} == {"double", "single"}, run
        assert all(r["num_tokens"] == IMAGE_TOKENS and r["num_removed"] > 0 for r in records), run
