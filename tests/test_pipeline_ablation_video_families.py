"""`tomerge ablate` on more video families' pipelines from saved folders (``local_pipelines``, "video pipelines"):
HunyuanVideo, Mochi, Latte and Kandinsky 5.0 T2V, each written as one PNG per frame and scored per frame.

Each family's tiny random-weight pipeline is saved with ``save_pretrained`` and loaded by ``tomerge ablate`` with
``DiffusionPipeline.from_pretrained(folder, local_files_only=True)`` (docs/experiments.md, "Video pipelines").
"""

from __future__ import annotations

import json

import pytest
from PIL import Image

from helpers import local_pipelines
from helpers.pipeline_ablation import PROMPTS, SSM, TOCA, TOMESD, block_records, check_rows, run_family
from helpers.pipeline_ablation import offline, root  # noqa: F401 (fixtures)

pytest.importorskip("transformers", reason="the text pipelines of diffusers import transformers")

# Flow-matching schedulers build numpy arrays the way numpy 2 deprecates, and Mochi's RoPE opens a float32 CPU
# autocast that torch disables with a warning; not ours.
pytestmark = [pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning"),
              pytest.mark.filterwarnings("ignore:In CPU autocast, but the target dtype is not supported:UserWarning")]


def test_hunyuan_video_pipeline_ablation_merges_video_tokens_with_text_as_context(root):
    """HunyuanVideo (Llama prompt in the pipeline's chat template + CLIP pooled; 1 double-stream and 1
    single-stream block, text LAST in the joint sequence): merging, and token-wise caching of the joint attention.
    The merged blocks see the 3 x 8 x 8 video tokens only: the 16 text tokens (after the template's 95 are cropped)
    are context."""
    from diffusers.pipelines.hunyuan_video.pipeline_hunyuan_video import DEFAULT_PROMPT_TEMPLATE
    from transformers import AutoTokenizer

    call = local_pipelines.CURRENT_CALL_DEFAULTS["hunyuan_video"]
    frames, video_tokens = call["num_frames"], 3 * 8 * 8  # latent frames (9 - 1) / 4 + 1 = 3 of 8 x 8, patch 1
    out, rows = run_family(root, "hunyuan_video", TOMESD, TOCA)
    merged = "tomesd-r0.5-use_rand=False"
    check_rows(out, rows, [merged, "toca-r0"], size=(call["width"], call["height"]), frames=frames, merging=[merged])
    records = block_records(out, merged)
    assert records and {r["num_tokens"] for r in records} == {video_tokens}
    assert all(r["num_removed"] == video_tokens // 2 for r in records)

    # The pipeline's own template and crop_start (95) fit the saved tokenizer: the prompt starts right after it.
    tokenizer = AutoTokenizer.from_pretrained(root / "tiny-hunyuan_video" / "tokenizer", local_files_only=True)
    prefix = DEFAULT_PROMPT_TEMPLATE["template"].split("{}")[0]
    templated = tokenizer(DEFAULT_PROMPT_TEMPLATE["template"].format(PROMPTS[0])).input_ids
    crop = DEFAULT_PROMPT_TEMPLATE["crop_start"]
    assert len(tokenizer(prefix).input_ids) == crop
    assert tokenizer.decode(templated[crop:]) == PROMPTS[0] + "<|eot_id|>"


def test_mochi_pipeline_ablation_merges_the_video_stream(root):
    """Mochi (T5; joint attention with separate video and text projections, the text mask keeping each prompt's
    valid tokens; a VAE with temporal compression 6): merging in attention and feed-forward. Every merged block
    call sees the 3 x 4 x 4 video tokens (the text stream is context), and the records run over both steps in
    order although Mochi's model timestep rises from noise to data."""
    call = local_pipelines.CURRENT_CALL_DEFAULTS["mochi"]
    frames, video_tokens = call["num_frames"], 3 * 4 * 4  # latent frames (13 - 1) / 6 + 1 = 3 of 8 x 8, patch 2
    out, rows = run_family(root, "mochi", TOMESD, SSM)
    runs = ["tomesd-r0.5-use_rand=False", "ssm-r0.5"]
    check_rows(out, rows, runs, size=(call["width"], call["height"]), frames=frames, merging=runs)
    for run in runs:
        records = block_records(out, run)
        assert records and {rec["num_tokens"] for rec in records} == {video_tokens}
        steps = [rec["step"] for rec in records]
        assert steps == sorted(steps) and set(steps) == {0, 1}  # steps advance: the adapter reads 1000 - t


def test_latte_pipeline_ablation_writes_frames_and_merges_each_frame(root):
    """Latte (T5; spatial blocks per frame, temporal blocks across frames; an image VAE per frame) takes its frame
    count as ``video_length``, not ``num_frames``: it is a video pipeline all the same, so its frames are written
    and scored per frame. Every merged block call is a spatial block on one frame's 8 x 8 tokens."""
    call = local_pipelines.CURRENT_CALL_DEFAULTS["latte"]
    frames, frame_tokens = call["video_length"], 8 * 8  # latent 16 x 16 per frame, patch 2
    out, rows = run_family(root, "latte", TOMESD)
    merged = "tomesd-r0.5-use_rand=False"
    check_rows(out, rows, [merged], size=(call["width"], call["height"]), frames=frames, merging=[merged])
    records = block_records(out, merged)
    assert records and {(r["block_kind"], r["num_tokens"]) for r in records} == {("spatial", frame_tokens)}
    with Image.open(out / "images" / "baseline.png") as strip:  # one row of frames per video
        assert strip.size == (frames * call["width"], 2 * call["height"])


def test_kandinsky5_pipeline_ablation_merges_the_video_blocks(root):
    """Kandinsky 5.0 T2V (Qwen2.5-VL prompt in the pipeline's chat template + CLIP pooled; a text block refining the
    prompt alone, then video blocks with self- and cross-attention; a channels-last latent): merging. Every merged
    block call is a video block on the 3 x 4 x 4 video tokens; the text blocks are not merged."""
    from transformers import AutoProcessor

    call = local_pipelines.CURRENT_CALL_DEFAULTS["kandinsky5"]
    frames, video_tokens = call["num_frames"], 3 * 4 * 4  # latent frames (9 - 1) / 4 + 1 = 3 of 8 x 8, patch 2
    out, rows = run_family(root, "kandinsky5", TOMESD)
    merged = "tomesd-r0.5-use_rand=False"
    check_rows(out, rows, [merged], size=(call["width"], call["height"]), frames=frames, merging=[merged])
    records = block_records(out, merged)
    assert records and {(r["block_kind"], r["num_tokens"]) for r in records} == {("kandinsky5", video_tokens)}

    # The pipeline's fixed crop (prompt_template_encode_start_idx = 128) fits the saved processor's tokenizer.
    tokenizer = AutoProcessor.from_pretrained(root / "tiny-kandinsky5" / "tokenizer", local_files_only=True).tokenizer
    template = local_pipelines.kandinsky5_template()
    templated = tokenizer(template.format(PROMPTS[0])).input_ids
    assert len(tokenizer(template.split("{}")[0]).input_ids) == 128
    assert tokenizer.decode(templated[128:]) == PROMPTS[0] + "<|im_end|>"


def test_a_pipeline_taking_video_length_is_a_video_pipeline(tmp_path):
    """``ModelSpec.is_video`` knows a video pipeline by its frame-count argument, ``num_frames`` or Latte's
    ``video_length`` (``sources.call_arguments.VIDEO_CALL_ARGS``), read from the folder's model_index.json
    without weights."""
    from diffusers import LattePipeline, MochiPipeline, PixArtAlphaPipeline

    from tomerge.experiments.sources.call_arguments import video_length_arg
    from tomerge.experiments.sources.models import ModelSpec

    classes = (MochiPipeline, LattePipeline, PixArtAlphaPipeline)
    assert [video_length_arg(c) for c in classes] == ["num_frames", "video_length", None]
    for pipeline_class, video in zip(classes, (True, True, False)):
        folder = tmp_path / pipeline_class.__name__
        folder.mkdir()
        (folder / "model_index.json").write_text(json.dumps({"_class_name": pipeline_class.__name__}))
        assert ModelSpec.from_config({"pipeline": str(folder)}).is_video is video, pipeline_class.__name__
