"""The `tomerge` command line. Each subcommand lives in its own module with `add_arguments(parser)`
and `run(args) -> exit code`; this file only wires them together.

`--plugin MODULE_OR_FILE` (repeatable, before or after the subcommand) imports a module or a `.py`
file first (see `tomerge.experiments.plugins`), before the parser is built, so the strategies it
registers are valid `--strategy` choices. Subcommands find the list, in command-line order, in
`args.plugins` (to load the same plugins in worker processes). Spell the option in full: an
abbreviated `--plug` is accepted by argparse but loaded only after the parser is built."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

SUBCOMMANDS = {
    "ablate": ("tomerge.experiments.ablate", "run a strategy x ratio grid against the unmerged baseline",
               "example: tomerge ablate --set per_class=2 --set name=quick --wandb disabled"),
    "generate": ("tomerge.experiments.generate",
                 "images for a class list or a prompt set with a chosen strategy (one process or Lightning DDP)",
                 "example: tomerge generate --classes 0 1 2 --per-class 100 --strategy tomesd --ratio 0.5 "
                 "--out runs/gen/tomesd"),
    "figures": ("tomerge.experiments.figures", "paper figures and tables from run folders (never runs a model)",
                "example: tomerge figures runs/reference --out figures/reference"),
    "bench": ("tomerge.experiments.bench", "speed benchmarks",
              "example: tomerge bench --kernels --tokens 1024 4096 --ratios 0.25 0.5"),
    "train-reference": ("tomerge.experiments.train_reference", "train the bundled reference DiT",
                        "example: tomerge train-reference --max-steps 4000 --out-dir checkpoints/reference"),
}


PLUGIN_HELP = ("import a module (my_pkg.strategies) or a .py file (path/to/my_strategy.py) first, so the "
               "strategies and backbones it registers can be used (repeatable; a file's folder is not added "
               "to sys.path)")


def _add_plugin_option(parser: argparse.ArgumentParser, dest: str) -> None:
    parser.add_argument("--plugin", dest=dest, action="append", default=[], metavar="MODULE_OR_FILE",
                        help=PLUGIN_HELP)


def plugin_specs(argv: Sequence[str]) -> list[str]:
    """The values of every ``--plugin X`` / ``--plugin=X`` in ``argv`` (anywhere before ``--``), in order."""
    specs, args = [], list(argv)
    for i, arg in enumerate(args):
        if arg == "--":
            break
        if arg == "--plugin" and i + 1 < len(args):
            specs.append(args[i + 1])
        elif arg.startswith("--plugin="):
            specs.append(arg.split("=", 1)[1])
    return specs


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tomerge", description="Training-free token merging for diffusion "
                                     "transformers: experiments, benchmarks and figures.")
    _add_plugin_option(parser, "plugins")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, help_text, example) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=f"{help_text}\n\n{example}",
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        p.set_defaults(_module=module)
        importlib.import_module(module).add_arguments(p)
        # Its own dest: a subparser's default would overwrite the list given before the subcommand.
        _add_plugin_option(p, "subcommand_plugins")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from .plugins import PluginError, load_plugins

    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        load_plugins(plugin_specs(argv))  # before the parser: subcommands build choices from the registry
        args = build_parser().parse_args(argv)
        args.plugins = [*args.plugins, *args.subcommand_plugins]
        del args.subcommand_plugins
        load_plugins(args.plugins)  # a no-op unless an abbreviated --plug escaped plugin_specs
    except PluginError as err:
        print(f"tomerge: error: {err}", file=sys.stderr)
        return 2
    return importlib.import_module(args._module).run(args)


if __name__ == "__main__":
    sys.exit(main())
