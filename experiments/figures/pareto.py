"""The speed-vs-quality figure of ``tomerge figures`` (``OUT/pareto_<metric>.png`` and ``.pdf``), drawn to go into
a paper as it is.

One line per method (a strategy with the values of the options that tell its runs apart, :func:`varying_options`)
through its runs in the order of their ratios, the Pareto front of all merged runs highlighted, the baseline as a
reference and each run's 95% intervals as bars. What each colour, marker, line and label means, and that no two
texts overlap (tests/experiments/test_figures.py checks it): docs/experiments.md, "Make the figures".
"""

from __future__ import annotations

import dataclasses
import textwrap
import warnings
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ..measure.intervals import row_interval
from ..sources.models import ModelSpec
from .canvas import METRICS, X_AXES, is_finite_number, metric_name, new_figure, save_figure
from .run_data import RunData

__all__ = ["pareto_front", "varying_options", "method_name", "ratio_note", "Method", "methods",
           "model_name", "pareto_title", "pareto_plot", "pareto_figure"]

MARKERS = "osD^vP*Xh<>p"
LINESTYLES = ("-", "--", ":", "-.", (0, (5, 1, 1, 1, 1, 1)), (0, (8, 2)))  # per option values of a strategy
LEGEND_WIDTH = 38  # characters of a legend entry before it wraps
TITLE_WIDTH = 90   # characters of a title line
FRONT_BAND = {"color": "black", "alpha": 0.15, "linewidth": 7, "solid_capstyle": "round", "solid_joinstyle": "round"}
BASELINE_STAR = {"marker": "*", "color": "gold", "markeredgecolor": "black", "markeredgewidth": 0.6}


def pareto_front(points: Sequence[tuple[float, float]], higher_y: bool = True) -> list[int]:
    """Indices of the non-dominated points (x is maximised, y maximised or minimised), sorted by x.

    A point is dominated when another is at least as good on both axes and better on one.

    Example:
        >>> pareto_front([(1.0, 30.0), (2.0, 25.0), (1.5, 24.0), (2.0, 25.0)])
        [0, 1, 3]
    """
    sign = 1.0 if higher_y else -1.0
    pts = [(x, sign * y) for x, y in points]
    front = [i for i, (x, y) in enumerate(pts)
             if not any(bx >= x and by >= y and (bx > x or by > y) for bx, by in pts)]
    return sorted(front, key=lambda i: (points[i][0], i))


# ------------------------------------------------------------------------------------------ methods
def varying_options(rows: Sequence[dict[str, Any]]) -> dict[str, set[str]]:
    """Per strategy of ``rows``, the option names whose values differ between its rows (what tells its runs
    apart besides the ratio).

    Example:
        >>> varying_options([{"strategy": "ssm", "options": {"window": 2, "alpha_s": 0.1}},
        ...                  {"strategy": "ssm", "options": {"window": 3, "alpha_s": 0.1}}])
        {'ssm': {'window'}}
    """
    by_strategy: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        by_strategy[r["strategy"]].append(r.get("options") or {})
    return {s: {k for opts in group for k in opts if len({str(o.get(k)) for o in group}) > 1}
            for s, group in by_strategy.items()}


def method_name(row: dict[str, Any], varying: set[str]) -> str:
    """The strategy of ``row`` and its values of the ``varying`` options (:func:`varying_options`), sorted.

    Example:
        >>> method_name({"strategy": "sdtm", "options": {"order": "detail_first", "switch": 1.0}}, {"order"})
        'sdtm order=detail_first'
    """
    options = row.get("options") or {}
    return " ".join([row["strategy"], *(f"{k}={options[k]}" for k in sorted(varying) if k in options)])


def ratio_note(rows: Sequence[dict[str, Any]]) -> str:
    """What a legend entry says of a method's runs: the range of the ratios, and the targets of the FLOP-matched
    runs (whose ratio ``tomerge ablate`` solved for, a number of no interest of its own).

    Example:
        >>> ratio_note([{"ratio": 0.2}, {"ratio": 0.65}, {"ratio": 0.35}])
        'r 0.2-0.65'
        >>> ratio_note([{"ratio": 0.5}, {"ratio": 0.5696, "flop_target": 1.5}, {"ratio": 0.44, "flop_target": 1.3}])
        'r 0.5; FLOP-matched 1.3x, 1.5x'
    """
    ratios = sorted(r["ratio"] for r in rows if r.get("flop_target") is None)
    targets = sorted({r["flop_target"] for r in rows if r.get("flop_target") is not None})
    parts = []
    if ratios:
        parts.append(f"r {ratios[0]:.3g}" + (f"-{ratios[-1]:.3g}" if ratios[-1] != ratios[0] else ""))
    if targets:
        parts.append("FLOP-matched " + ", ".join(f"{t:g}x" for t in targets))
    return "; ".join(parts)


@dataclasses.dataclass
class Method:
    """A line of the speed-vs-quality figure: the runs of one strategy with one set of option values in one
    run folder, sorted by ratio, and how they are drawn."""

    folder: str
    name: str                   # method_name of its rows
    rows: list[dict[str, Any]]  # sorted by ratio (then run id)
    colour: str                 # per strategy
    marker: str                 # per run folder when several are drawn, else per option values within the strategy
    linestyle: Any              # per option values within the strategy (a matplotlib line style)


def methods(runs: Sequence[RunData], keep: Callable[[dict[str, Any]], bool] | None = None) -> list[Method]:
    """The methods of the merged runs of ``runs``, in order of run folder, strategy, option values (each in order
    of first appearance), with the rows ``keep(row)`` is true of (``None``: all); methods left without rows are
    left out. Colours, markers, line styles and the names come from all merged rows, so every figure of
    these folders agrees."""
    merged = [r for d in runs for r in d.merged]
    varying = varying_options(merged)
    strategies = list(dict.fromkeys(r["strategy"] for r in merged))
    variants = {s: list(dict.fromkeys(method_name(r, varying[s]) for r in merged if r["strategy"] == s))
                for s in strategies}
    several = len(runs) > 1
    found = []
    for j, d in enumerate(runs):
        grouped: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for r in d.merged:
            if keep is None or keep(r):
                grouped[method_name(r, varying[r["strategy"]])].append(r)
        for i, s in enumerate(strategies):
            for k, name in enumerate(variants[s]):
                if name in grouped:
                    found.append(Method(d.name, name, sorted(grouped[name], key=lambda r: (r["ratio"], r["run"])),
                                        f"C{i % 10}", MARKERS[(j if several else k) % len(MARKERS)],
                                        LINESTYLES[k % len(LINESTYLES)]))
    return found


# ------------------------------------------------------------------------------------------ title
def model_name(data: RunData) -> str | None:
    """The model a run folder was made with, as the figures name it (``ModelSpec.display_name`` of its
    ``config.yaml``'s ``model``); ``None``, with a warning, when the config holds no model entry this version reads."""
    try:
        return ModelSpec(**data.config["model"]).display_name
    except (KeyError, TypeError, ValueError):
        warnings.warn(f"{data.path / 'config.yaml'} has no model entry this tomerge version reads; the figure titles "
                      "leave the model out", stacklevel=2)
        return None


def pareto_title(runs: Sequence[RunData], metric: str, rows: Sequence[dict[str, Any]]) -> str:
    """The title: the models of ``runs``, the number of images of ``rows`` (their ``n_images``; videos when the
    rows count frames too) and the metric, e.g. ``bundled reference DiT (256 tokens), 40 images:
    FD-EffNetLite0 vs baseline images``."""
    models = " / ".join(dict.fromkeys(m for m in (model_name(d) for d in runs) if m))
    counts = sorted({int(r["n_images"]) for r in rows if is_finite_number(r.get("n_images"))})
    unit = "videos" if any("n_frames" in r for r in rows) else "images"
    count = f"{counts[0]}{f'-{counts[-1]}' if counts[-1] != counts[0] else ''} {unit}" if counts else ""
    subject = ", ".join(t for t in (models, count) if t)
    return f"{subject}: {metric_name(metric)}" if subject else metric_name(metric)


# ------------------------------------------------------------------------------------------ figure
def _indented(text: str, width: int) -> str:
    """``text`` wrapped at ``width`` characters, continuation lines indented, never inside ``0.2-0.65``."""
    return textwrap.fill(text, width, subsequent_indent="  ", break_on_hyphens=False)


def pareto_plot(runs: Sequence[RunData], metric: str, x_key: str = "speedup") -> tuple[Any, list[str]]:
    """The speed-vs-quality figure of every merged run (a matplotlib ``Figure``; what it shows:
    docs/experiments.md, "Make the figures") and the ``folder/run`` ids on the Pareto front.

    Each method's line has the gid ``folder/method name``, each run's point ``folder/run``, the front's band
    ``pareto-front`` and its rings ``pareto-front-points``. A run's bars (gid ``folder/run``) are its 95% intervals
    of ``x_key`` and ``metric`` (``measure.intervals.row_interval``; none where the row has none).
    """
    label, higher, paired = METRICS[metric]
    drawn = methods(runs, keep=lambda r: is_finite_number(r.get(x_key)) and is_finite_number(r.get(metric)))
    points = [(m, r) for m in drawn for r in m.rows]
    fig = new_figure(7.5, 4.6)
    ax = fig.add_subplot()
    bars, hollow = False, False
    for m in drawn:
        ax.plot([r[x_key] for r in m.rows], [r[metric] for r in m.rows], color=m.colour, linestyle=m.linestyle,
                linewidth=1.3, zorder=2, gid=f"{m.folder}/{m.name}")
        for r in m.rows:
            x, y = r[x_key], r[metric]
            x_iv, y_iv = row_interval(r, x_key), row_interval(r, metric)
            if x_iv or y_iv:
                ax.errorbar([x], [y], xerr=x_iv and [[x - x_iv[0]], [x_iv[1] - x]],
                            yerr=y_iv and [[y - y_iv[0]], [y_iv[1] - y]], fmt="none", ecolor=m.colour, elinewidth=1,
                            capsize=2.5, zorder=2.5, gid=f"{m.folder}/{r['run']}")
                bars = True
            noisy = x_key == "speedup" and bool(r.get("timing_noisy"))
            hollow |= noisy
            ax.scatter([x], [y], s=36, marker=m.marker, zorder=3, gid=f"{m.folder}/{r['run']}",
                       facecolors="white" if noisy else m.colour, edgecolors=m.colour if noisy else "black",
                       linewidths=1.3 if noisy else 0.4)
    front = pareto_front([(r[x_key], r[metric]) for _, r in points], higher)
    if front:
        fx, fy = [points[i][1][x_key] for i in front], [points[i][1][metric] for i in front]
        ax.plot(fx, fy, zorder=1, gid="pareto-front", **FRONT_BAND)
        ax.scatter(fx, fy, s=110, facecolors="none", edgecolors="black", linewidths=1.1, zorder=3.5,
                   gid="pareto-front-points")
    base = [d.baseline[metric] for d in runs if d.baseline and is_finite_number(d.baseline.get(metric))]
    star = not paired and bool(base)  # against real images the baseline has a value of its own
    if star:
        ax.plot([1.0] * len(base), base, linestyle="none", markersize=13, zorder=4, **BASELINE_STAR)
    else:
        ax.axvline(1.0, color="gray", linestyle=":", linewidth=1.2)
    ax.set_xlabel(X_AXES[x_key])
    ax.set_ylabel(label)
    ax.grid(True, alpha=0.3)
    ax.margins(x=0.08, y=0.08)
    text_lines, entries = _legend(ax, runs, drawn, bool(front), star, bars, hollow)
    fig.set_figheight(max(4.6, 1.0 + 0.155 * text_lines + 0.06 * entries))  # the legend fits beside the axes
    title = pareto_title(runs, metric, [r for _, r in points])
    fig.suptitle(textwrap.fill(title, TITLE_WIDTH, break_on_hyphens=False), fontsize=10)
    return fig, [f"{points[i][0].folder}/{points[i][1]['run']}" for i in front]


def _legend(ax, runs: Sequence[RunData], drawn: Sequence[Method], front: bool, star: bool, bars: bool,
            hollow: bool) -> tuple[int, int]:
    """The legend beside the axes: each method once (colour and line style; one folder: its marker too) with
    its :func:`ratio_note` over the runs of every folder, with several folders each folder (its marker), the
    front, the baseline and what the timing marks mean. Returns its lines of text and entries."""
    from matplotlib.lines import Line2D

    from ..measure.timing import NOISY_SPREAD

    several = len(runs) > 1
    handles: list[Any] = []
    names: list[str] = []
    headers: list[int] = []  # bold entries without a handle

    def entry(handle: Any, name: str) -> None:
        handles.append(handle)
        names.append(name)

    def header(name: str) -> None:
        headers.append(len(names))
        entry(Line2D([], [], linestyle="none"), name)

    named: dict[str, tuple[Method, list[dict[str, Any]]]] = {}
    for m in drawn:
        named.setdefault(m.name, (m, []))[1].extend(m.rows)
    for name, (m, rows) in named.items():
        entry(Line2D([], [], color=m.colour, linestyle=m.linestyle, linewidth=1.3, marker=None if several else m.marker,
                     markersize=6, markerfacecolor=m.colour, markeredgecolor="black", markeredgewidth=0.4),
              _indented(f"{name} ({ratio_note(rows)})", LEGEND_WIDTH))
    if several:
        header("run folder")
        for j, d in enumerate(runs):
            if any(m.folder == d.name for m in drawn):
                entry(Line2D([], [], linestyle="none", marker=MARKERS[j % len(MARKERS)], markersize=6,
                             markerfacecolor="lightgray", markeredgecolor="black", markeredgewidth=0.4),
                      _indented(d.name, LEGEND_WIDTH))
    if front:
        ring = Line2D([], [], linestyle="none", marker="o", markersize=9, markerfacecolor="none",
                      markeredgecolor="black", markeredgewidth=1.1)
        entry((Line2D([], [], **FRONT_BAND), ring), "Pareto front")
    if star:
        entry(Line2D([], [], linestyle="none", markersize=11, **BASELINE_STAR), "baseline (unmerged)")
    else:
        entry(Line2D([], [], color="gray", linestyle=":", linewidth=1.2), "baseline (speed-up 1)")
    if bars:
        entry(Line2D([], [], color="0.3", linewidth=1, marker="|", markersize=7),
              "bars: 95% intervals\n  (quality: over the\n  images; speed-up:\n  over the timing rounds)")
    if hollow:
        header("timing repeats")
        entry(Line2D([], [], linestyle="none", marker="o", markersize=6.5, markerfacecolor="white",
                     markeredgecolor="0.3", markeredgewidth=1.3),
              f"hollow: noisy timing\n  (repeats differ > {NOISY_SPREAD:.0%})")
    # an axes legend: the layout makes room for it beside the axes and below the figure's title
    legend = ax.legend(handles, names, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0, fontsize=8,
                       frameon=False)
    for i in headers:
        legend.get_texts()[i].set_fontweight("bold")
    return sum(name.count("\n") + 1 for name in names), len(names)


def pareto_figure(runs: Sequence[RunData], metric: str, stem: Path, x_key: str = "speedup",
                  formats: Sequence[str] = ("png",)) -> tuple[list[Path], list[str]]:
    """``pareto_plot`` saved as ``stem.<format>``; returns the files and the ``folder/run`` ids on the front."""
    fig, front = pareto_plot(runs, metric, x_key)
    return save_figure(fig, stem, formats), front
