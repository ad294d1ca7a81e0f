"""The image grid of a run folder (``OUT/<folder>/grid.png``): the same items for the baseline and every run, at
the same seeds, chosen by :meth:`RunData.grid_items <tomerge.experiments.figures.run_data.RunData.grid_items>`.
Class-conditional runs: one row per run, the class over each column; text-to-image runs: one row per prompt, one
column per run."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from ..generation.pictures import image_grid, image_rgb
from .canvas import new_figure, save_figure, wrap_label
from .run_data import RunData

if TYPE_CHECKING:  # torch is imported where images are drawn: `tomerge figures --help` stays fast
    from torch import Tensor

__all__ = ["image_grid_figure"]


def image_grid_figure(data: RunData, stem: Path, k: int = 8, formats: Sequence[str] = ("png",),
                      select: str = "distinct") -> list[Path]:
    """The same items of the baseline and of every run, same seeds: by default one image per class (the
    first item of each distinct label) or per prompt, at most ``k``; ``select="first"``: the first ``k``
    items (see ``RunData.grid_items``). Class-conditional runs: one labelled row per run, the class over
    each column. Text-to-image runs: one row per prompt (the prompt under it), one column per run
    (baseline first)."""
    indices = data.grid_items(k, select)
    runs = [(r["run"], data.images(r["run"], indices=indices)) for r in data.rows]
    runs = [(name, im) for name, im in runs if im is not None]
    if not runs:
        return []
    what = "one image per class" if select == "distinct" else f"first {len(indices)} images"
    prompts = data.prompts(indices=indices)
    if prompts is not None:
        what = "one image per prompt" if select == "distinct" else f"first {len(indices)} images"
        return _prompt_grid_figure(data, runs, prompts, stem, formats, what)
    labels = [item.get("label") for item in data.items("baseline", indices)]
    rows = [(wrap_label(name), im) for name, im in runs]
    n = max(im.shape[0] for _, im in rows)
    h, w = rows[0][1].shape[-2:]
    label_w = 0.15 + 0.06 * max(len(line) for name, _ in rows for line in name.splitlines())
    image_w = 0.9 * n * w / h
    titled = len(labels) == n and any(label is not None for label in labels)
    width = label_w + image_w
    fig = new_figure(width, 0.35 + 0.95 * len(rows) + 0.15 * titled + 0.15 * (width < 5))
    grid = fig.add_gridspec(len(rows), 2, width_ratios=[label_w, image_w])
    for i, (name, im) in enumerate(rows):
        label = fig.add_subplot(grid[i, 0])
        label.set_axis_off()
        label.text(1.0, 0.5, name, ha="right", va="center", fontsize=8, transform=label.transAxes)
        ax = fig.add_subplot(grid[i, 1])
        ax.imshow(image_grid(im, columns=n).numpy(), interpolation="nearest")
        for j in range(1, n):  # white separators between images
            ax.axvline(j * w - 0.5, color="white", linewidth=1.5)
        if i == 0 and titled:  # the class over each column
            for j, c in enumerate(labels):
                ax.text((j + 0.5) * w - 0.5, -1, f"class {c}", ha="center", va="bottom", fontsize=7)
        ax.set_axis_off()
    fig.suptitle(wrap_label(f"{data.name}: {what}, same items and seeds in every row", max(24, int(width / 0.075))),
                 fontsize=9)
    return save_figure(fig, stem, formats)


def _prompt_grid_figure(data: RunData, runs: list[tuple[str, Tensor]], prompts: list[str], stem: Path,
                        formats: Sequence[str], what: str) -> list[Path]:
    """Rows: prompts (wrapped under the row); columns: baseline, then the runs."""
    n = min(len(prompts), min(im.shape[0] for _, im in runs))
    cols = len(runs)
    h, w = runs[0][1].shape[-2:]
    cell = 1.6
    fig = new_figure(cell * cols * w / h + 0.2, (cell + 0.45) * n + 0.6)
    axes = fig.subplots(n, cols, squeeze=False)
    for j, (name, im) in enumerate(runs):
        axes[0, j].set_title(wrap_label(name, 22), fontsize=7)
        for i in range(n):
            axes[i, j].imshow(image_rgb(im[i]).numpy(), interpolation="nearest")
            axes[i, j].set_xticks([])
            axes[i, j].set_yticks([])
    for i in range(n):
        text = prompts[i] if len(prompts[i]) <= 160 else prompts[i][:157] + "..."
        axes[i, 0].annotate(wrap_label(text, int(28 * cols)), xy=(0, 0), xycoords="axes fraction", xytext=(0, -4),
                            textcoords="offset points", ha="left", va="top", fontsize=7)
    fig.suptitle(f"{data.name}: {what}, same prompt and seed in every row", fontsize=9)
    return save_figure(fig, stem, formats)
