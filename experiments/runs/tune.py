"""``tomerge tune`` and ``tomerge.tune``: the best recipe of a search space that reaches a target speed-up.

The search underneath is ``tomerge search`` (one objective: the quality loss the user picks), restricted to the
runs that reach the target: by FLOPs, a merging entry's ratio is the one its FLOP-ideal speed-up reaches the
target at (counted before any image) and a run that cannot reach it is pruned unrun; by time, a run is measured
and pruned when its median speed-up stays below. Each entry's strategy at its own defaults (where the space holds
them) is tried before any sampled run, so on the objective a recipe is never behind a published default its space
contains. The chosen recipe is written as ``recipe.yaml`` and verified on the held-out items with intervals.
Keys, outputs and what ``auto`` chooses: docs/experiments.md, "3c. Tune".
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tomerge.recipe import Recipe

from ..config.grid import valid_ratios
from ..config.load import load_config_sections
from ..config.schema import AblationConfig, ConfigError, RunSpec
from ..errors import UsageError, did_you_mean
from .records import BETTER
from .search import objective_values, run_search, run_trial
from .search_space import SearchSpace

__all__ = ["TuneSpec", "TuneResult", "load_tune", "run_tune"]

TUNE_KEYS = ("target", "by", "objective", "minutes")
BY = ("auto", "flops", "time")
PRUNED_PER_TRIAL = 10  # by FLOPs: the search gives up after this many pruned trials per trial of the budget
REACHED = 0.995  # a FLOP-ideal speed-up within 0.5% of the target reaches it (the ratio moves in token steps)
AUTO_FLOPS = ("no CUDA device: timings on a CPU vary by 5-40% between repeats (docs/claims.md), too much to "
              "resolve a target, so the target is the FLOP-ideal speed-up")


@dataclasses.dataclass(frozen=True)
class TuneSpec:
    """The parsed ``tune:`` section: the ``target`` speed-up, measured ``by`` FLOPs or time, the quality column to
    optimise (``objective``), the budget in ``minutes`` (``None``: the search's trials only) and why ``by`` was
    chosen when the config said ``auto``."""

    target: float
    by: str
    objective: str
    minutes: float | None = None
    why: str = ""

    @classmethod
    def parse(cls, raw: Any, cuda: bool | None = None) -> TuneSpec:
        """Checks the section (every problem at once, :class:`ConfigError`); ``auto`` becomes ``time`` with a
        CUDA device (``cuda``; default: ``torch.cuda.is_available()``), ``flops`` otherwise."""
        if not isinstance(raw, dict):
            raise ConfigError([f"the config needs a tune: section (a mapping of {', '.join(TUNE_KEYS)}), got {raw!r}"])
        problems = [f"unknown key 'tune.{k}'{did_you_mean(str(k), TUNE_KEYS) or f'; valid: {TUNE_KEYS}'}"
                    for k in raw if k not in TUNE_KEYS]
        target, by = raw.get("target"), raw.get("by", "auto")
        objective, minutes = raw.get("objective", "fd_effnetlite0"), raw.get("minutes")
        if isinstance(target, bool) or not isinstance(target, (int, float)) or not math.isfinite(target) \
                or target <= 1:
            problems.append(f"tune.target is a speed-up > 1 (e.g. 2 for 2x), got {target!r}")
        if by not in BY:
            problems.append(f"tune.by must be one of {BY}, got {by!r}")
        if objective not in BETTER or objective in ("flops", "speedup", "flop_speedup"):
            hint = "" if objective in BETTER else did_you_mean(str(objective), BETTER)
            problems.append(f"tune.objective must be a quality column (e.g. fd_effnetlite0, psnr), got {objective!r}"
                            f"{hint}")
        if minutes is not None and (isinstance(minutes, bool) or not isinstance(minutes, (int, float))
                                    or minutes <= 0):
            problems.append(f"tune.minutes must be a number > 0, got {minutes!r}")
        if problems:
            raise ConfigError(problems)
        why = ""
        if by == "auto":
            if cuda is None:
                import torch

                cuda = torch.cuda.is_available()
            by, why = ("time", "a CUDA device: the target is the measured speed-up") if cuda else ("flops", AUTO_FLOPS)
        return cls(float(target), by, objective, None if minutes is None else float(minutes), why)

    @property
    def speedup_column(self) -> str:
        return "flop_speedup" if self.by == "flops" else "speedup"


@dataclasses.dataclass
class TuneResult:
    """The chosen ``recipe``, its row in the search (``row``) and on the held-out items (``held_out_row``, with
    intervals; ``None`` without ``search.held_out``), the rows of every run that reached the target (``reached``),
    and where the outputs are (``folder / "tune"``)."""

    recipe: Recipe
    row: dict[str, Any]
    held_out_row: dict[str, Any] | None
    reached: list[dict[str, Any]]
    folder: Path
    spec: TuneSpec


def load_tune(path: str | Path, overrides: Sequence[str] = (), plugins: Sequence[str] | None = None,
              cuda: bool | None = None) -> tuple[AblationConfig, SearchSpace, TuneSpec]:
    """The ablation config, the search space (one objective: ``tune.objective``; sampler ``tpe`` unless the
    config names one) and the ``tune:`` section of a tune config; every problem before any image."""
    config, sections = load_config_sections(path, list(overrides), plugins=list(plugins or []), check_inputs=True,
                                            sections=("search", "tune"))
    problems = ["a tune config has no grid: (the search chooses the runs); remove it"] if config.grid else []
    search = sections.get("search")
    if isinstance(search, dict) and "objectives" in search:
        problems.append("a tune config's search: has no objectives: tune.objective is the one objective")
    try:
        spec = TuneSpec.parse(sections.get("tune"), cuda)
    except ConfigError as err:
        raise ConfigError(problems + err.problems) from None
    if problems:
        raise ConfigError(problems)
    raw = {"sampler": "tpe", **(search if isinstance(search, dict) else {}), "objectives": [spec.objective]}
    space = SearchSpace.parse(raw if isinstance(search, dict) else search, config)
    return config, space, spec


class _Reach:
    """Resolves a trial's run to the target by FLOPs, before any image: a run whose ratio the space searches gets
    the smallest ratio of its range whose FLOP-ideal speed-up reaches the target; a run of fixed ratio (a step
    cache alone) keeps it. ``None``: the run cannot reach the target. The model is loaded for each trial and
    released before its images (the ablation loads its own); the unmerged FLOPs are counted once."""

    def __init__(self, config: AblationConfig, space: SearchSpace, target: float) -> None:
        self.config, self.space, self.target = config, space, target
        self.base: float | None = None
        self.fastest: tuple[float, str] = (0.0, "")  # the fastest run counted, for the error of an unreached target

    def __call__(self, trial: Any, run: RunSpec) -> RunSpec | None:
        from .ablation import FlopSpeedups

        entry = self.space.entries[int(str(trial.params["entry"]).split(":")[0])]
        speedups = FlopSpeedups(self.config.model.load(), self.config, self.config.items()[:1], base=self.base)
        self.base = speedups.base

        def count(ratio: float) -> float:
            speedup = speedups(run, ratio)
            if speedup > self.fastest[0]:
                self.fastest = (speedup, dataclasses.replace(run, ratio=ratio).run_id)
            return speedup

        if entry.ratio.kind == "fixed":
            return run if count(run.ratio) >= self.target * REACHED else None
        lo, hi = valid_ratios(run.strategy, run.options)
        lo, hi = max(lo, min(entry.ratio.values)), min(hi, max(entry.ratio.values))
        at_lo, at_hi = count(lo), count(hi)
        if at_hi < self.target * REACHED:
            return None
        if at_lo >= self.target * REACHED:  # as a fixed entry: no tokens merged for the last 0.5%
            return dataclasses.replace(run, ratio=lo)
        return dataclasses.replace(run, ratio=speedups.bisect(run, self.target, lo, hi, at_lo, at_hi, reach=True))


def run_tune(config: AblationConfig, space: SearchSpace, spec: TuneSpec, progress: bool = True,
             held_out: bool = True) -> TuneResult:
    """Runs (or resumes) the tune; writes ``<folder>/tune/``: ``recipe.yaml`` and ``front.md`` (the figure:
    :func:`tomerge.experiments.commands.tune.write_figure`).

    Raises:
        UsageError: no run of the space reached the target (naming the fastest one found).
    """
    import yaml

    from ..generation.files import write_text_atomic
    from .search_output import grid_of, rows_of

    reach = _Reach(config, space, spec.target) if spec.by == "flops" else None
    measured: list[tuple[float, str]] = []  # by time: each run's speed-up, for the error of an unreached target

    def evaluate(trial: Any, run: RunSpec) -> list[float] | None:
        if reach is not None:
            resolved = reach(trial, run)
            if resolved is None:
                return None
            trial.set_user_attr("run", resolved.run_id)
            trial.set_user_attr("ratio", resolved.ratio)
            run = resolved
        row = run_trial(config, run)
        if reach is None:
            speedup = row.get(spec.speedup_column) or 0.0
            measured.append((speedup, run.run_id))
            if not speedup >= spec.target:
                return None
        return objective_values(row, space)

    deadline = None if spec.minutes is None else time.monotonic() + 60 * spec.minutes
    # by FLOPs a pruned trial costs counts, not images: the budget counts the trials that reached the target
    max_pruned = PRUNED_PER_TRIAL * space.trials if reach is not None else 0
    search = run_search(config, space, progress=progress, held_out=False, evaluate=evaluate, deadline=deadline,
                        max_pruned=max_pruned, first=space.default_trials())
    folder = search.folder
    reached_runs = list({run.run_id: run for run, _ in search.trials}.values())
    if not reached_runs:
        best = reach.fastest if reach is not None else max(measured, default=(0.0, ""))
        found = f"the fastest found: {best[1]} at {best[0]:.2f}x" if best[1] else "no run was measured"
        raise UsageError(f"no recipe of the space reached {spec.target:g}x ({spec.speedup_column}) in "
                         f"{len(search.trials)} completed trials; {found}. Lower tune.target or widen search.space")
    rows = rows_of(config, reached_runs)
    sign = 1 if BETTER[spec.objective] == "lower" else -1
    best_row = min(rows, key=lambda r: sign * r[spec.objective])
    recipe = Recipe(best_row["strategy"], float(best_row["ratio"]), dict(best_row["options"]))
    best_run = RunSpec(recipe.strategy, recipe.ratio, dict(recipe.options))
    held_out_row = None
    if held_out and space.held_out:
        from .ablation import run_ablation

        verify = run_ablation(space.held_out_config(config, [best_run]), progress=progress)
        held_out_row = verify.last_row(best_run.run_id)
    out = folder / "tune"
    out.mkdir(parents=True, exist_ok=True)
    recipe_config = dataclasses.replace(config, name=f"{config.name}_recipe", grid=grid_of([best_run]))
    write_text_atomic(out / "recipe.yaml", yaml.safe_dump(
        {**recipe_config.to_dict(), "model": recipe_config.model.to_config()}, sort_keys=False))
    write_text_atomic(out / "front.md", _report(spec, search.sampler, recipe, best_row, held_out_row, rows))
    return TuneResult(recipe, best_row, held_out_row, rows, folder, spec)


def _report(spec: TuneSpec, sampler: str, recipe: Recipe, row: dict[str, Any], held_out_row: dict[str, Any] | None,
            rows: list[dict[str, Any]]) -> str:
    from .records import format_with_interval

    columns = [spec.speedup_column, spec.objective, "psnr", "fd_effnetlite0"]
    columns = list(dict.fromkeys(c for c in columns if any(c in r for r in rows)))
    head = "| run | " + " | ".join(columns) + " |\n|---|" + "---:|" * len(columns) + "\n"
    line = lambda r, name: f"| {name} | " + " | ".join(format_with_interval(r, c) for c in columns) + " |\n"  # noqa
    sign = 1 if BETTER[spec.objective] == "lower" else -1
    text = (f"target {spec.target:g}x by {spec.by}{f' ({spec.why})' if spec.why else ''}; objective "
            f"{spec.objective}; {sampler}\n\nrecipe: {recipe.strategy} ratio {recipe.ratio:g} options "
            f"{dict(recipe.options)}\n\n" + head + line(row, f"**{row['run']}** (search)"))
    if held_out_row is not None:
        text += line(held_out_row, f"**{row['run']}** (held out)")
    text += f"\nEvery run that reached the target ({len(rows)}), best first:\n\n" + head
    for r in sorted(rows, key=lambda r: sign * r[spec.objective]):
        text += line(r, r["run"])
    return text
