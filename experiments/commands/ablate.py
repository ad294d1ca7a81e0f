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

__all__ = ["add_arguments", "command_overrides", "run", "main"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = config_help()  # shown as written: the subcommand parsers format descriptions raw
    parser.add_argument("--config", type=Path, default=None,
                        help="YAML config (default: experiments/configs/ablate.yaml, the reference-model grid)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config entry, dotted keys (model.call.height=512), YAML values (repeatable)")
    parser.add_argument("--wandb", choices=["disabled", "offline", "online"], default=None,
                        help="W&B mode (default: offline unless an API key is configured)")
    parser.add_argument("--out-dir", type=Path, default=None, help="parent folder of run folders (default runs/)")


def command_overrides(args: argparse.Namespace) -> list[str]:
    """The ``--set`` overrides of a command line, with ``--wandb`` and ``--out-dir`` as the keys they set
    (``tomerge ablate`` and ``tomerge search``)."""
    overrides = list(args.overrides)
    if args.wandb is not None:
        overrides.append(f"wandb={args.wandb}")
    if args.out_dir is not None:
        overrides.append(f"out_dir={args.out_dir}")
    return overrides


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
