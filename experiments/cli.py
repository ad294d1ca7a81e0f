"""The `tomerge` command line. Each subcommand lives in its own module with `add_arguments(parser)`
and `run(args) -> exit code`; this file only wires them together."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

SUBCOMMANDS = {
    "ablate": ("tomerge.experiments.ablate", "run a strategy x ratio grid against the unmerged baseline",
               "example: tomerge ablate --set per_class=2 --set name=quick --wandb disabled"),
    "generate": ("tomerge.experiments.generate",
                 "images for a class list with a chosen strategy (one process or Lightning DDP)",
                 "example: tomerge generate --classes 0 1 2 --per-class 100 --strategy tomesd --ratio 0.5 "
                 "--out runs/gen/tomesd"),
    "figures": ("tomerge.experiments.figures", "paper figures and tables from run folders (never runs a model)",
                "example: tomerge figures runs/reference --out figures/reference"),
    "bench": ("tomerge.experiments.bench", "speed benchmarks",
              "example: tomerge bench --kernels --tokens 1024 4096 --ratios 0.25 0.5"),
    "train-reference": ("tomerge.experiments.train_reference", "train the bundled reference DiT",
                        "example: tomerge train-reference --max-steps 4000 --out-dir checkpoints/reference"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tomerge", description="Training-free token merging for diffusion "
                                     "transformers: experiments, benchmarks and figures.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, help_text, example) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=f"{help_text}\n\n{example}",
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        p.set_defaults(_module=module)
        importlib.import_module(module).add_arguments(p)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return importlib.import_module(args._module).run(args)


if __name__ == "__main__":
    sys.exit(main())
