"""`tomerge ablate` on the new families' pipelines from local folders: a Wan video pipeline (frames written one
PNG per frame, metrics per frame, resume, ratio 0 identical to the baseline) and a SANA image pipeline.

The tiny pipelines of ``local_pipelines`` are saved to a temporary folder and loaded by ``tomerge ablate`` with
``DiffusionPipeline.from_pretrained(folder, local_files_only=True)`` (docs/experiments.md, "Video pipelines").
"""

from __future__ import annotations

import shutil

import pytest
import torch

from helpers import local_pipelines
from helpers.pipeline_ablation import (SSM, TOCA, TOMESD, ablation_overrides, check_rows, grid, item_index, result_rows,
                               run_family)
from helpers.pipeline_ablation import offline, root  # noqa: F401 (fixtures)
from tomerge.experiments.runs.ablation import run_ablation
from tomerge.experiments.config.load import load_config

# DPMSolver/Euler schedulers build numpy arrays the way numpy 2 deprecates; not ours.
pytestmark = pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning")

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
