"""`tomerge tune`: its arguments and its flow (load the tune config, run the search, print the recipe). The tune itself
is :func:`tomerge.experiments.runs.tune.run_tune`."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from ..errors import module_main, user_input
from . import add_folder_arguments, command_overrides
from ..runs import tune as tune_runs
from ..runs.tune import BY, TuneResult, TuneSpec, load_tune, run_tune

__all__ = ["add_arguments", "run", "main", "tune", "write_figure"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, required=True,
                        help="YAML config with a search: section (the space) and a tune: section")
    parser.add_argument("--target", type=float, default=None, help="the speed-up to reach (tune.target), e.g. 2")
    parser.add_argument("--by", choices=BY, default=None,
                        help="measured speed-up (time) or FLOP-ideal (flops); auto: time with CUDA, else flops")
    parser.add_argument("--objective", default=None,
                        help="the quality column to optimise (tune.objective; default fd_effnetlite0), e.g. psnr")
    parser.add_argument("--trials", type=int, default=None, help="trial budget (search.trials)")
    parser.add_argument("--minutes", type=float, default=None, help="time budget: no trial starts after it")
    add_folder_arguments(parser, "model.call.num_steps=4")
    parser.add_argument("--no-held-out", action="store_true", help="do not verify the recipe on search.held_out")
    parser.add_argument("--dry-run", action="store_true", help="check the config and the space, run nothing")


def run(args: argparse.Namespace) -> int:
    sets = key_overrides(args.target, args.by, args.objective, args.minutes, args.trials)
    with user_input():
        config, space, spec = load_tune(args.config, [*command_overrides(args), *sets],
                                        plugins=list(getattr(args, "plugins", None) or []))
    minutes = f" or {spec.minutes:g} minutes" if spec.minutes else ""
    print(f"tune {config.name}: {spec.target:g}x by {spec.by}, objective {spec.objective}; {space.plan()}{minutes}")
    if spec.why:
        print(f"tune: {spec.why}", file=sys.stderr)
    if args.dry_run:
        print("the config and every space entry are valid (--dry-run: nothing run)")
        return 0
    result = run_tune(config, space, spec, held_out=not args.no_held_out)
    write_figure(result.folder, spec)
    print()
    print((result.folder / "tune" / "front.md").read_text())
    print(f"recipe: {result.folder}/tune/recipe.yaml (tomerge ablate --config / tomerge generate --config / "
          "tomerge.apply(pipe, tomerge.Recipe.load(path)))")
    return 0


def key_overrides(target: float | None, by: str | None, objective: str | None, minutes: float | None,
                  trials: int | None) -> list[str]:
    """The config overrides of the keys given (``None``: the config's)."""
    keys = (("tune.target", target), ("tune.by", by), ("tune.objective", objective), ("tune.minutes", minutes),
            ("search.trials", trials))
    return [f"{key}={value}" for key, value in keys if value is not None]


def write_figure(folder: Path, spec: TuneSpec) -> None:
    """The speed-vs-objective figure of every run the tune measured, with intervals (``front.png``/``.pdf``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ..figures.pareto import METRICS, pareto_plot
    from ..figures.run_data import load_run

    out = folder / "tune"
    if spec.objective not in METRICS:  # a column without a figure axis (e.g. a plugin's)
        return
    fig, _ = pareto_plot([load_run(folder)], spec.objective, x_key=spec.speedup_column)
    fig.axes[0].axvline(spec.target, color="black", linestyle="--", linewidth=1)
    for suffix in ("png", "pdf"):
        fig.savefig(out / f"front.{suffix}", bbox_inches="tight")
    plt.close(fig)


def tune(config: str | Path, target: float | None = None, *, by: str | None = None, objective: str | None = None,
         trials: int | None = None, minutes: float | None = None, overrides: Sequence[str] = (),
         progress: bool = True) -> TuneResult:
    """``tomerge tune`` from Python: the tune config at ``config`` with the given keys set over it; returns the
    :class:`TuneResult` (``tomerge.apply(pipe, result.recipe)`` attaches the recipe).

    Example:
        >>> result = tomerge.tune("experiments/configs/tune.yaml", 2.0, objective="psnr")   # doctest: +SKIP
        >>> tomerge.apply(pipe, result.recipe)                                              # doctest: +SKIP
    """
    sets = key_overrides(target, by, objective, minutes, trials)
    loaded, space, spec = load_tune(config, [*overrides, *sets])
    if spec.why:
        print(f"tune: {spec.why}", file=sys.stderr)
    result = run_tune(loaded, space, spec, progress=progress)
    write_figure(result.folder, spec)
    return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tomerge tune", description=tune_runs.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    module_main("tune", main)
