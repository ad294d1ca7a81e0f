"""`tomerge compare`: whether two runs of one run folder differ, metric by metric, with the 95% interval of each
difference over the same images (:mod:`tomerge.experiments.runs.comparison`). Never runs a model."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from ..errors import module_main
from ..measure.intervals import FD_METRICS, PER_IMAGE
from ..runs import comparison

__all__ = ["add_arguments", "run", "main"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="a run folder written by `tomerge ablate`")
    parser.add_argument("run_a", metavar="RUN_A", help="a run id of the folder (or baseline)")
    parser.add_argument("run_b", metavar="RUN_B", help="another run id of the folder")
    parser.add_argument("--b-dir", type=Path, default=None, metavar="RUN_DIR_B",
                        help="RUN_B is a run of this folder, made with the same items and seeds (default: RUN_DIR)")
    parser.add_argument("--metrics", nargs="+", choices=[*PER_IMAGE, *FD_METRICS], default=None,
                        help="metrics to compare (default: every one both rows have)")


def run(args: argparse.Namespace) -> int:
    done, skipped, n_images = comparison.compare_runs(args.run_dir, args.run_a, args.run_b, args.metrics, args.b_dir)
    print(comparison.comparison_table(done, args.run_a, args.run_b, n_images))
    for line in skipped:
        print(f"not compared: {line}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tomerge compare", description=comparison.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    module_main("compare", main)
