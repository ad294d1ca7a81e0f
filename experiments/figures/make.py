"""`tomerge figures`: paper figures and tables from run folders only (never runs a model).

    tomerge figures runs/reference --out figures/reference
    tomerge figures runs/quick runs/big --out figures/all --metrics psnr fd_effnetlite0 --formats png

Reads what ``tomerge ablate`` wrote (``results.jsonl``, ``images/``, ``maps/``, ``config.yaml``) and writes,
each figure in every format of ``--formats`` (default PNG and PDF):

* ``OUT/pareto_<metric>.png`` (and ``.pdf``, ...): speed-up (measured, or ``--x flop_speedup``) vs quality, one
  line per method through its ratios, named once in the legend, the Pareto front highlighted, the model, metric
  and image count in the title (:mod:`~tomerge.experiments.figures.pareto`); ``OUT/pareto.json`` names the runs on
  each front.
* ``OUT/ablation.md`` and ``OUT/ablation.tex`` (booktabs): one row per run, best merged value in bold.
* per run folder, ``OUT/<folder>/``: ``schedules.png`` (fraction of tokens removed per step, requested
  ratio dashed, phases shaded), ``maps/<run>.png`` (tokens sharing a slot share a colour, unmerged
  tokens dark, over the run's first image, per kept step and layer), ``grid.png`` (one image per
  class or prompt, at most ``--k``, or the first ``--k`` with ``--grid-items first``; the same items
  in every row: baseline row then one row per run, or for prompts one row per prompt).
* per video run folder (items are folders of frames), instead of the grid and the image merge maps:
  ``frames/<item>.png`` for the same items (a frame strip: baseline row then one row per run, a few evenly
  spaced frames side by side), ``maps/<run>.png`` (per kept step and layer a row of merge maps, one per latent
  frame, over the matching frame of the run's first video) and ``frame_quality.png`` with
  ``frame_quality.json`` (PSNR, SSIM and DINO distance vs the baseline per frame index, one line per run:
  the rows' ``psnr_per_frame``, ...).

A W&B offline run directory inside a run folder (``runs/<name>/wandb/offline-run-*``) resolves to
that run folder; standalone W&B runs are not supported (their binary logs hold no more than the
run folder does).

A broken run folder is named in one line, with what to do (:class:`~tomerge.experiments.errors.DamagedFileError`):
a truncated or unreadable image, ``prompts.jsonl`` or merge map, a broken row of ``results.jsonl``, rows
lacking the keys figures need (a folder of another tomerge version). An unfinished last row (a killed
``tomerge ablate``) is left out and missing images are left out of the grids, each with a warning.
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
