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

import argparse
import dataclasses
import fnmatch
import json
import math
import sys
from collections import Counter, defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from ..measure.columns import figure_columns, format_markdown_table, plotted_metrics
from ..errors import UsageError
from ..generation.files import DamagedFileError, frame_files, load_image_files, read_jsonl
from ..runs.records import RESULTS, image_grid, last_rows, merge_map_rgb, other_counter_message, other_counter_runs, \
    read_rows

if TYPE_CHECKING:  # torch is imported where images are drawn: `tomerge figures --help` stays fast
    from torch import Tensor

__all__ = ["RunData", "load_run", "metric_name", "ablation_table", "schedule_figure", "merge_map_figure",
           "image_grid_figure", "frame_indices", "frame_strip", "frame_strip_plot", "frame_strip_figure",
           "video_merge_map_figure", "frame_quality_figure", "make_figures", "add_arguments", "run"]

# metric -> (axis label, higher is better, paired with the baseline images); from columns.COLUMNS
METRICS = plotted_metrics()
X_AXES = {"speedup": "measured speed-up (x)", "flop_speedup": "FLOP-ideal speed-up (x)"}
# key, title, format, higher is better (None: no bold); a column appears when some row has its key
COLUMNS = figure_columns()
PHASE_COLOURS = {"structure": "tab:blue", "detail": "tab:orange", "protected": "tab:gray", "merge": "tab:green",
                 "skip_step": "tab:gray", "skip_block": "tab:brown", "skip": "tab:gray"}
GRID_SELECT = {"distinct": "one image per class or prompt", "first": "the first items"}
STRIP_FRAMES = 5  # frames per video in the frame strips
FRAME_METRICS = ("psnr", "ssim", "dino_dist")  # per-frame keys of video rows: <metric>_per_frame


@dataclasses.dataclass
class RunData:
    """One run folder: its config, its result rows (the last row per run id, file order), its files."""

    path: Path
    name: str
    config: dict[str, Any]
    rows: list[dict[str, Any]]

    @property
    def baseline(self) -> dict[str, Any] | None:
        return next((r for r in self.rows if r["run"] == "baseline"), None)

    @property
    def merged(self) -> list[dict[str, Any]]:
        return [r for r in self.rows if r["run"] != "baseline"]

    def index(self, run: str) -> list[dict[str, Any]]:
        """The run's items (``images/<run>/prompts.jsonl``): index, seed, file, prompt or label."""
        file = self.path / "images" / run / "prompts.jsonl"
        if not file.exists():
            return []
        return read_jsonl(file, f"delete it and {regenerate(self.path)}", required=("index", "file"),
                          appended=False)[0]

    def items(self, run: str, indices: Sequence[int] | None = None) -> list[dict[str, Any]]:
        """The run's items with these ``index`` values, in that order (all items: ``None``); an index the
        run does not have is left out."""
        items = self.index(run)
        if indices is None:
            return items
        by_index = {item["index"]: item for item in items}
        return [by_index[i] for i in indices if i in by_index]

    def images(self, run: str, k: int | None = None, indices: Sequence[int] | None = None) -> Tensor | None:
        """Images ``[n, C, H, W]`` float in [-1, 1], or ``None``: the items with these ``index`` values in
        that order (``indices``; items the run lacks are left out), else the first ``k`` (all: ``None``)."""
        items = self.items(run, indices) if indices is not None else self.index(run)[:k]
        files = [self.path / "images" / run / item["file"] for item in items]
        files = [f for f in files if f.exists()]
        return self._load(files) if files else None

    def _load(self, files: Sequence[Path]) -> Tensor:
        """``load_image_files(files)``; a damaged file is named in a :class:`DamagedFileError`."""
        try:
            return load_image_files(files)
        except (OSError, SyntaxError, ValueError) as err:  # PIL: truncated, not an image
            for file in files:
                try:
                    load_image_files([file])
                except (OSError, SyntaxError, ValueError) as one:
                    raise DamagedFileError(f"{file} is damaged ({one}); delete it and {regenerate(self.path)}") \
                        from one
            raise err

    @property
    def is_video(self) -> bool:
        """Whether the folder's items are videos (folders of frames, as video pipelines write them)."""
        for r in self.rows:
            for item in self.index(r["run"]):
                path = self.path / "images" / r["run"] / item["file"]
                if path.exists():
                    return path.is_dir()
        return False

    def video(self, run: str, index: int) -> Tensor | None:
        """The frames ``[T, C, H, W]`` (float, [-1, 1]) of the run's item with this ``index``, or ``None``."""
        items = self.items(run, [index])
        folder = self.path / "images" / run / items[0]["file"] if items else None
        if folder is None or not folder.is_dir():
            return None
        try:
            frames = frame_files(folder)
        except ValueError as err:
            raise DamagedFileError(f"{folder}: {err}; delete it and {regenerate(self.path)}") from err
        return self._load(frames)

    def prompts(self, k: int | None = None, indices: Sequence[int] | None = None) -> list[str] | None:
        """Prompts of the baseline's items with these ``index`` values (``indices``), else of its first ``k``
        items, or ``None`` for class-conditional runs."""
        items = self.items("baseline", indices) if indices is not None else self.index("baseline")[:k]
        return [item["prompt"] for item in items] if items and "prompt" in items[0] else None

    def grid_items(self, k: int | None = 8, select: str = "distinct") -> list[int]:
        """Item indices shown by the image grids, the same for every run: of the items every run with
        images has on disk (in the baseline's order, or the first such run's), ``"distinct"`` takes the
        first item of each distinct class label or prompt (one image per class, or per prompt when a
        prompt has several images), ``"first"`` the first items; at most ``k`` (all: ``None``).

        Example: items of classes ``[0, 0, 1, 1, 2, 2]`` (indices 0-5) -> ``[0, 2, 4]`` (``"first"``,
        ``k=3``: ``[0, 1, 2]``).
        """
        if select not in GRID_SELECT:
            raise UsageError(f"unknown grid selection {select!r}; choose from {sorted(GRID_SELECT)}")
        order: list[dict[str, Any]] = []
        present: list[set[int]] = []
        for r in self.rows:
            items = [it for it in self.index(r["run"]) if (self.path / "images" / r["run"] / it["file"]).exists()]
            if items:
                order = order or items
                present.append({it["index"] for it in items})
        common = [it for it in order if all(it["index"] in p for p in present)]
        if select == "distinct":
            seen: set[Any] = set()
            kept = []
            for it in common:
                key = ("prompt", it["prompt"]) if "prompt" in it else ("label", it.get("label"))
                if key not in seen:
                    seen.add(key)
                    kept.append(it)
            common = kept
        return [it["index"] for it in common[:k]]

    def maps(self, run: str) -> dict[str, Tensor]:
        file = self.path / "maps" / f"{run}.safetensors"
        if not file.exists():
            return {}
        from safetensors.torch import load_file

        try:
            return load_file(file)
        except Exception as err:  # noqa: BLE001 - safetensors raises its own SafetensorError
            raise DamagedFileError(f"{file} is damaged ({type(err).__name__}: {err}); delete it (the figures then "
                                   "leave out that run's merge maps)") from err

    def map_grids(self, run: str) -> dict[str, tuple[int, ...]]:
        """The token grid of each merge map of the run (``(H, W)`` or ``(T, H, W)``), from the maps file's
        metadata; ``{}`` for maps written without it."""
        file = self.path / "maps" / f"{run}.safetensors"
        if not file.exists():
            return {}
        from safetensors import safe_open

        try:
            with safe_open(str(file), framework="pt") as f:
                metadata = f.metadata() or {}
            grids = json.loads(metadata.get("grids", "{}"))
        except Exception as err:  # noqa: BLE001 - safetensors raises its own SafetensorError
            raise DamagedFileError(f"{file} is damaged ({type(err).__name__}: {err}); delete it (the figures then "
                                   "leave out that run's merge maps)") from err
        return {k: tuple(int(v) for v in g) for k, g in grids.items()}

    def records(self, run: str) -> list[dict[str, Any]]:
        file = self.path / "maps" / f"{run}.json"
        if not file.exists():
            return []
        try:
            records = json.loads(file.read_text())
        except ValueError as err:
            raise DamagedFileError(f"{file} is damaged ({err}); delete it (the figures then leave out that run's "
                                   "schedule)") from err
        if not isinstance(records, list) or not all(isinstance(r, dict) for r in records):
            raise DamagedFileError(f"{file} is not a list of block-call records; delete it (the figures then "
                                   "leave out that run's schedule)")
        return records

    def missing_images(self) -> list[Path]:
        """Image files (video folders) that the rows' ``prompts.jsonl`` list but that are not there, and the
        image folders of rows that have none."""
        missing = []
        for r in self.rows:
            folder = self.path / "images" / r["run"]
            if not (folder / "prompts.jsonl").exists():
                missing.append(folder)
            missing += [folder / item["file"] for item in self.index(r["run"]) if not (folder / item["file"]).exists()]
        return missing


def regenerate(path: Path) -> str:
    """What recreates the images of a run folder (the end of an error message)."""
    return (f"rerun the `tomerge ablate` command that made {path} (the same config and --set values; "
            "config.yaml there holds them), which generates missing images again")


def _resolve(path: Path) -> Path:
    if (path / RESULTS).is_file():
        return path
    is_wandb = path.name.startswith(("offline-run-", "run-")) or any(path.glob("*.wandb"))
    for parent in list(path.parents)[:3] if is_wandb else []:
        if (parent / RESULTS).is_file():
            return parent
    hint = ("; a W&B run directory is read only inside a run folder, standalone W&B runs are not supported"
            if is_wandb else "")
    raise FileNotFoundError(f"{path} is not a run folder (no results.jsonl; write one with `tomerge ablate`){hint}")


def load_run(path: str | Path, runs: Sequence[str] | None = None) -> RunData:
    """Reads a run folder (or a W&B run dir inside one); ``runs`` keeps matching run ids (globs) and the baseline.

    Example:
        >>> data = load_run("runs/reference")                     # doctest: +SKIP
        >>> [r["run"] for r in data.rows][:2]                      # doctest: +SKIP
        ['baseline', 'tomesd-r0.5-use_rand=False']
    """
    import warnings

    path = _resolve(Path(path))
    rows = [r for r in last_rows(read_rows(path))
            if r["run"] == "baseline" or not runs or any(fnmatch.fnmatch(r["run"], p) for p in runs)]
    rows.sort(key=lambda r: r["run"] != "baseline")  # stable: baseline first, then file order
    _check_keys(path, rows)
    _check_counter(path, rows)
    config_file = path / "config.yaml"
    config: Any = {}
    if config_file.exists():
        try:
            config = yaml.safe_load(config_file.read_text())
        except yaml.YAMLError as err:
            warnings.warn(f"{config_file} is damaged ({type(err).__name__}); figures do without it", stacklevel=2)
    data = RunData(path, path.name, config if isinstance(config, dict) else {}, rows)
    missing = data.missing_images()
    if missing:
        warnings.warn(f"{path}: {len(missing)} images or image folders are missing (first: {missing[0]}); the grids "
                      f"leave them out; to draw them, {regenerate(path)}", stacklevel=2)
    return data


OTHER_VERSION = ("a run folder written by another tomerge version is read by that version (its rows name it: "
                 "versions, git_commit)")
# keys every row (and every merged row) needs to be drawn
ROW_KEYS = ("run",)
MERGED_ROW_KEYS = ("strategy",)


def _check_keys(path: Path, rows: list[dict[str, Any]]) -> None:
    """Refuses rows that lack the keys figures need (a folder written by another tomerge version)."""
    lacking = {r["run"]: [k for k in (*ROW_KEYS, *(MERGED_ROW_KEYS if r["run"] != "baseline" else ())) if k not in r]
               for r in rows}
    lacking = {run: keys for run, keys in lacking.items() if keys}
    if lacking:
        run, keys = next(iter(lacking.items()))
        raise DamagedFileError(f"{path / 'results.jsonl'}: {len(lacking)} rows lack keys figures need (first: {run} "
                               f"has no {', '.join(map(repr, keys))}): {OTHER_VERSION}")


def _check_counter(path: Path, rows: list[dict[str, Any]]) -> None:
    """Refuses rows whose FLOPs another FLOP counter made: their FLOP-ideal speed-ups follow other rules."""
    stale = other_counter_runs(rows)
    if stale:
        raise UsageError(f"{other_counter_message(path, stale)}; rerun tomerge ablate with the folder's config to "
                         "measure them again (their images are reused)")


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def metric_name(metric: str) -> str:
    """A metric's name in titles and small labels: its axis label without the parenthesis.

    Example:
        >>> metric_name("fd_effnetlite0")
        'FD-EffNetLite0 vs baseline images'
    """
    return METRICS[metric][0].split(" (")[0]


# ------------------------------------------------------------------------------------------ tables
def _cell(value: Any, fmt: str, latex: bool) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "--" if latex else "-"
    if isinstance(value, float) and math.isinf(value):
        return "$\\infty$" if latex else "inf"
    return fmt.format(value)


_LATEX_SPECIAL = {"\\": "\\textbackslash{}", "_": "\\_", "%": "\\%", "&": "\\&", "#": "\\#", "{": "\\{",
                  "}": "\\}", "$": "\\$", "^": "\\^{}", "~": "\\~{}"}


def _escape(text: str) -> str:
    return "".join(_LATEX_SPECIAL.get(c, c) for c in text)


def _caption(keys: set[str]) -> str:
    parts = ["Speed-up over the unmerged baseline: measured wall-clock and FLOP-ideal; removed: mean fraction of "
             "tokens removed per block call", "PSNR and SSIM against the baseline images at the same seeds"]
    if "fd_effnetlite0" in keys:
        parts.append("FD-EffNetLite0: Fr\\'echet distance of EfficientNet-Lite0 features to the baseline images")
    if "fd_effnetlite0_ref" in keys:
        parts.append("FD-EffNetLite0 vs ref: the same distance to real images")
    return ". ".join(parts) + ". Best merged value in bold."


def ablation_table(runs: Sequence[RunData], latex: bool = False) -> str:
    """The ablation table (Markdown, or LaTeX with booktabs); the best merged value per column in bold."""
    several = len(runs) > 1
    rows = [(d.name, r) for d in runs for r in d.rows]
    columns = [c for c in COLUMNS if c[0] == "ratio" or any(r.get(c[0]) is not None for _, r in rows)]
    best: dict[str, float] = {}
    for key, _, fmt, higher in columns:
        values = [r[key] for _, r in rows if r["run"] != "baseline" and _finite(r.get(key))]
        if higher is not None and len(set(values)) > 1:  # no bold when every run ties
            best[key] = max(values) if higher else min(values)
    head = (["folder"] if several else []) + ["run"] + [t for _, t, _, _ in columns]
    body = []
    for folder, r in rows:
        cells = [folder] if several else []
        cells.append(r["run"])
        for key, _, fmt, _ in columns:
            text = _cell(r.get(key), fmt, latex)
            if key in best and r["run"] != "baseline" and r.get(key) == best[key]:
                text = f"\\textbf{{{text}}}" if latex else f"**{text}**"
            cells.append(text)
        body.append((r["run"] == "baseline", cells))
    if not latex:
        numeric = [False] * (len(head) - len(columns)) + [True] * len(columns)
        return format_markdown_table(head, [cells for _, cells in body], numeric) + "\n"
    spec = "l" * (len(head) - len(columns)) + "r" * len(columns)
    lines = ["% requires \\usepackage{booktabs}", "\\begin{table}[t]", "\\centering", "\\small",
             f"\\begin{{tabular}}{{{spec}}}", "\\toprule", " & ".join(_escape(h) for h in head) + " \\\\", "\\midrule"]
    for i, (is_base, cells) in enumerate(body):
        cells = [_escape(c) if j < len(head) - len(columns) else c for j, c in enumerate(cells)]
        lines.append(" & ".join(cells) + " \\\\")
        if is_base and i + 1 < len(body) and not body[i + 1][0]:
            lines.append("\\midrule")
    names = ", ".join(_escape(d.name) for d in runs)
    lines += ["\\bottomrule", "\\end{tabular}",
              f"\\caption{{Token merging ablation ({names}). {_caption({c[0] for c in columns})}}}",
              "\\label{tab:ablation}", "\\end{table}"]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------ figures
def _figure(width: float, height: float):
    from matplotlib.figure import Figure  # no pyplot: no global figure registry, no backend switch

    return Figure(figsize=(width, height), dpi=150, layout="constrained")


def _save(fig, stem: Path, formats: Sequence[str]) -> list[Path]:
    stem.parent.mkdir(parents=True, exist_ok=True)
    paths = [stem.with_name(f"{stem.name}.{fmt}") for fmt in formats]
    for p in paths:
        fig.savefig(p)
    return paths


def step_profile(records: Sequence[dict[str, Any]]) -> tuple[list[int], list[float], list[float], list[str]]:
    """Per step (over all trajectories and layers): fraction of tokens removed (unmerged calls count 0),
    mean requested ratio, and the most common decision label.

    Example:
        >>> rec = [dict(step=0, ratio=0.5, num_tokens=4, num_removed=2, label="a"),
        ...        dict(step=0, ratio=0.0, num_tokens=0, num_removed=0, label="skip"),
        ...        dict(step=1, ratio=0.5, num_tokens=4, num_removed=1, label="a")]
        >>> step_profile(rec)
        ([0, 1], [0.25, 0.25], [0.25, 0.5], ['a', 'a'])
    """
    by_step: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        by_step[int(r["step"])].append(r)
    steps = sorted(by_step)
    removed = [sum(r["num_removed"] / r["num_tokens"] if r["num_tokens"] else 0.0 for r in by_step[s])
               / len(by_step[s]) for s in steps]
    ratios = [sum(float(r["ratio"]) for r in by_step[s]) / len(by_step[s]) for s in steps]
    labels = [Counter(r["label"] for r in by_step[s]).most_common(1)[0][0] for s in steps]
    return steps, removed, ratios, labels


def schedule_figure(data: RunData, stem: Path, formats: Sequence[str] = ("png",)) -> list[Path]:
    """One panel per merged run: removed fraction and requested ratio over steps, phases shaded."""
    from matplotlib.patches import Patch

    runs = [(r["run"], step_profile(data.records(r["run"]))) for r in data.merged]
    runs = [(name, prof) for name, prof in runs if prof[0]]
    if not runs:
        return []
    fig = _figure(7.5, 0.9 + 1.3 * len(runs))
    axes = fig.subplots(len(runs), 1, sharex=True, squeeze=False)[:, 0]
    phases: dict[str, str] = {}
    for ax, (name, (steps, removed, ratios, labels)) in zip(axes, runs):
        if len(set(labels)) > 1:
            start = 0
            for i in range(1, len(steps) + 1):
                if i == len(steps) or labels[i] != labels[start]:
                    colour = phases.setdefault(labels[start], PHASE_COLOURS.get(labels[start], f"C{len(phases) + 3}"))
                    ax.axvspan(steps[start] - 0.5, steps[i - 1] + 0.5, color=colour, alpha=0.15, linewidth=0)
                    start = i
        ax.plot(steps, removed, marker=".", color="black", linewidth=1.2, label="tokens removed (measured)")
        ax.plot(steps, ratios, "--", color="tab:red", linewidth=1, label="requested ratio (mean over layers)")
        ax.set_ylim(-0.02, max(1.0, max(ratios) * 1.05))
        ax.set_ylabel("fraction", fontsize=8)
        ax.set_title(name, fontsize=9, loc="left")
        ax.grid(True, alpha=0.3)
    axes[-1].set_xlabel("denoising step")
    axes[-1].xaxis.get_major_locator().set_params(integer=True)
    handles, names = axes[0].get_legend_handles_labels()
    handles += [Patch(color=c, alpha=0.3) for c in phases.values()]
    names += [f"phase: {p}" for p in phases]
    fig.legend(handles, names, loc="outside lower center", ncols=min(4, len(names)), fontsize=8, frameon=False)
    fig.suptitle(f"Merge schedules: {data.name}", fontsize=10)
    return _save(fig, stem, formats)


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


def _rgb(image: Tensor) -> Tensor:
    """``[C, H, W]`` in [-1, 1] -> ``[H, W, 3]`` in [0, 1] (grey images repeated)."""
    img = ((image.float().clamp(-1, 1) + 1) / 2).permute(1, 2, 0)  # [H, W, C]
    return img.expand(-1, -1, 3) if img.shape[-1] == 1 else img[..., :3]


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
    return ((1 - alpha) * _rgb(image) + alpha * up.permute(1, 2, 0)).clamp(0, 1)  # unmerged (black): dimmed image


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
    fig = _figure(1.3 * (cols + extra) + 0.2, (1.3 * aspect + 0.4) * len(rows) + 0.4)
    axes = fig.subplots(len(rows), cols + extra, squeeze=False)
    for ax in axes.flat:
        ax.set_axis_off()
    previous = None
    for r, (step, keys) in enumerate(rows):
        if image is not None and step != previous:
            axes[r, 0].imshow(_rgb(image).numpy(), interpolation="nearest")
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
    return _save(fig, stem, formats)


def _wrap(text: str, width: int = 24) -> str:
    import textwrap

    return "\n".join(textwrap.wrap(text, width, break_on_hyphens=True)) or text


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
    rows = [(_wrap(name), im) for name, im in runs]
    n = max(im.shape[0] for _, im in rows)
    h, w = rows[0][1].shape[-2:]
    label_w = 0.15 + 0.06 * max(len(line) for name, _ in rows for line in name.splitlines())
    image_w = 0.9 * n * w / h
    titled = len(labels) == n and any(label is not None for label in labels)
    width = label_w + image_w
    fig = _figure(width, 0.35 + 0.95 * len(rows) + 0.15 * titled + 0.15 * (width < 5))
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
    fig.suptitle(_wrap(f"{data.name}: {what}, same items and seeds in every row", max(24, int(width / 0.075))),
                 fontsize=9)
    return _save(fig, stem, formats)


def _prompt_grid_figure(data: RunData, runs: list[tuple[str, Tensor]], prompts: list[str], stem: Path,
                        formats: Sequence[str], what: str) -> list[Path]:
    """Rows: prompts (wrapped under the row); columns: baseline, then the runs."""
    n = min(len(prompts), min(im.shape[0] for _, im in runs))
    cols = len(runs)
    h, w = runs[0][1].shape[-2:]
    cell = 1.6
    fig = _figure(cell * cols * w / h + 0.2, (cell + 0.45) * n + 0.6)
    axes = fig.subplots(n, cols, squeeze=False)
    for j, (name, im) in enumerate(runs):
        axes[0, j].set_title(_wrap(name, 22), fontsize=7)
        for i in range(n):
            axes[i, j].imshow(_rgb(im[i]).numpy(), interpolation="nearest")
            axes[i, j].set_xticks([])
            axes[i, j].set_yticks([])
    for i in range(n):
        text = prompts[i] if len(prompts[i]) <= 160 else prompts[i][:157] + "..."
        axes[i, 0].annotate(_wrap(text, int(28 * cols)), xy=(0, 0), xycoords="axes fraction", xytext=(0, -4),
                            textcoords="offset points", ha="left", va="top", fontsize=7)
    fig.suptitle(f"{data.name}: {what}, same prompt and seed in every row", fontsize=9)
    return _save(fig, stem, formats)


# ------------------------------------------------------------------------------------------ videos
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
    label_w = 0.15 + 0.06 * max(len(line) for name, _ in runs for line in _wrap(name).splitlines())
    cell = 1.1
    fig = _figure(label_w + cell * len(frames) * W / H + 0.2, cell * len(runs) + 0.9)
    ax = fig.add_subplot()
    ax.imshow(strip.numpy(), interpolation="nearest")
    for r in range(1, len(runs)):  # white separators between runs and between frames
        ax.axhline(r * H - 0.5, color="white", linewidth=1.5)
    for j in range(1, len(frames)):
        ax.axvline(j * W - 0.5, color="white", linewidth=1.5)
    ax.set_yticks([(r + 0.5) * H - 0.5 for r in range(len(runs))], [_wrap(name) for name, _ in runs], fontsize=7)
    ax.set_xticks([(j + 0.5) * W - 0.5 for j in range(len(frames))], [f"frame {t}" for t in frames], fontsize=7)
    ax.tick_params(length=0)
    for side in ax.spines.values():
        side.set_visible(False)
    prompts = data.prompts(indices=[index])
    what = f"item {index}" + (f": {prompts[0]}" if prompts else "")
    ax.set_title(_wrap(f"{data.name}, {what}", 90), fontsize=8)
    return fig


def frame_strip_figure(data: RunData, index: int, stem: Path, k: int = STRIP_FRAMES,
                       formats: Sequence[str] = ("png",)) -> list[Path]:
    """:func:`frame_strip_plot` saved as ``stem.<format>``."""
    fig = frame_strip_plot(data, index, k)
    return [] if fig is None else _save(fig, stem, formats)


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
    fig = _figure(1.3 * T + 0.4, (1.3 * aspect + 0.45) * len(keys) + 0.4)
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
    return _save(fig, stem, formats)


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
    fig = _figure(6.5, 0.9 + 2.2 * len(quality))
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
    return [*_save(fig, stem, formats), values]


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


def make_figures(paths: Sequence[str | Path], out: str | Path, metrics: Sequence[str] | None = None,
                 x_key: str = "speedup", k: int = 8, formats: Sequence[str] = ("png",),
                 runs: Sequence[str] | None = None, grid_items: str = "distinct") -> list[Path]:
    """Every figure and table of the given run folders, each figure in every format of ``formats`` (``tomerge
    figures``: PNG and PDF by default); returns the files written. ``k`` and ``grid_items`` choose the images of
    the grids (``RunData.grid_items``)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    data = [load_run(p, runs) for p in paths]
    seen: Counter[str] = Counter()
    for d in data:  # folders with the same name: the later ones get -1, -2, ...
        seen[d.name] += 1
        if seen[d.name] > 1:
            d.name = f"{d.name}-{seen[d.name] - 1}"
    written: list[Path] = []
    for latex, suffix in ((False, "md"), (True, "tex")):
        (out / f"ablation.{suffix}").write_text(ablation_table(data, latex=latex))
        written.append(out / f"ablation.{suffix}")
    from .pareto import pareto_figure  # pareto.py draws with this module's RunData and helpers

    fronts = {}
    available = [m for m in METRICS if any(_finite(r.get(m)) for d in data for r in d.merged)]
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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dirs", nargs="+", type=Path, metavar="RUN_DIR",
                        help="run folders written by `tomerge ablate` (or a W&B run dir inside one)")
    parser.add_argument("--out", type=Path, required=True, help="output folder")
    parser.add_argument("--metrics", nargs="+", choices=sorted(METRICS), default=None,
                        help="quality axes of the Pareto plots (default: every metric present)")
    parser.add_argument("--x", dest="x_key", choices=sorted(X_AXES), default="speedup",
                        help="speed axis (default: %(default)s, measured wall-clock)")
    parser.add_argument("--k", type=int, default=8,
                        help="at most K images (or prompts) in the image grids (default: %(default)s)")
    parser.add_argument("--grid-items", choices=sorted(GRID_SELECT), default="distinct",
                        help="images of the grids, the same items for every run: distinct (default) the first "
                             "image of each class or prompt, first the first K items")
    parser.add_argument("--formats", nargs="+", default=["png", "pdf"], choices=["png", "pdf", "svg"],
                        help="figure file formats (default: png pdf)")
    parser.add_argument("--runs", nargs="+", default=None, metavar="GLOB",
                        help="only runs whose id matches one of these globs (the baseline is always kept)")


def run(args: argparse.Namespace) -> int:
    written = make_figures(args.run_dirs, args.out, args.metrics, args.x_key, args.k, args.formats, args.runs,
                           args.grid_items)
    print(Path(args.out / "ablation.md").read_text())
    print("\n".join(str(p) for p in written))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tomerge.experiments.figures.plots", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
