"""What ``tomerge search`` writes and prints (:mod:`~tomerge.experiments.runs.search` runs the search): the
sampler's summary (:func:`sampler_summary`: sampler, population, generations run), every trial
(:func:`trials_table`, ``search/trials.md``), the front (:func:`front_table`, ``search/front.md``), and the
front's configs and figure (:func:`write_front`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from ..config.schema import AblationConfig, RunSpec
from .records import BETTER, format_value

if TYPE_CHECKING:
    from .search_space import SearchSpace

__all__ = ["SAMPLER_NAMES", "sampler_summary", "trials_table", "front_table", "write_front", "grid_of", "rows_of"]


def grid_of(runs: Sequence[RunSpec]) -> tuple[dict[str, Any], ...]:
    """Grid entries that rerun ``runs`` (one entry per run: options differ from run to run; a FLOP-matched run
    keeps its target)."""
    return tuple({"strategy": r.strategy, **({"ratios": [r.ratio]} if r.flop_target is None
                                             else {"flop_speedups": [r.flop_target]}), "options": dict(r.options)}
                 for r in runs)


SAMPLER_NAMES = {"nsga2": "NSGA-II (nsga2)", "tpe": "TPE (tpe)", "random": "random sampling (random)"}


def generations_text(trials: int, population: int) -> str:
    full, rest = divmod(trials, population)
    text = f"{full} generation{'s' if full != 1 else ''}" + (f" and {rest} trial{'s' if rest != 1 else ''} of the next" if rest else "")
    return text + " (generation 0: random draws)"


def _generations(study: Any) -> list[int]:
    """The NSGA-II generation of each completed trial (Optuna's own record)."""
    import optuna
    from optuna.trial import TrialState

    key = optuna.samplers.NSGAIISampler._get_generation_key()
    return [t.system_attrs[key] for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
            if key in t.system_attrs]


def sampler_summary(study: Any, space: SearchSpace) -> str:
    """The sampler, its population and the generations the study ran, in one line (``front.md``,
    ``trials.md`` and the command's summary)."""
    import optuna
    from optuna.trial import TrialState

    done = len(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)))
    head = f"sampler: {SAMPLER_NAMES[space.sampler]}, seed {space.seed}, Optuna {optuna.__version__}"
    if space.sampler != "nsga2":
        return f"{head}; {done} completed trials"
    generations = _generations(study)
    counts = {g: generations.count(g) for g in sorted(set(generations))}
    full = sum(n >= space.population for n in counts.values())
    partial = [f"generation {g}: {n} trial{'s' if n != 1 else ''}" for g, n in counts.items() if n < space.population]
    return (f"{head}; population {space.population}; {done} completed trials: {full} full generation"
            f"{'s' if full != 1 else ''} (generation 0: random draws; each later one bred from the best before it)"
            + (f", partial: {', '.join(partial)}" if partial else ""))


def trials_table(study: Any, space: SearchSpace, summary: str) -> str:
    """Every trial of the study as a markdown table (``search/trials.md``): its number, state, NSGA-II
    generation, run id, strategy, ratio, options and objective values, after a line naming the sampler."""
    import json

    import optuna

    key = optuna.samplers.NSGAIISampler._get_generation_key()
    header = ["trial", "state", *(["generation"] if space.sampler == "nsga2" else []), "run", "strategy", "ratio",
              "options", *space.objectives]
    lines = [summary, "", "| " + " | ".join(header) + " |", "|" + "|".join("---:" if h in ("trial", "generation",
             "ratio", *space.objectives) else "---" for h in header) + "|"]
    for t in study.get_trials(deepcopy=False):
        attrs = t.user_attrs
        values = list(t.values) if t.values is not None else [None] * len(space.objectives)
        cells = [str(t.number), t.state.name.lower(),
                 *([str(t.system_attrs.get(key, "-"))] if space.sampler == "nsga2" else []),
                 f"`{attrs['run']}`" if "run" in attrs else "-", attrs.get("strategy", "-"),
                 format_value(attrs.get("ratio")),
                 json.dumps(attrs["options"], sort_keys=True).replace("|", "\\|") if "options" in attrs else "-",
                 *("-" if v is None else f"{v:.6g}" for v in values)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def rows_of(config: AblationConfig, runs: Sequence[RunSpec]) -> list[dict[str, Any]]:
    from .records import RunFolder

    folder = RunFolder.open(dataclasses.replace(config, grid=grid_of(runs)))
    try:
        last = {r["run"]: r for r in folder.rows}
        return [last[r.run_id] for r in runs]
    finally:
        folder.close()


def front_table(front: Sequence[RunSpec], rows: Sequence[dict[str, Any]],
                held_out_rows: Sequence[dict[str, Any]] | None, space: SearchSpace) -> str:
    """The front as a markdown table: each objective on the searched items and, when given, held out (with
    its 95% interval where the row has one)."""
    held = {r["run"]: r for r in held_out_rows or []}
    titles = [f"{c} ({BETTER[c]} is better)" for c in space.objectives]
    header = ["run", *titles, *([f"{t}, held out" for t in titles] if held_out_rows is not None else [])]
    lines = ["| " + " | ".join(header) + " |", "|---" + "|---:" * (len(header) - 1) + "|"]
    for run, row in sorted(zip(front, rows), key=lambda pair: pair[1][space.objectives[0]]):
        cells = [run.run_id, *(_with_interval(row, c) for c in space.objectives)]
        if held_out_rows is not None:
            cells += [_with_interval(held.get(run.run_id, {}), c) for c in space.objectives]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _with_interval(row: dict[str, Any], column: str) -> str:
    """A value with its 95% interval where the row has one (``value [lo, hi]``), else the value."""
    lo, hi = row.get(f"{column}_lo"), row.get(f"{column}_hi")
    interval = f" [{format_value(lo)}, {format_value(hi)}]" if lo is not None and hi is not None else ""
    return format_value(row.get(column)) + interval


def write_front(study: Any, space: SearchSpace, config: AblationConfig, front: Sequence[RunSpec], out: Path) -> None:
    """``front.yaml`` (an ablation config of the front's runs), ``held_out.yaml`` (the same runs on the held-out
    items) and ``front.png`` / ``front.pdf`` (Optuna's Pareto-front plot of the first two objectives)."""
    from ..generation.files import write_text_atomic

    def dump(c: AblationConfig) -> str:  # a config file that `tomerge ablate --config` reads
        return yaml.safe_dump({**c.to_dict(), "model": c.model.to_config()}, sort_keys=False)

    front_config = dataclasses.replace(config, name=f"{config.name}_front", grid=grid_of(front))
    write_text_atomic(out / "front.yaml", dump(front_config))
    if space.held_out:
        write_text_atomic(out / "held_out.yaml", dump(space.held_out_config(config, front)))
    if len(space.objectives) >= 2:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import optuna.visualization.matplotlib as ovm

        import warnings

        import optuna

        names = list(space.objectives[:2])
        with warnings.catch_warnings():  # Optuna marks its matplotlib plots experimental
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            axes = ovm.plot_pareto_front(study, targets=lambda t: tuple(t.values[:2]), target_names=names)
        axes.set_title(f"{config.name}: {len(study.trials)} trials, {len(front)} on the front")
        for suffix in ("png", "pdf"):
            axes.figure.savefig(out / f"front.{suffix}", bbox_inches="tight")
        plt.close(axes.figure)
