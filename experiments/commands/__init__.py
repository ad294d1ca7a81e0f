"""One file per ``tomerge`` subcommand, each a thin ``main`` over library code: ``add_arguments(parser)`` (its
options), ``run(args) -> exit code`` (its flow), and ``main(argv)`` for ``python -m
tomerge.experiments.commands.NAME``. ``tomerge.experiments.cli`` wires them together.
``add_folder_arguments`` and ``command_overrides`` are the options of the commands that write a run folder.
"""

from __future__ import annotations

import argparse
from pathlib import Path

__all__ = ["add_folder_arguments", "command_overrides"]


def add_folder_arguments(parser: argparse.ArgumentParser, example: str) -> None:
    """``--set``, ``--wandb`` and ``--out-dir``, read by :func:`command_overrides` (``example``: a dotted key)."""
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help=f"override a config entry, dotted keys ({example}), YAML values (repeatable)")
    parser.add_argument("--wandb", choices=["disabled", "offline", "online"], default=None,
                        help="W&B mode (default: offline unless an API key is configured)")
    parser.add_argument("--out-dir", type=Path, default=None, help="parent folder of run folders (default runs/)")


def command_overrides(args: argparse.Namespace) -> list[str]:
    """The ``--set`` overrides of a command line, with ``--wandb`` and ``--out-dir`` as the keys they set
    (``tomerge ablate``, ``tomerge search``, ``tomerge tune``)."""
    overrides = list(args.overrides)
    if args.wandb is not None:
        overrides.append(f"wandb={args.wandb}")
    if args.out_dir is not None:
        overrides.append(f"out_dir={args.out_dir}")
    return overrides
