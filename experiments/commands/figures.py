"""`tomerge figures`: its arguments and its flow (every figure and table of the run folders, then the table
printed and the files listed). What it draws is :func:`tomerge.experiments.figures.make.make_figures`."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from ..errors import module_main
from ..figures import make
from ..figures.canvas import METRICS, X_AXES
from ..figures.make import make_figures
from ..figures.run_data import GRID_SELECT

__all__ = ["add_arguments", "run", "main"]


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
    parser = argparse.ArgumentParser(prog="tomerge figures", description=make.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    module_main("figures", main)
