"""What every figure of ``tomerge figures`` shares: a matplotlib figure made without pyplot (:func:`new_figure`)
and saved in each format (:func:`save_figure`), wrapped labels (:func:`wrap_label`), which values are drawn
(:func:`is_finite_number`), and the plotted metrics and speed axes with their names (:data:`METRICS`,
:data:`X_AXES`, :func:`metric_name`)."""

from __future__ import annotations

import math
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..measure.columns import plotted_metrics

__all__ = ["METRICS", "X_AXES", "is_finite_number", "metric_name", "new_figure", "save_figure", "wrap_label"]

# metric -> (axis label, higher is better, paired with the baseline images); from columns.COLUMNS
METRICS = plotted_metrics()
X_AXES = {"speedup": "measured speed-up (x)", "flop_speedup": "FLOP-ideal speed-up (x)"}


def is_finite_number(value: Any) -> bool:
    """Whether a row's value is drawn: an int or float (not a bool), neither infinite nor NaN."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def metric_name(metric: str) -> str:
    """A metric's name in titles and small labels: its axis label without the parenthesis.

    Example:
        >>> metric_name("fd_effnetlite0")
        'FD-EffNetLite0 vs baseline images'
    """
    return METRICS[metric][0].split(" (")[0]


def wrap_label(text: str, width: int = 24) -> str:
    """``text`` in lines of at most ``width`` characters (broken at spaces and hyphens)."""
    return "\n".join(textwrap.wrap(text, width, break_on_hyphens=True)) or text


def new_figure(width: float, height: float):
    """A matplotlib ``Figure`` of ``width`` x ``height`` inches, 150 dpi, constrained layout."""
    from matplotlib.figure import Figure  # no pyplot: no global figure registry, no backend switch

    return Figure(figsize=(width, height), dpi=150, layout="constrained")


def save_figure(fig, stem: Path, formats: Sequence[str]) -> list[Path]:
    """``fig`` saved as ``stem.<format>`` for each of ``formats`` (folders made); returns the files."""
    stem.parent.mkdir(parents=True, exist_ok=True)
    paths = [stem.with_name(f"{stem.name}.{fmt}") for fmt in formats]
    for p in paths:
        fig.savefig(p)
    return paths
