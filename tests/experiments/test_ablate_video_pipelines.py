"""`tomerge ablate` on video pipelines from saved folders: Wan (frames written one PNG per frame, metrics per frame,
resume, ratio 0 identical to the baseline), LTX-Video, CogVideoX, HunyuanVideo, Mochi, Latte and Kandinsky 5.0 T2V,
each written as one PNG per frame and scored per frame, and a SANA image pipeline loaded the same way.

The tiny pipelines of ``local_pipelines`` are saved to a temporary folder and loaded by ``tomerge ablate`` with
``DiffusionPipeline.from_pretrained(folder, local_files_only=True)`` (docs/experiments.md, "Video pipelines").
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from PIL import Image

from tomerge.experiments.config.load import load_config
from tomerge.experiments.runs.ablation import run_ablation
from helpers import local_pipelines
from helpers.pipeline_ablation import (PROMPTS, SSM, TOCA, TOMESD, ablation_overrides, block_records, check_rows, grid,
                                       item_index, result_rows, run_family)
from helpers.pipeline_ablation import offline, root  # noqa: F401 (fixtures)

pytest.importorskip("transformers", reason="the text pipelines of diffusers import transformers")

# Flow-matching, DPMSolver and Euler schedulers build numpy arrays the way numpy 2 deprecates, and Mochi's RoPE opens a
# float32 CPU autocast that torch disables with a warning; not ours.
pytestmark = [pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning"),
              pytest.mark.filterwarnings("ignore:In CPU autocast, but the target dtype is not supported:UserWarning")]

WAN_FRAMES = local_pipelines.CURRENT_CALL_DEFAULTS["wan"]["num_frames"]  # 9 frames of 64 x 64
GRID = grid("{strategy: tomesd, ratios: [0.0, 0.5], options: {use_rand: false}}")


def test_wan_ablation_writes_frames_scores_them_per_frame_and_resumes(root):
    config = ablation_overrides(root, "wan", GRID)
    folder = run_ablation(load_config(None, config), progress=False).path
    written = result_rows(folder)
    assert [r["run"] for r in written] == ["baseline", "tomesd-r0-use_rand=False", "tomesd-r0.5-use_rand=False"]

    # Every item is a folder of one 64 x 64 PNG per frame; the index names the folders.
    from PIL import Image

    for run in ("baseline", "tomesd-r0.5-use_rand=False"):
        videos = folder / "images" / run
        index = item_index(folder, run)
        assert [i["file"] for i in index] == ["00000_seed0", "00001_seed1"]
        for item in index:
            frames = sorted((videos / item["file"]).iterdir())
            assert [f.name for f in frames] == [f"frame_{t:03d}.png" for t in range(WAN_FRAMES)]
            with Image.open(frames[0]) as image:
                assert image.size == (64, 64) and image.mode == "RGB"
        assert not list(videos.glob(".*tmp*"))  # no half-written videos
        with Image.open(folder / "images" / f"{run}.png") as grid:  # one row of frames per video
            assert grid.size == (WAN_FRAMES * 64, 2 * 64)

    # Metrics per frame: 2 videos x 9 frames; the means are the means of the per-frame values.
    for r in written:
        assert r["n_images"] == 2 and r["n_frames"] == 2 * WAN_FRAMES and r["frames_per_video"] == WAN_FRAMES
        assert len(r["psnr_per_frame"]) == len(r["ssim_per_frame"]) == WAN_FRAMES
        assert r["psnr"] == pytest.approx(sum(r["psnr_per_frame"]) / WAN_FRAMES)
        assert r["ssim"] == pytest.approx(sum(r["ssim_per_frame"]) / WAN_FRAMES)
        assert r["fd_effnetlite0"] >= 0  # FD over the 18 frames as images
    baseline, ratio0, ratio5 = written
    # Ratio 0 merges nothing: the same frames as the baseline, so PSNR is "inf" (capped at 100 dB) and SSIM 1.
    for r in (baseline, ratio0):
        assert r["psnr"] == 100.0 and r["psnr_per_frame"] == [100.0] * WAN_FRAMES
        assert r["ssim"] == pytest.approx(1.0) and r["ssim_per_frame"] == pytest.approx([1.0] * WAN_FRAMES)
        assert r["feat_cos_dist"] == pytest.approx(0.0, abs=1e-6)
    for t in range(WAN_FRAMES):  # the frames themselves are bit-identical
        name = f"00000_seed0/frame_{t:03d}.png"
        assert (folder / "images" / "baseline" / name).read_bytes() == \
            (folder / "images" / ratio0["run"] / name).read_bytes()
    assert ratio5["psnr"] < 100.0 and ratio5["ssim"] < 1.0 and ratio5["flops"] < ratio5["flops_base"]
    assert ratio5["tokens_removed_mean"] > 0 and ratio0["tokens_removed_mean"] == 0
    assert (folder / "maps" / f"{ratio5['run']}.safetensors").exists()
    assert "tomesd-r0.5-use_rand=False" in (folder / "table.md").read_text()

    # An interrupted grid keeps what finished: drop the last row and one of its videos (and leave a half-written
    # frame folder, as a kill during a write would); the rerun redoes that run only, regenerating that video.
    lines = (folder / "results.jsonl").read_text().splitlines()
    (folder / "results.jsonl").write_text("\n".join(lines[:-1]) + "\n")
    last = folder / "images" / ratio5["run"]
    before = (last / "00001_seed1" / "frame_004.png").read_bytes()
    shutil.rmtree(last / "00001_seed1")
    (last / ".00001_seed1.tmp1").mkdir()
    kept = (last / "00000_seed0" / "frame_000.png").stat().st_mtime_ns
    run_ablation(load_config(None, config), progress=False)
    again = result_rows(folder)
    assert [r["run"] for r in again] == [r["run"] for r in written]
    assert again[:2] == written[:2]
    assert (last / "00001_seed1" / "frame_004.png").read_bytes() == before  # same seed, same frames
    assert (last / "00000_seed0" / "frame_000.png").stat().st_mtime_ns == kept  # finished video not rewritten
    for key in ("psnr", "ssim", "psnr_per_frame", "fd_effnetlite0"):
        assert again[2][key] == pytest.approx(written[2][key]), key


def test_sana_image_pipeline_ablation(root):
    with local_pipelines.diffusers_log() as records:
        folder, rows = run_family(root, "sana", TOMESD)
    # diffusers loads through accelerate: no "Cannot initialize model with low cpu memory usage" warning
    assert not [r.getMessage() for r in records if "accelerate" in r.getMessage()]
    check_rows(folder, rows, ["tomesd-r0.5-use_rand=False"], size=(32, 32))


def test_ltx_video_pipeline_ablation_with_merging_and_token_wise_caching(root):
    """LTX-Video (3-D RoPE, cross-attention, its own causal VAE) from a saved folder through the ablation: a
    merging strategy and token-wise caching (its reused attention returns the image tokens alone)."""
    call = local_pipelines.CURRENT_CALL_DEFAULTS["ltx"]
    folder, rows = run_family(root, "ltx", TOMESD, TOCA)
    check_rows(folder, rows, ["tomesd-r0.5-use_rand=False", "toca-r0"], size=(call["width"], call["height"]),
               frames=call["num_frames"])


def test_cogvideox_pipeline_ablation(root):
    """CogVideoX (joint text-video attention, text first; 3-D RoPE; its own VAE) from a saved folder: merging, and
    token-wise caching reusing the joint attention's whole output."""
    call = local_pipelines.CURRENT_CALL_DEFAULTS["cogvideox"]
    folder, rows = run_family(root, "cogvideox", TOMESD, SSM, TOCA)
    runs = ["tomesd-r0.5-use_rand=False", "ssm-r0.5", "toca-r0"]
    check_rows(folder, rows, runs, size=(call["width"], call["height"]), frames=call["num_frames"], merging=runs)


def test_video_metrics_pair_frames_with_the_same_frame_of_the_baseline(tmp_path):
    """Hand-made videos: only frame 1 of video 0 differs, so only that frame index loses PSNR and SSIM."""
    from tomerge.experiments.generation.generate import save_video
    from tomerge.experiments.generation.files import expand_videos
    from tomerge.experiments.measure.image_sets import ImageSetQuality

    g = torch.Generator().manual_seed(0)
    base = torch.rand(2, 3, 3, 16, 16, generator=g) * 2 - 1  # [videos, T, C, H, W]
    changed = base.clone()
    changed[0, 1] = (changed[0, 1] + 0.2).clamp(-1, 1)
    for name, videos in (("base", base), ("run", changed)):
        for v in range(2):
            (tmp_path / name).mkdir(exist_ok=True)
            save_video(videos[v], tmp_path / name / f"{v:05d}_seed{v}")
    base_files = sorted((tmp_path / "base").iterdir())
    run_files = sorted((tmp_path / "run").iterdir())
    frames, per_video = expand_videos(base_files)
    assert per_video == 3 and len(frames) == 6 and frames[1].name == "frame_001.png"
    quality = ImageSetQuality(base_files)
    assert quality.baseline_features.shape == (6, 1280)  # one feature row per frame
    same, other = quality.score(base_files), quality.score(run_files)
    assert same["psnr_per_frame"] == [100.0] * 3 and same["n_frames"] == 6
    assert other["psnr_per_frame"][0] == other["psnr_per_frame"][2] == 100.0
    assert other["psnr_per_frame"][1] < 100.0 and other["ssim_per_frame"][1] < 1.0
    with pytest.raises(ValueError, match="mixes"):
        expand_videos([base_files[0], frames[0]])


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
