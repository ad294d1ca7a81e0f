"""Which method is best at equal speed-up: each strategy's metric interpolated at given speed-ups.

For every strategy of the run folders (read with ``tomerge.experiments.figures.run_data.load_run``), its runs are
sorted by speed-up (``--x``: ``flop_speedup``, exact, or the measured ``speedup``) and the metric is
interpolated linearly between the two runs that bracket each ``--at`` value; a strategy whose runs do not span
a value has no entry there (no extrapolation, and the baseline is not a point of the curves). Runs of one
strategy whose options differ (e.g. ``order``) are separate curves, named by those options. Prints a markdown
table, best value per column in bold.

    python scripts/equal_speedup.py runs/claims_headline runs/claims_headline_presets \\
        --metric fd_effnetlite0 --at 1.1 1.2 1.3 1.5 2.0
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from pathlib import Path

from tomerge.experiments.figures.canvas import METRICS
from tomerge.experiments.figures.pareto import method_name, varying_options
from tomerge.experiments.figures.run_data import load_run


def curves(folders: list[Path], x: str, metric: str) -> dict[str, list[tuple[float, float]]]:
    """``{curve name: [(speed-up, metric), ...]}`` sorted by speed-up, one curve per strategy and value of the
    options that vary between its runs (:func:`~tomerge.experiments.figures.pareto.method_name`). The baseline is
    not a point of the curves: quality falls steeply with the first merged tokens, so a line from the baseline
    to the first run would flatter every method below its smallest ratio."""
    rows = [r for folder in folders for r in load_run(folder).merged]
    varying = varying_options(rows)
    found: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for row in rows:
        found[method_name(row, varying[row["strategy"]])].append((row[x], row[metric]))
    return {name: sorted(points) for name, points in found.items()}


def at(points: list[tuple[float, float]], speedup: float) -> float | None:
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x0 <= speedup <= x1 and x1 > x0:
            return y0 + (y1 - y0) * (speedup - x0) / (x1 - x0)
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dirs", nargs="+", type=Path)
    parser.add_argument("--x", default="flop_speedup", choices=["flop_speedup", "speedup"])
    parser.add_argument("--metric", default="fd_effnetlite0", choices=sorted(METRICS))
    parser.add_argument("--at", nargs="+", type=float, default=[1.1, 1.2, 1.3, 1.5, 2.0])
    args = parser.parse_args()
    table = curves(args.run_dirs, args.x, args.metric)
    values = {name: [at(points, s) for s in args.at] for name, points in table.items()}
    pick = max if METRICS[args.metric][1] else min  # (label, higher is better, paired)
    best = [pick((v[i] for v in values.values() if v[i] is not None), default=None) for i in range(len(args.at))]
    print(f"| method | " + " | ".join(f"{args.metric} at {s:g}x" for s in args.at) + " |")
    print("|---|" + "---:|" * len(args.at))
    for name, vals in sorted(values.items()):
        cells = ["-" if v is None else (f"**{v:.1f}**" if v == best[i] else f"{v:.1f}") for i, v in enumerate(vals)]
        print(f"| `{name}` | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
