"""The one table of result-row columns: for each key of a result row, how tables title it, how figures label
and format it, which way it is better, and whether it compares against the baseline images.

Every other list of columns is derived from :data:`COLUMNS`: the run folder's ``table.md`` and W&B table
(:data:`RUN_TABLE_KEYS`, ``records.TABLE_COLUMNS``), the objectives of ``tomerge search``
(:data:`BETTER`, ``records.BETTER``), the quality labels (``metrics.QUALITY_LABELS``), and the table and
axes of ``tomerge figures`` (``figures.COLUMNS``, ``figures.METRICS``). :func:`format_markdown_table` is the
one Markdown table writer (``tomerge ablate``'s ``table.md``, ``tomerge bench``, ``tomerge figures``).
This module imports nothing of tomerge.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

__all__ = ["Column", "COLUMNS", "RUN_TABLE_KEYS", "BETTER", "FD_LABEL", "table_columns", "figure_columns",
           "plotted_metrics", "quality_labels", "format_markdown_table"]

FD_LABEL = "FD-EffNetLite0"


@dataclasses.dataclass(frozen=True)
class Column:
    """One key of a result row and how it is shown.

    Attributes:
        key: the row's key (``metrics.compute_quality``, ``timing.speed_columns``, ``ablate``).
        label: the long name of a quality metric (W&B, docs); ``None`` for other columns.
        table_title: the title in the run folder's ``table.md`` and the W&B table.
        figure_title: the title in ``tomerge figures``' table (``None``: not in it); ``figure_format`` its cells.
        axis_label: the axis label of a plotted metric (``None``: not plotted); ``tomerge figures --metrics``.
        better: ``"higher"`` or ``"lower"`` (``tomerge search`` objectives, bold best values), ``None``: neither.
        vs_baseline: measured against the baseline images at the same seeds (paired), not against real images.
    """

    key: str
    label: str | None = None
    table_title: str | None = None
    figure_title: str | None = None
    figure_format: str = "{:.2f}"
    axis_label: str | None = None
    better: str | None = None
    vs_baseline: bool = False


#: Every column, in the order of ``tomerge figures``' table and plots (the run table's order: RUN_TABLE_KEYS).
COLUMNS: dict[str, Column] = {c.key: c for c in [
    Column("run", table_title="run"),
    Column("ratio", table_title="ratio", figure_title="ratio", figure_format="{:g}"),
    Column("speedup", table_title="speed-up", figure_title="speed-up", better="higher"),
    Column("flop_speedup", table_title="FLOP-ideal", figure_title="FLOP-ideal", better="higher"),
    Column("overhead_ratio", table_title="measured/ideal", figure_title="meas./ideal"),
    Column("timing_spread", table_title="timing spread"),
    Column("tokens_removed_mean", figure_title="removed"),
    Column("time_per_image_s", table_title="s/image", better="lower"),
    Column("flops", better="lower"),
    Column("flops_per_image", better="lower"),
    # merge + unmerge + planning GFLOPs per image (flops.FlopCounter.get_merge_flops), a part of `flops`:
    # ablate's result rows, bench's tables
    Column("merge_gflops", table_title="merge GFLOP/image", figure_title="merge GFLOP", figure_format="{:.3g}"),
    Column("denoiser_speedup", better="higher"),
    Column("time_s", better="lower"),
    Column("peak_memory_mb", better="lower"),
    Column("psnr", label="PSNR (dB)", table_title="PSNR dB", figure_title="PSNR",
           axis_label="PSNR vs baseline (dB)", better="higher", vs_baseline=True),
    Column("ssim", label="SSIM", table_title="SSIM", figure_title="SSIM", figure_format="{:.3f}",
           axis_label="SSIM vs baseline", better="higher", vs_baseline=True),
    Column("feat_cos_dist", label="EffNetLite0 feature cosine distance", table_title="EffNetLite0 cos dist",
           better="lower", vs_baseline=True),
    Column("fd_effnetlite0", label=FD_LABEL, table_title=f"{FD_LABEL} vs baseline", figure_title=FD_LABEL,
           axis_label=f"{FD_LABEL} vs baseline images (lower is better)", better="lower", vs_baseline=True),
    Column("fd_effnetlite0_ref", label=f"{FD_LABEL} vs reference", table_title=f"{FD_LABEL} vs test",
           figure_title=f"{FD_LABEL} vs ref", axis_label=f"{FD_LABEL} vs real images (lower is better)",
           better="lower"),
    Column("fd_effnetlite0_ref_baseline", label=f"{FD_LABEL} baseline vs reference"),
    Column("fid", label="FID (Inception-v3)", table_title="FID", figure_title="FID",
           axis_label="FID, Inception-v3, vs real images (lower is better)", better="lower"),
    Column("clip_score", label="CLIP score", table_title="CLIP score", figure_title="CLIP", axis_label="CLIP score",
           better="higher"),
    Column("dino_dist", label="DINO distance (1 - cos of CLS embeddings) vs baseline",
           table_title="DINO dist (lower is better)", figure_title="DINO dist", figure_format="{:.3f}",
           axis_label="DINO distance vs baseline images, 1 - cos of CLS (lower is better)", better="lower",
           vs_baseline=True),
    Column("n_images", label="images"),
]}

#: The columns of the run folder's ``table.md`` and W&B table, in their order; one is shown when a row has it.
RUN_TABLE_KEYS = ("run", "ratio", "speedup", "flop_speedup", "overhead_ratio", "timing_spread", "time_per_image_s",
                  "psnr", "ssim", "feat_cos_dist", "fd_effnetlite0", "fd_effnetlite0_ref", "clip_score", "fid",
                  "dino_dist")

#: Which way each numeric column is better: what ``tomerge search`` optimises, and figures mark in bold.
BETTER: dict[str, str] = {c.key: c.better for c in COLUMNS.values() if c.better is not None}


def table_columns() -> list[tuple[str, str]]:
    """``(key, title)`` of the run folder's table (``records.TABLE_COLUMNS``)."""
    return [(key, COLUMNS[key].table_title) for key in RUN_TABLE_KEYS]


def figure_columns() -> list[tuple[str, str, str, bool | None]]:
    """``(key, title, format, higher is better or None)`` of ``tomerge figures``' table (``figures.COLUMNS``)."""
    return [(c.key, c.figure_title, c.figure_format, None if c.better is None else c.better == "higher")
            for c in COLUMNS.values() if c.figure_title is not None]


def plotted_metrics() -> dict[str, tuple[str, bool, bool]]:
    """``{key: (axis label, higher is better, vs baseline)}`` of the plotted metrics (``figures.METRICS``)."""
    return {c.key: (c.axis_label, c.better == "higher", c.vs_baseline)
            for c in COLUMNS.values() if c.axis_label is not None}


def quality_labels() -> dict[str, str]:
    """``{key: label}`` of the quality metrics (``metrics.QUALITY_LABELS``)."""
    return {c.key: c.label for c in COLUMNS.values() if c.label is not None}


def format_markdown_table(titles: Sequence[str], rows: Sequence[Sequence[str]], numeric: Sequence[bool]) -> str:
    """A Markdown table, without a final newline: the titles, an alignment line (right for ``numeric``
    columns) and one line per row of cell texts.

    Example:
        >>> print(format_markdown_table(["run", "ratio"], [["a", "0.5"]], [False, True]))
        | run | ratio |
        |---|---:|
        | a | 0.5 |
    """
    lines = ["| " + " | ".join(titles) + " |", "|" + "|".join("---:" if n else "---" for n in numeric) + "|"]
    lines += ["| " + " | ".join(cells) + " |" for cells in rows]
    return "\n".join(lines)
