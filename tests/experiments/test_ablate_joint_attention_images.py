"""`tomerge ablate` on joint-attention image pipelines, each a tiny random-weight pipeline saved by
``local_pipelines`` and loaded from its folder (``DiffusionPipeline.from_pretrained(folder, local_files_only=True)``):
Qwen-Image (true CFG with a negative prompt), Qwen-Image-Edit (an input image per prompt), FLUX.2 (Mistral-3 text
encoder) and Chroma (T5 only).

Every merged block call is recorded in ``maps/<run>.json``; its ``num_tokens`` is what the merge saw, so a count of
64 (the 8 x 8 latent grid) in every record shows that the text tokens of the joint sequences (and Qwen-Image-Edit's
input-image tokens) stayed context.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import local_pipelines
from helpers.pipeline_ablation import (SSM, TOCA, TOMESD, block_records, check_rows, item_index, run_family,
                                       write_edits, write_prompts)
from helpers.pipeline_ablation import offline  # noqa: F401 (a fixture)

pytest.importorskip("transformers", reason="the text pipelines of diffusers import transformers")

# FlowMatch schedulers build numpy arrays the way numpy 2 deprecates; not ours.
pytestmark = pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning")

EDITS = [("make the car red", "car.png"), ("a cat in the snow", "cat.png")]
IMAGE_TOKENS = 64  # every family's 32 x 32 image is an 8 x 8 token grid
INPUT_SIZE = (64, 32)  # (width, height) of the edit inputs: a 16 x 8 grid of 128 reference tokens
EDIT_AREA = INPUT_SIZE[0] * INPUT_SIZE[1]


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("joint_image_ablation")
    write_prompts(root)
    write_edits(root, EDITS, INPUT_SIZE)
    return root


def test_qwenimage_pipeline_ablation_with_true_cfg(root):
    """Qwen-Image (Qwen2.5-VL text encoder, text first in the joint attention) with true CFG: the negative prompt's
    pass is a second model call at the same step, merged like the prompt's."""
    folder, rows = run_family(root, "qwenimage", TOMESD, SSM)
    runs = ["tomesd-r0.5-use_rand=False", "ssm-r0.5"]
    check_rows(folder, rows, runs, size=(32, 32), merging=runs)
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
    folder, rows = run_family(root, "qwenimage_edit", TOMESD)
    run = "tomesd-r0.5-use_rand=False"
    check_rows(folder, rows, [run], size=(32, 32), merging=[run])
    reference_tokens = (INPUT_SIZE[0] // 4) * (INPUT_SIZE[1] // 4)  # VAE factor 2, packed 2 x 2
    assert sequence_lengths and set(sequence_lengths) == {IMAGE_TOKENS + reference_tokens}
    records = block_records(folder, run)
    assert records and all(r["num_tokens"] == IMAGE_TOKENS for r in records)  # the reference's 128: context
    assert all(r["num_removed"] == IMAGE_TOKENS // 2 for r in records)
    assert rows[1]["tokens_removed_mean"] == pytest.approx(0.5)
    index = item_index(folder, run)
    assert [Path(i["image"]).name for i in index] == [f for _, f in EDITS]  # each item names its input image


def test_flux2_pipeline_ablation_with_merging_and_token_wise_caching(root):
    """FLUX.2 (Mistral-3 text encoder through a Pixtral processor; double- and single-stream blocks, text first):
    merging, and token-wise caching, which reuses cached image tokens on the middle step."""
    folder, rows = run_family(root, "flux2", TOMESD, TOCA)
    merged, cached = "tomesd-r0.5-use_rand=False", "toca-r0"
    check_rows(folder, rows, [merged, cached], size=(32, 32), merging=[merged])
    records = block_records(folder, merged)
    assert {r["block_kind"] for r in records} == {"double", "single"}
    assert all(r["num_tokens"] == IMAGE_TOKENS and r["num_removed"] == IMAGE_TOKENS // 2 for r in records)
    # ToCa computes every token on the first and last steps and reuses cached ones on the middle step
    labels = {(r["step"], r["label"]) for r in block_records(folder, cached)}
    assert labels == {(0, "fresh"), (1, "toca"), (2, "fresh")}


def test_chroma_pipeline_ablation(root):
    """Chroma (T5 only, no pooled text embedding; FLUX.1-style double and single blocks, text first)."""
    folder, rows = run_family(root, "chroma", TOMESD, SSM)
    runs = ["tomesd-r0.5-use_rand=False", "ssm-r0.5"]
    check_rows(folder, rows, runs, size=(32, 32), merging=runs)
    for run in runs:
        records = block_records(folder, run)
        assert {r["block_kind"] for r in records} == {"double", "single"}, run
        assert all(r["num_tokens"] == IMAGE_TOKENS and r["num_removed"] > 0 for r in records), run
