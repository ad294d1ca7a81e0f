"""`tomerge figures` on a video run folder (a tiny Wan pipeline run by `tomerge ablate`, W&B offline): frame
strips per item, merge maps per latent frame, quality per frame index, and the videos in the W&B log.

The expected pixels and PSNR values are computed here from the saved frame PNGs with numpy, not by the code
under test.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml
from PIL import Image

from helpers import local_pipelines
from helpers.wandb_offline import offline_records
from tomerge.experiments.runs.ablation import run_ablation
from tomerge.experiments.config.load import load_config
from tomerge.experiments.figures.make import make_figures
from tomerge.experiments.figures.pareto import pareto_plot
from tomerge.experiments.figures.run_data import load_run
from tomerge.experiments.figures.videos import frame_indices, frame_strip_plot

pytest.importorskip("transformers", reason="the text pipelines of diffusers import transformers")
pytestmark = pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning")

PROMPTS = ["a photo of a cat", "a red car in the city"]
CALL = {**local_pipelines.CURRENT_CALL_DEFAULTS["wan"], "num_frames": 5}  # 5 frames of 64 x 64: latent 2 x 4 x 4
FRAMES, SIZE = CALL["num_frames"], CALL["height"]
RUN = "tomesd-r0.5-use_rand=False"


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("video_figures")
    (root / "prompts.txt").write_text("\n".join(PROMPTS) + "\n")
    local_pipelines.save_tiny_pipeline("wan", root / "tiny-wan")
    call = yaml.safe_dump(CALL, default_flow_style=True).strip()
    config = load_config(None, [
        f"model.pipeline={root / 'tiny-wan'}", f"model.call={call}", f"prompts={root / 'prompts.txt'}",
        f"out_dir={root / 'runs'}", "name=wan", "batch_size=2", "timing_batch=1", "warmup=0", "repeats=1",
        "wandb=offline", "grid=[{strategy: tomesd, ratios: [0.5], options: {use_rand: false}}]"])
    return run_ablation(config, progress=False).path


def frames_of(folder: Path, run: str, item: str) -> np.ndarray:
    """``[T, H, W, 3]`` uint8, read with PIL."""
    files = sorted((folder / "images" / run / item).glob("frame_*.png"))
    return np.stack([np.asarray(Image.open(f).convert("RGB")) for f in files])


def test_video_figures_draw_frame_strips_maps_per_frame_and_quality_per_frame(folder, tmp_path):
    written = make_figures([folder], tmp_path)
    out = tmp_path / "wan"
    for name in ("frames/00000_seed0.png", "frames/00001_seed1.png", f"maps/{RUN}.png", "frame_quality.png",
                 "frame_quality.json", "schedules.png"):
        assert out / name in written and (out / name).stat().st_size > 0, name
    assert not (out / "grid.png").exists()  # videos get frame strips instead of the image grid

    # The frame strip's pixels: rows baseline, run; columns the evenly spaced frames 0, 2, 4.
    data = load_run(folder)
    assert data.is_video and data.map_grids(RUN) and set(data.map_grids(RUN).values()) == {(2, 4, 4)}
    shown = frame_indices(FRAMES, 3)
    assert shown == [0, 2, 4]
    fig = frame_strip_plot(data, 1, k=3)
    drawn = np.asarray(fig.axes[0].images[0].get_array())
    rows = [np.concatenate(list(frames_of(folder, run, "00001_seed1")[shown]), axis=1) for run in ("baseline", RUN)]
    expected = np.concatenate(rows, axis=0)  # [2 * 64, 3 * 64, 3]
    assert drawn.shape == (2 * SIZE, len(shown) * SIZE, 3) and np.array_equal(drawn, expected)
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == ["baseline", "tomesd-r0.5-\nuse_rand=False"]

    # Quality per frame index: the plotted PSNR is the PSNR of frame t against the baseline's frame t (mean over
    # the videos), recomputed here in float64 from the PNGs.
    plotted = json.loads((out / "frame_quality.json").read_text())
    assert sorted(plotted) == ["psnr", "ssim"] and list(plotted["psnr"]) == [RUN]
    per_video = []
    for item in ("00000_seed0", "00001_seed1"):
        base = frames_of(folder, "baseline", item).astype(np.float64) / 127.5 - 1
        merged = frames_of(folder, RUN, item).astype(np.float64) / 127.5 - 1
        mse = ((base - merged) ** 2).mean(axis=(1, 2, 3))  # [T]
        per_video.append(np.minimum(10 * np.log10(4.0 / mse), 100.0))
    independent = np.mean(per_video, axis=0)
    assert len(plotted["psnr"][RUN]) == FRAMES and np.all(independent < 100)
    np.testing.assert_allclose(plotted["psnr"][RUN], independent, rtol=1e-6)  # the metrics read frames as float32

    # the Pareto plot's title, from the folder's config.yaml (the pipeline folder) and rows (2 videos)
    fig, _ = pareto_plot([data], "psnr")
    assert fig.get_suptitle() == "tiny-wan, 2 videos: PSNR vs baseline"


def test_wandb_offline_run_holds_the_videos(folder):
    run_dirs, records = offline_records(folder)
    logged = {}
    for r in records:
        if r.get("type") == "history":
            logged.update(r["history"].get("item", {}))
    for run in ("baseline", RUN):
        videos = logged[f"videos/{run}.videos"]  # one GIF per video, its prompt as caption
        assert [v["caption"] for v in videos] == PROMPTS and all(v["_type"] == "video-file" for v in videos)
        for v, item in zip(videos, ("00000_seed0", "00001_seed1")):
            (gif,) = [f for d in run_dirs for f in d.rglob(Path(v["path"]).name)]
            with Image.open(gif) as image:
                assert image.n_frames == FRAMES and image.size == (SIZE, SIZE)
                image.seek(FRAMES - 1)  # the last frame is the video's (GIF palettes: within a few levels)
                last = np.asarray(image.convert("RGB"), dtype=np.int16)
            assert np.abs(last - frames_of(folder, run, item)[-1]).mean() < 8
