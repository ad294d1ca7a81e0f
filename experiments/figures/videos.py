"""The figures of a video run folder (items are folders of frames), drawn instead of the image grid and the
image merge maps (:func:`video_figures`): ``frames/<item>.png`` for the grid's items (a frame strip: baseline row
then one row per run, a few evenly spaced frames side by side), ``maps/<run>.png`` (per kept step and layer a row
of merge maps, one per latent frame: :func:`~tomerge.experiments.figures.merge_maps.video_merge_map_figure`) and
``frame_quality.png`` with ``frame_quality.json`` (PSNR, SSIM and DINO distance vs the baseline per frame index,
one line per run: the rows' ``psnr_per_frame``, ...)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from ..generation.pictures import image_grid
from .canvas import metric_name, new_figure, save_figure, wrap_label
from .merge_maps import video_merge_map_figure
from .run_data import RunData

if TYPE_CHECKING:  # torch is imported where frames are drawn: `tomerge figures --help` stays fast
    from torch import Tensor

__all__ = ["STRIP_FRAMES", "FRAME_METRICS", "frame_indices", "frame_strip", "frame_strip_plot", "frame_strip_figure",
           "frame_quality", "frame_quality_figure", "video_figures"]

STRIP_FRAMES = 5  # frames per video in the frame strips
FRAME_METRICS = ("psnr", "ssim", "dino_dist")  # per-frame keys of video rows: <metric>_per_frame


def frame_indices(num_frames: int, k: int = STRIP_FRAMES) -> list[int]:
    """At most ``k`` evenly spaced frame indices of a video, first and last included.

    Example:
        >>> frame_indices(9, 5), frame_indices(81, 4), frame_indices(3, 5)
        ([0, 2, 4, 6, 8], [0, 27, 53, 80], [0, 1, 2])
    """
    if num_frames <= k:
        return list(range(num_frames))
    if k == 1:
        return [0]
    return [round(i * (num_frames - 1) / (k - 1)) for i in range(k)]


def frame_strip(videos: Sequence[Tensor], frames: Sequence[int]) -> Tensor:
    """One row per video, its ``frames`` side by side: videos ``[T, C, H, W]`` in [-1, 1] (one size) -> a
    ``[len(videos) * H, len(frames) * W, 3]`` uint8 image (row ``r``, column ``j``: frame ``frames[j]`` of video
    ``r``)."""
    import torch

    picked = torch.cat([video[list(frames)] for video in videos])  # [R * F, C, H, W], video-major
    return image_grid(picked, columns=len(frames))


def frame_strip_plot(data: RunData, index: int, k: int = STRIP_FRAMES):
    """The frame strip of item ``index``: the baseline's video, then each run's, ``k`` evenly spaced frames
    (:func:`frame_indices`), runs named on the left, frame numbers below, the prompt above; ``None`` when no
    run has the video. The figure's one image is :func:`frame_strip` of the videos."""
    runs = [(r["run"], data.video(r["run"], index)) for r in data.rows]
    runs = [(name, video) for name, video in runs if video is not None]
    if not runs:
        return None
    frames = frame_indices(min(video.shape[0] for _, video in runs), k)
    strip = frame_strip([video for _, video in runs], frames)  # [R * H, F * W, 3]
    H, W = runs[0][1].shape[-2:]
    label_w = 0.15 + 0.06 * max(len(line) for name, _ in runs for line in wrap_label(name).splitlines())
    cell = 1.1
    fig = new_figure(label_w + cell * len(frames) * W / H + 0.2, cell * len(runs) + 0.9)
    ax = fig.add_subplot()
    ax.imshow(strip.numpy(), interpolation="nearest")
    for r in range(1, len(runs)):  # white separators between runs and between frames
        ax.axhline(r * H - 0.5, color="white", linewidth=1.5)
    for j in range(1, len(frames)):
        ax.axvline(j * W - 0.5, color="white", linewidth=1.5)
    ax.set_yticks([(r + 0.5) * H - 0.5 for r in range(len(runs))], [wrap_label(name) for name, _ in runs], fontsize=7)
    ax.set_xticks([(j + 0.5) * W - 0.5 for j in range(len(frames))], [f"frame {t}" for t in frames], fontsize=7)
    ax.tick_params(length=0)
    for side in ax.spines.values():
        side.set_visible(False)
    prompts = data.prompts(indices=[index])
    what = f"item {index}" + (f": {prompts[0]}" if prompts else "")
    ax.set_title(wrap_label(f"{data.name}, {what}", 90), fontsize=8)
    return fig


def frame_strip_figure(data: RunData, index: int, stem: Path, k: int = STRIP_FRAMES,
                       formats: Sequence[str] = ("png",)) -> list[Path]:
    """:func:`frame_strip_plot` saved as ``stem.<format>``."""
    fig = frame_strip_plot(data, index, k)
    return [] if fig is None else save_figure(fig, stem, formats)


def frame_quality(data: RunData) -> dict[str, dict[str, list[float]]]:
    """Per frame index, the quality of every merged run against the baseline, as the rows hold it:
    ``{metric: {run: [value per frame]}}`` for the metrics of :data:`FRAME_METRICS` some row has (PSNR, SSIM, DINO
    distance; each the mean over the videos of frame ``t``)."""
    out: dict[str, dict[str, list[float]]] = {}
    for metric in FRAME_METRICS:
        series = {r["run"]: [float(v) for v in r[f"{metric}_per_frame"]] for r in data.merged
                  if isinstance(r.get(f"{metric}_per_frame"), list)}
        if series:
            out[metric] = series
    return out


def frame_quality_figure(data: RunData, stem: Path, formats: Sequence[str] = ("png",)) -> list[Path]:
    """Quality per frame index (:func:`frame_quality`): one panel per metric, one line per run; the values also
    go to ``stem.json``."""
    quality = frame_quality(data)
    if not quality:
        return []
    fig = new_figure(6.5, 0.9 + 2.2 * len(quality))
    axes = fig.subplots(len(quality), 1, sharex=True, squeeze=False)[:, 0]
    colours: dict[str, str] = {}
    for ax, (metric, series) in zip(axes, quality.items()):
        for run, values in series.items():
            colour = colours.setdefault(run, f"C{len(colours) % 10}")
            ax.plot(range(len(values)), values, marker=".", color=colour, linewidth=1.2, label=run)
        ax.set_ylabel(metric_name(metric), fontsize=8)
        ax.grid(True, alpha=0.3)
    axes[-1].set_xlabel("frame")
    axes[-1].xaxis.get_major_locator().set_params(integer=True)
    handles, names = axes[0].get_legend_handles_labels()
    fig.legend(handles, names, loc="outside lower center", ncols=min(3, len(names)), fontsize=7, frameon=False)
    fig.suptitle(f"Quality per frame vs the baseline: {data.name}", fontsize=10)
    values = stem.with_name(f"{stem.name}.json")
    values.parent.mkdir(parents=True, exist_ok=True)
    values.write_text(json.dumps(quality, indent=2))
    return [*save_figure(fig, stem, formats), values]


def video_figures(data: RunData, out: Path, k: int = 8, formats: Sequence[str] = ("png",),
                  select: str = "distinct") -> list[Path]:
    """The figures of a video run folder (the module docstring): frame strips of the grid's items, per-frame merge
    maps of every merged run, quality per frame index."""
    written: list[Path] = []
    items = {item["index"]: item for item in data.index("baseline")}
    for index in data.grid_items(k, select):
        name = items[index]["file"] if index in items else f"{index:05d}"
        written += frame_strip_figure(data, index, out / "frames" / name, formats=formats)
    for r in data.merged:
        written += video_merge_map_figure(data, r["run"], out / "maps" / r["run"], formats)
    written += frame_quality_figure(data, out / "frame_quality", formats)
    return written
