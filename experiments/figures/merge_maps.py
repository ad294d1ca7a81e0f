"""Merge map figures (``OUT/<folder>/maps/<run>.png``): tokens sharing a slot share a colour and unmerged tokens
are dark, drawn over the run's first image per kept step and layer (:func:`merge_map_figure`), or for a video run
per latent frame over the matching frame of its first video (:func:`video_merge_map_figure`). The maps are the
run folder's ``maps/<run>.safetensors``."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from ..generation.pictures import image_rgb, merge_map_rgb
from .canvas import new_figure, save_figure
from .run_data import RunData

if TYPE_CHECKING:  # torch is imported where maps are drawn: `tomerge figures --help` stays fast
    from torch import Tensor

__all__ = ["token_grid", "merge_map_figure", "video_merge_map_figure"]


def token_grid(num_tokens: int, image_hw: tuple[int, int]) -> tuple[int, int]:
    """The token grid ``(gh, gw)`` with ``gh * gw = N`` and the image's aspect ratio (square when unsure)."""
    h, w = image_hw
    gh = max(1, round(math.sqrt(num_tokens * h / w)))
    if gh * (num_tokens // gh) == num_tokens:
        return gh, num_tokens // gh
    side = math.isqrt(num_tokens)
    if side * side != num_tokens:
        raise ValueError(f"cannot infer the token grid of {num_tokens} tokens for an image of {image_hw}")
    return side, side


def _overlay(slots: Tensor, image: Tensor | None, alpha: float) -> Tensor:
    """Slot colours (``[N]`` -> ``[gh, gw, 3]``), blended over ``image [C, H, W]`` when given -> float [h, w, 3]."""
    hw = tuple(image.shape[-2:]) if image is not None else (1, 1)
    return _blend(merge_map_rgb(slots, token_grid(slots.numel(), hw), scale=1), image, alpha)


def _blend(colours: Tensor, image: Tensor | None, alpha: float) -> Tensor:
    """Token colours ``[gh, gw, 3]`` uint8, upsampled over ``image [C, H, W]`` when given -> float [h, w, 3]."""
    colours = colours.float() / 255
    if image is None:
        return colours
    import torch

    up = torch.nn.functional.interpolate(colours.permute(2, 0, 1)[None], size=tuple(image.shape[-2:]),
                                         mode="nearest")[0]  # [3, H, W]
    return ((1 - alpha) * image_rgb(image) + alpha * up.permute(1, 2, 0)).clamp(0, 1)  # unmerged (black): dimmed image


def merge_map_figure(data: RunData, run: str, stem: Path, formats: Sequence[str] = ("png",),
                     columns: int = 8, alpha: float = 0.6) -> list[Path]:
    """Merge maps of a run over its first image: per kept step a row of layers (wrapped after
    ``columns``), the image itself in the first column."""
    import re

    maps = data.maps(run)
    if not maps:
        return []
    images = data.images(run, 1)
    images = images if images is not None else data.images("baseline", 1)
    image = images[0] if images is not None else None
    parsed = {k: re.fullmatch(r"step(\d+)_layer(\d+)", k) for k in maps}
    by_step: dict[str, list[str]] = defaultdict(list)
    for key in sorted(maps, key=lambda k: (int(parsed[k][1]), int(parsed[k][2])) if parsed[k] else (1 << 30, 0)):
        by_step[f"step {int(parsed[key][1])}" if parsed[key] else "other"].append(key)
    cols = min(columns, max(len(v) for v in by_step.values()))
    rows = [(step, keys[i:i + cols]) for step, keys in by_step.items() for i in range(0, len(keys), cols)]
    extra = int(image is not None)
    aspect = image.shape[-2] / image.shape[-1] if image is not None else 1.0
    fig = new_figure(1.3 * (cols + extra) + 0.2, (1.3 * aspect + 0.4) * len(rows) + 0.4)
    axes = fig.subplots(len(rows), cols + extra, squeeze=False)
    for ax in axes.flat:
        ax.set_axis_off()
    previous = None
    for r, (step, keys) in enumerate(rows):
        if image is not None and step != previous:
            axes[r, 0].imshow(image_rgb(image).numpy(), interpolation="nearest")
            axes[r, 0].set_title("first image\n(final output)", fontsize=7)
        previous = step
        for c, key in enumerate(keys):
            slots = maps[key].long()
            ax = axes[r, c + extra]
            ax.imshow(_overlay(slots, image, alpha).numpy(), interpolation="nearest")
            removed = slots.numel() - int(slots.unique().numel())
            name = f"{step}, layer {int(parsed[key][2])}" if parsed[key] else key
            ax.set_title(f"{name}\n-{removed}/{slots.numel()} tokens", fontsize=7)
    fig.suptitle(f"{run}: tokens sharing a slot share a colour; unmerged tokens dark", fontsize=8)
    return save_figure(fig, stem, formats)


def video_merge_map_figure(data: RunData, run: str, stem: Path, formats: Sequence[str] = ("png",),
                           alpha: float = 0.6) -> list[Path]:
    """Merge maps of a video run over its first video: per kept step and layer a row, one panel per latent frame
    (tokens sharing a slot share a colour across frames too, unmerged tokens dark), each over the video frame at
    the same relative time (latent frame ``t`` of ``T``: frame ``round(t (F - 1) / (T - 1))`` of ``F``). Needs the
    maps' token grids (the maps file's metadata); maps without a ``(T, H, W)`` grid are left out."""
    import re
    import warnings

    maps, grids = data.maps(run), data.map_grids(run)
    keys = [key for key in maps if len(grids.get(key, ())) == 3]
    if len(keys) < len(maps):
        warnings.warn(f"{data.path / 'maps' / run}: {len(maps) - len(keys)} merge maps have no (T, H, W) token grid "
                      "in the file's metadata; they are left out", stacklevel=2)
    if not keys:
        return []
    items = data.index(run) or data.index("baseline")
    video = data.video(run, items[0]["index"]) if items else None
    parsed = {k: re.fullmatch(r"step(\d+)_layer(\d+)", k) for k in keys}
    keys.sort(key=lambda k: (int(parsed[k][1]), int(parsed[k][2])) if parsed[k] else (1 << 30, 0))
    T = max(grids[key][0] for key in keys)
    aspect = video.shape[-2] / video.shape[-1] if video is not None else 1.0
    fig = new_figure(1.3 * T + 0.4, (1.3 * aspect + 0.45) * len(keys) + 0.4)
    axes = fig.subplots(len(keys), T, squeeze=False)
    for ax in axes.flat:
        ax.set_axis_off()
    for r, key in enumerate(keys):
        frames, H, W = grids[key]
        slots = maps[key].long()
        colours = merge_map_rgb(slots, (frames, H, W), scale=1)  # [H, T * W, 3]: frames side by side
        removed = slots.numel() - int(slots.unique().numel())
        name = f"step {int(parsed[key][1])}, layer {int(parsed[key][2])}" if parsed[key] else key
        for t in range(frames):
            shown = round(t * (video.shape[0] - 1) / max(frames - 1, 1)) if video is not None else None
            ax = axes[r, t]
            ax.imshow(_blend(colours[:, t * W:(t + 1) * W], None if video is None else video[shown], alpha).numpy(),
                      interpolation="nearest")
            title = f"latent frame {t}" + ("" if shown is None else f" (frame {shown})")
            ax.set_title(f"{name}: -{removed}/{slots.numel()}\n{title}" if t == 0 else title, fontsize=7)
    fig.suptitle(f"{run}: tokens sharing a slot share a colour (across frames too); unmerged tokens dark", fontsize=8)
    return save_figure(fig, stem, formats)
