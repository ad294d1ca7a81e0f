"""Whether two runs of one run folder differ: every quality metric of run ``a`` minus run ``b`` over the same
items (the same seeds), with its 95% interval (:func:`~tomerge.experiments.measure.intervals.compare`), read from
the folder's rows (``per_image``) and ``features.safetensors`` (``run/<id>``, ``baseline``, ``reference``).

A difference whose interval excludes 0 is reported as one; otherwise it is "not resolved" at the folder's number
of images. ``tomerge compare`` prints the table; ``docs/claims.md`` cites it for its verdicts.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ..errors import UsageError, did_you_mean
from ..measure.columns import COLUMNS, format_markdown_table
from ..measure.intervals import FD_METRICS, PER_IMAGE, Comparison, compare, fd_resamplable, video_groups
from .records import format_value, last_rows, load_tensors, read_rows

__all__ = ["compare_runs", "comparison_table"]


def compare_runs(folder: Path, run_a: str, run_b: str, metrics: Sequence[str] | None = None,
                 folder_b: Path | None = None) -> tuple[list[Comparison], list[str], int]:
    """Run ``run_a`` against ``run_b`` on each metric both rows have (``metrics``: only these); returns the
    comparisons, a line for each metric that could not be compared, saying why, and the number of items.

    ``folder_b``: ``run_b`` is a run of that folder (default ``folder``); its baseline must be the same images
    (the same items and seeds: equal baseline features), else a :class:`UsageError`."""
    folder_b = folder if folder_b is None else folder_b
    rows_a = {r["run"]: r for r in last_rows(read_rows(folder))}
    rows_b = rows_a if folder_b == folder else {r["run"]: r for r in last_rows(read_rows(folder_b))}
    for run, rows, where in ((run_a, rows_a, folder), (run_b, rows_b, folder_b)):
        if run not in rows:
            raise UsageError(f"{where}: no run {run!r}{did_you_mean(run, list(rows))}")
    a, b = rows_a[run_a], rows_b[run_b]
    if a.get("n_images") != b.get("n_images"):
        raise UsageError(f"{run_a} has {a.get('n_images')} images and {run_b} {b.get('n_images')}: "
                         "a paired comparison needs the same items")
    features = load_tensors(folder, "features") or {}
    features_b = features if folder_b == folder else load_tensors(folder_b, "features") or {}
    if folder_b != folder:
        import torch

        base_a, base_b = features.get("baseline"), features_b.get("baseline")
        if base_a is None or base_b is None or not torch.equal(base_a, base_b):
            raise UsageError(f"{folder} and {folder_b} do not hold the same baseline images (the same items and "
                             "seeds): their runs cannot be paired")
    wanted = list(metrics) if metrics is not None else [k for k in (*PER_IMAGE, *FD_METRICS) if k in a and k in b]
    units = int(a["n_images"])
    groups = video_groups(units, a.get("frames_per_video"))
    done, skipped = [], []
    for metric in wanted:
        if metric in PER_IMAGE:
            va, vb = (r.get("per_image", {}).get(metric) for r in (a, b))
            if va is None or vb is None:
                skipped.append(f"{metric}: a row without per-image values (written before intervals were recorded; "
                               "`tomerge ablate` on the folder adds them)")
                continue
            done.append(compare(metric, va, vb))
        elif metric in FD_METRICS:
            from ..measure.features import ResampledFrechet

            sets = [f.get("baseline" if run == "baseline" else f"run/{run}")
                    for f, run in ((features, run_a), (features_b, run_b))]
            other = features.get("baseline" if metric == "fd_effnetlite0" else "reference")
            if any(f is None for f in (*sets, other)):
                skipped.append(f"{metric}: features.safetensors lacks a run's or the comparison set's features "
                               "(`tomerge ablate` on the folder adds them while its images are there)")
                continue
            if not fd_resamplable(units, groups):
                skipped.append(f"{metric}: FD's leave-one-out interval needs at least 3 items, the runs have {units}")
                continue
            paired = metric == "fd_effnetlite0"
            fd_a, fd_b = (ResampledFrechet(f, other, paired=paired) for f in sets)
            done.append(compare(metric, fd_a=fd_a, fd_b=fd_b, groups=groups))
        else:
            skipped.append(f"{metric}: no interval (one of {', '.join((*PER_IMAGE, *FD_METRICS))})")
    return done, skipped, units


def comparison_table(comparisons: Sequence[Comparison], run_a: str, run_b: str, n_images: int) -> str:
    """The comparisons as a Markdown table: each metric's two values, their difference, its 95% interval and the
    verdict (``a higher`` / ``a lower`` where the interval excludes 0, else ``not resolved at n images``)."""
    rows = []
    for c in comparisons:
        verdict = f"not resolved at {n_images} images" if not c.differ else \
            f"{run_a} {'higher' if c.difference > 0 else 'lower'}"
        better = COLUMNS[c.metric].better if c.metric in COLUMNS else None
        if c.differ and better is not None:
            verdict += " (better)" if (c.difference > 0) == (better == "higher") else " (worse)"
        rows.append([c.metric, format_value(c.a), format_value(c.b), format_value(c.difference),
                     f"[{format_value(c.lo)}, {format_value(c.hi)}]", verdict])
    return format_markdown_table(["metric", run_a, run_b, "difference", "95% interval", "verdict"], rows,
                                 [False, True, True, True, True, False])
