"""`tomerge figures`: paper figures and tables from run folders only (never runs a model).

    tomerge figures runs/reference --out figures/reference
    tomerge figures runs/quick runs/big --out figures/all --metrics psnr fd_effnetlite0 --formats png

Reads what ``tomerge ablate`` wrote and writes Pareto plots (speed-up vs quality, ``pareto.json``), the
ablation table (Markdown and LaTeX), and per run folder schedules, merge maps and an image grid (video folders:
frame strips, merge maps per frame, quality per frame). A broken run folder is named in one line with what to
do. Every file and how it is drawn: docs/experiments.md, "4. Make the figures" and "8. Video pipelines".
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from ..errors import UsageError
from .canvas import METRICS, is_finite_number
from .image_grids import image_grid_figure
from .merge_maps import merge_map_figure
from .pareto import pareto_figure
from .run_data import RunData, load_run
from .schedules import schedule_figure
from .tables import ablation_table
from .videos import video_figures

__all__ = ["make_figures"]


def make_figures(paths: Sequence[str | Path], out: str | Path, metrics: Sequence[str] | None = None,
                 x_key: str = "speedup", k: int = 8, formats: Sequence[str] = ("png",),
                 runs: Sequence[str] | None = None, grid_items: str = "distinct") -> list[Path]:
    """Every figure and table of the given run folders, each figure in every format of ``formats`` (``tomerge
    figures``: PNG and PDF by default); returns the files written. ``k`` and ``grid_items`` choose the images of
    the grids (``RunData.grid_items``)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    data: list[RunData] = [load_run(p, runs) for p in paths]
    seen: Counter[str] = Counter()
    for d in data:  # folders with the same name: the later ones get -1, -2, ...
        seen[d.name] += 1
        if seen[d.name] > 1:
            d.name = f"{d.name}-{seen[d.name] - 1}"
    written: list[Path] = []
    for latex, suffix in ((False, "md"), (True, "tex")):
        (out / f"ablation.{suffix}").write_text(ablation_table(data, latex=latex))
        written.append(out / f"ablation.{suffix}")
    fronts = {}
    available = [m for m in METRICS if any(is_finite_number(r.get(m)) for d in data for r in d.merged)]
    for metric in metrics or available:
        if metric not in METRICS:
            raise UsageError(f"unknown metric {metric!r}; choose from {sorted(METRICS)}")
        files, fronts[metric] = pareto_figure(data, metric, out / f"pareto_{metric}", x_key, formats)
        written += files
    (out / "pareto.json").write_text(json.dumps({"x": x_key, "fronts": fronts}, indent=2))
    written.append(out / "pareto.json")
    for d in data:
        written += schedule_figure(d, out / d.name / "schedules", formats)
        if d.is_video:
            written += video_figures(d, out / d.name, k, formats, grid_items)
            continue
        for r in d.merged:
            written += merge_map_figure(d, r["run"], out / d.name / "maps" / r["run"], formats)
        written += image_grid_figure(d, out / d.name / "grid", k, formats, grid_items)
    return written
