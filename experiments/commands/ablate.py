"""`tomerge ablate`: its arguments and its flow (load the config, run the grid, print the table). The grid
itself is :func:`tomerge.experiments.runs.ablation.run_ablation`."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from ..config.help import config_help
from ..config.load import load_config
from ..errors import module_main, user_input
from ..runs import ablation
from ..runs.ablation import run_ablation
from . import add_folder_arguments, command_overrides

__all__ = ["add_arguments", "run", "main"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = config_help()  # shown as written: the subcommand parsers format descriptions raw
    parser.add_argument("--config", type=Path, default=None,
                        help="YAML config (default: experiments/configs/ablate.yaml, the reference-model grid)")
    add_folder_arguments(parser, "model.call.height=512")


def run(args: argparse.Namespace) -> int:
    overrides = command_overrides(args)
    with user_input():
        config = load_config(args.config, overrides, plugins=list(getattr(args, "plugins", None) or []),
                             check_inputs=True)
    folder = run_ablation(config)
    print()
    print(folder.table_path.read_text())
    print(f"results: {folder.path}/results.csv, {folder.path}/results.jsonl; images and merge maps in {folder.path}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tomerge ablate", description=ablation.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    module_main("ablate", main)
