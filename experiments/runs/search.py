"""``tomerge search``: a multi-objective search over strategies, ratios and options (Optuna).

A search config is an ablation config without ``grid:``, plus a ``search:`` section (trials, sampler,
objectives, the space of strategies, ratios and options, held-out items). Every trial is a normal, resumable
run of the run folder; the Pareto front is written as a table, a figure and a config that reruns it, and is
re-scored on held-out items. The section's keys, the sampler's population and the outputs: docs/experiments.md,
"3b. Search".

Example:
    tomerge search --config experiments/configs/search.yaml --set search.trials=10
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ..errors import UsageError
from ..config.load import load_config_sections
from ..config.schema import AblationConfig, ConfigError, RunSpec
from .search_output import front_table, grid_of, rows_of, sampler_summary, trials_table, write_front
from .search_space import SearchSpace

# optuna, torch and the model are imported where they are used: `--help` needs none.

__all__ = ["run_search", "load_search", "run_trial", "objective_values"]

def load_search(path: Path, overrides: list[str], plugins: list[str] | None = None,
                check_inputs: bool = True) -> tuple[AblationConfig, SearchSpace]:
    """The ablation config and the parsed ``search:`` section of a search config (every problem at once)."""
    config, sections = load_config_sections(path, overrides, plugins=plugins, check_inputs=check_inputs,
                                            sections=("search",))
    if config.grid:
        raise ConfigError(["a search config has no grid: (the search chooses the runs); remove it"])
    return config, SearchSpace.parse(sections.get("search"), config)


# ------------------------------------------------------------------------------------------ the loop
@dataclasses.dataclass
class SearchResult:
    """The finished search: every completed trial's run and objective values, the Pareto front, the
    rows of the front's runs in the search and (when run) on the held-out items."""

    folder: Path
    trials: list[tuple[RunSpec, tuple[float, ...]]]
    front: list[RunSpec]
    front_rows: list[dict[str, Any]]
    held_out_rows: list[dict[str, Any]] | None
    sampler: str = ""  # sampler_summary(): the sampler, its population, the generations run


def _sampler(space: SearchSpace):
    import optuna

    if space.sampler == "nsga2":
        return optuna.samplers.NSGAIISampler(population_size=space.population, seed=space.seed)
    if space.sampler == "tpe":
        return optuna.samplers.TPESampler(seed=space.seed, multivariate=True, group=True)
    return optuna.samplers.RandomSampler(seed=space.seed)


def run_trial(config: AblationConfig, run: RunSpec) -> dict[str, Any]:
    """The result row of ``run`` in the run folder: run as a one-run grid unless the folder has it."""
    from .ablation import run_ablation

    folder = run_ablation(dataclasses.replace(config, grid=grid_of([run])), progress=False)
    return folder.last_row(run.run_id)


def objective_values(row: dict[str, Any], space: SearchSpace) -> list[float]:
    values = []
    for column in space.objectives:
        value = row.get(column)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
            raise UsageError(f"run {row['run']} has no number in column {column!r} (got {value!r}): the "
                             "objective is not computed for this model or config")
        values.append(float(value))
    return values


def _run_spec(trial: Any) -> RunSpec:
    attrs = trial.user_attrs
    return RunSpec(attrs["strategy"], attrs["ratio"], attrs["options"])


def run_search(config: AblationConfig, space: SearchSpace, progress: bool = True, held_out: bool = True,
               evaluate: Callable[[Any, RunSpec], list[float] | None] | None = None,
               deadline: float | None = None, max_pruned: int = 0,
               first: Sequence[dict[str, Any]] = ()) -> SearchResult:
    """Runs (or resumes) the search; writes the front's table, figure and configs; re-scores the front on
    the held-out items when ``space.held_out`` is set and ``held_out``.

    ``evaluate(trial, run)`` (default: run the trial's run and read its objectives) returns the objective values,
    or ``None`` for a run outside the search's constraint (the trial is pruned: no value, not on the front). A pruned
    trial counts towards ``space.trials``, unless ``max_pruned`` > 0: then the budget counts completed trials and
    the search stops after ``max_pruned`` pruned ones. No trial starts after ``deadline`` (``time.monotonic()``).
    ``first``: Optuna parameters of trials to run before any sampled one (each once per study: a resumed search
    enqueues only those it has not run)."""
    import optuna
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend
    from optuna.trial import TrialState
    from tqdm import tqdm

    from ..generation.files import lock_folder, write_text_atomic

    out = Path(config.out_dir) / config.name / "search"
    out.mkdir(parents=True, exist_ok=True)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    with lock_folder(out, "tomerge search"):
        storage = JournalStorage(JournalFileBackend(str(out / "study.journal")))
        study = optuna.create_study(study_name=config.name, storage=storage, load_if_exists=True,
                                    directions=space.directions, sampler=_sampler(space))
        if [d.name.lower() for d in study.directions] != space.directions:
            raise UsageError(f"{out} holds a search with other objectives; use another name (--set name=...)")
        saved = study.user_attrs.get("population")
        if space.sampler == "nsga2" and saved is not None and saved != space.population:
            raise UsageError(f"{out} holds an nsga2 search with population {saved}, this config gives "
                             f"{space.population} (search.trials={space.trials}): --set search.population={saved} "
                             "to go on with it, or use another name (--set name=...)")
        if space.sampler == "nsga2" and saved is None:
            study.set_user_attr("population", space.population)
        for stopped in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            study.tell(stopped.number, state=TrialState.FAIL)  # stopped with its process: the same values again
            study.enqueue_trial(stopped.params, skip_if_exists=False)
        counted = (TrialState.COMPLETE,) if max_pruned else (TrialState.COMPLETE, TrialState.PRUNED)
        done = len(study.get_trials(deepcopy=False, states=counted))
        if done < space.trials:
            for params in first:
                study.enqueue_trial(dict(params), skip_if_exists=True)
        pruned = len(study.get_trials(deepcopy=False, states=(TrialState.PRUNED,)))
        bar = tqdm(desc=f"search {config.name}", disable=not progress, initial=min(done, space.trials),
                   total=space.trials)
        while done < space.trials and not (max_pruned and pruned >= max_pruned):
            if deadline is not None and time.monotonic() > deadline:
                break
            trial = study.ask()
            run = space.suggest(trial)
            for key, value in (("run", run.run_id), ("strategy", run.strategy), ("ratio", run.ratio),
                               ("options", run.options)):
                trial.set_user_attr(key, value)
            try:
                values = (evaluate(trial, run) if evaluate is not None
                          else objective_values(run_trial(config, run), space))
            except KeyboardInterrupt:
                raise  # left running: the next search runs it again
            except Exception:
                study.tell(trial, state=TrialState.FAIL)
                raise
            if values is None:
                study.tell(trial, state=TrialState.PRUNED)
                pruned += 1
            else:
                study.tell(trial, values)
            if values is not None or not max_pruned:
                done += 1
                bar.update()
        bar.close()
        completed = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
        trials = [(_run_spec(t), tuple(t.values)) for t in completed]
        front = list({(r := _run_spec(t)).run_id: r for t in study.best_trials}.values())
        summary = sampler_summary(study, space)
        write_front(study, space, config, front, out)
        write_text_atomic(out / "trials.md", trials_table(study, space, summary))
    front_rows = rows_of(config, front)
    held_out_rows = None
    if held_out and space.held_out:
        from .ablation import run_ablation

        folder = run_ablation(space.held_out_config(config, front), progress=progress)
        held_out_rows = [r for r in folder.rows if r["run"] != "baseline"]
    write_text_atomic(out / "front.md", f"{config.name}: {summary}\n\n"
                      + front_table(front, front_rows, held_out_rows, space))
    return SearchResult(out.parent, trials, front, front_rows, held_out_rows, summary)
