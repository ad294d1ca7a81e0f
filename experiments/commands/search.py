"""`tomerge search`: its arguments and its flow (load the search config, run the trials, print the front). The
search itself is :func:`tomerge.experiments.runs.search.run_search`."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from ..errors import module_main, user_input
from . import add_folder_arguments, command_overrides
from ..runs import search
from ..runs.search import load_search, run_search
from ..runs.search_output import front_table

__all__ = ["add_arguments", "run", "main"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, required=True, help="YAML config with a search: section")
    add_folder_arguments(parser, "search.trials=10")
    parser.add_argument("--no-held-out", action="store_true", help="do not re-score the front on search.held_out")
    parser.add_argument("--dry-run", action="store_true",
                        help="check the config and the whole space, print the sampler's plan, run nothing")


def run(args: argparse.Namespace) -> int:
    with user_input():
        config, space = load_search(args.config, command_overrides(args),
                                    plugins=list(getattr(args, "plugins", None) or []))
    print(f"search {config.name}: {space.plan()}; {len(space.entries)} space entries")
    if space.warning:
        print(f"warning: {space.warning}", file=sys.stderr)
    if args.dry_run:
        print("the config and every space entry are valid (--dry-run: nothing run)")
        return 0
    result = run_search(config, space, held_out=not args.no_held_out)
    print()
    print(result.sampler)
    print(f"{len(result.trials)} trials (every trial: {result.folder}/search/trials.md); the Pareto front of "
          f"{', '.join(space.objectives)}:")
    print(front_table(result.front, result.front_rows, result.held_out_rows, space))
    print(f"front: {result.folder}/search/front.md, front.png/.pdf; rerun it: tomerge ablate --config "
          f"{result.folder}/search/front.yaml")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tomerge search", description=search.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    module_main("search", main)
