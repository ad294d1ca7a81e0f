"""The ablation table of run folders (``OUT/ablation.md``, and ``OUT/ablation.tex`` with booktabs): one row per
run, a column for each of :data:`COLUMNS` some row has, each value with its 95% interval where the row has one,
the best merged value per column in bold."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from ..measure.columns import figure_columns, format_markdown_table
from ..measure.intervals import row_interval
from .canvas import is_finite_number
from .run_data import RunData

__all__ = ["COLUMNS", "ablation_table"]

# key, title, format, higher is better (None: no bold); a column appears when some row has its key
COLUMNS = figure_columns()


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
    return ". ".join(parts) + (". Brackets: 95\\% intervals (quality: over the images, paired with the "
                               "baseline's, bootstrap or, for FD, jackknife; speed-up: over the timing rounds). Best merged value in bold.")


def ablation_table(runs: Sequence[RunData], latex: bool = False) -> str:
    """The ablation table (Markdown, or LaTeX with booktabs); the best merged value per column in bold."""
    several = len(runs) > 1
    rows = [(d.name, r) for d in runs for r in d.rows]
    columns = [c for c in COLUMNS if c[0] == "ratio" or any(r.get(c[0]) is not None for _, r in rows)]
    best: dict[str, float] = {}
    for key, _, fmt, higher in columns:
        values = [r[key] for _, r in rows if r["run"] != "baseline" and is_finite_number(r.get(key))]
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
            interval = row_interval(r, key)
            if interval is not None and r.get(key) is not None:
                bounds = f"[{_cell(interval[0], fmt, latex)}, {_cell(interval[1], fmt, latex)}]"
                text += f" {{\\scriptsize {bounds}}}" if latex else f" {bounds}"
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
