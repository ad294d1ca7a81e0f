"""The space of ``tomerge search`` and ``tomerge tune``: the ``search:`` section parsed and checked (trials, sampler,
objectives, the strategies, ratios and options searched, held-out items) and how a trial draws a run from it
(:mod:`~tomerge.experiments.runs.search` runs the loop). The section's keys: docs/experiments.md, "3b. Search"."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from ..errors import did_you_mean
from ..config.grid import entry_problems
from ..config.help import dataclass_defaults
from ..config.schema import AblationConfig, ConfigError, RunSpec
from .records import BETTER
from .search_output import SAMPLER_NAMES, generations_text, grid_of

__all__ = ["SearchSpace", "SpaceEntry", "Dimension", "nsga2_population", "SAMPLERS"]

SAMPLERS = ("nsga2", "tpe", "random")
SEARCH_KEYS = ("trials", "sampler", "population", "seed", "objectives", "space", "held_out")
ENTRY_KEYS = ("strategy", "ratio", "options")
HELD_OUT_KEYS = ("seed", "classes", "per_class", "prompts", "num_prompts", "prompt_offset", "images_per_prompt")
RATIO_STEP = 0.01  # ratios are searched on this grid, so run ids stay short and repeats reuse a run
NSGA2_GENERATIONS = 5  # NSGA-II's default population is the budget over this, so a budget runs ~5 generations
NSGA2_MIN_POPULATION = 8  # a smaller population crosses too few parents to explore a space of many entries
NSGA2_MAX_POPULATION = 50  # Optuna's default: a larger budget runs more generations, not a larger population


def nsga2_population(trials: int) -> int:
    """NSGA-II's population for a budget of ``trials``: ``trials // 5`` within [8, 50], so a budget runs
    about five generations (generation 0 is random draws; each later one is bred from the best so far).

    Example:
        >>> [nsga2_population(t) for t in (10, 40, 60, 100, 400)]
        [8, 8, 12, 20, 50]
    """
    return min(NSGA2_MAX_POPULATION, max(NSGA2_MIN_POPULATION, trials // NSGA2_GENERATIONS))


# ------------------------------------------------------------------------------------------ the space
@dataclasses.dataclass(frozen=True)
class Dimension:
    """One searched value: ``fixed`` (``values[0]``), ``choice`` (one of ``values``), or an ``int`` /
    ``float`` range ``values = (low, high)`` (``step``: its grid; ``log``: sampled log-uniformly)."""

    kind: str
    values: tuple[Any, ...]
    step: float | None = None
    log: bool = False

    @classmethod
    def parse(cls, value: Any, where: str, default_step: float | None = None) -> tuple[Dimension | None, list[str]]:
        """A YAML value: a list is a choice, a mapping with ``low`` or ``high`` (and ``step``, ``log``) a range,
        anything else (a scalar, another mapping such as ``merge_options``) is fixed."""
        if isinstance(value, list):
            if not value:
                return None, [f"{where}: an empty list of choices"]
            return cls("choice", tuple(value)), []
        if not isinstance(value, dict) or not {"low", "high"} & set(value):
            return cls("fixed", (value,)), []
        unknown = [k for k in value if k not in ("low", "high", "step", "log")]
        problems = [f"{where}: unknown range key {k!r}; a range is {{low, high, step, log}}" for k in unknown]
        low, high, step, log = value.get("low"), value.get("high"), value.get("step", default_step), value.get("log", False)
        numbers = [v for v in (low, high, step) if v is not None]
        if low is None or high is None or any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in numbers):
            return None, [*problems, f"{where}: a range needs numbers low and high (and step), got {value!r}"]
        if not low <= high:
            problems.append(f"{where}: low {low} is above high {high}")
        if step is not None and step <= 0:
            problems.append(f"{where}: step must be > 0, got {step}")
        if not isinstance(log, bool) or (log and low <= 0):
            problems.append(f"{where}: log must be true or false, and needs low > 0")
        kind = "int" if all(isinstance(v, int) for v in numbers) else "float"
        return (None if problems else cls(kind, (low, high), step, log)), problems

    def corners(self) -> list[Any]:
        """The values whose validity stands for all: every choice, both ends of a range."""
        return list(self.values)

    def param_of(self, value: Any) -> Any:
        """The Optuna parameter that suggests ``value`` (a choice's index, a range's value), or
        ``dataclasses.MISSING`` when the dimension does not hold it."""
        if self.kind == "choice":  # True is not 1
            found = [i for i, v in enumerate(self.values) if type(v) is type(value) and v == value]
            return found[0] if found else dataclasses.MISSING
        if self.kind in ("int", "float") and not isinstance(value, bool) and isinstance(value, (int, float)) \
                and self.values[0] <= value <= self.values[1] and (self.kind == "float" or value == int(value)):
            return value
        return dataclasses.MISSING

    def suggest(self, trial: Any, name: str) -> Any:
        """This dimension's value in an Optuna ``trial`` (parameter ``name``)."""
        if self.kind == "fixed":
            return self.values[0]
        if self.kind == "choice":  # by index: Optuna's categorical values must be plain scalars
            return self.values[trial.suggest_categorical(name, list(range(len(self.values))))]
        low, high = self.values
        if self.kind == "int":
            return trial.suggest_int(name, low, high, step=int(self.step or 1), log=self.log)
        value = trial.suggest_float(name, low, high, step=None if self.log else self.step, log=self.log)
        return round(value, 6) if self.step else value  # 0.35000000000000003 -> 0.35 in run ids


@dataclasses.dataclass(frozen=True)
class SpaceEntry:
    """One strategy or schedule of the space: its ratio and options as :class:`Dimension` s."""

    strategy: str
    ratio: Dimension
    options: tuple[tuple[str, Dimension], ...]

    def grid_entries(self) -> list[dict[str, Any]]:
        """Grid entries covering every choice and range end (each option varied alone, the others at their
        first value): what the ablation's checks validate before any image."""
        first = {name: dim.corners()[0] for name, dim in self.options}
        variants = [first] + [{**first, name: value} for name, dim in self.options for value in dim.corners()[1:]]
        return [{"strategy": self.strategy, "ratios": self.ratio.corners(), "options": options} for options in variants]

    def suggest(self, trial: Any, prefix: str) -> RunSpec:
        ratio = float(self.ratio.suggest(trial, f"{prefix}.ratio"))
        options = {name: dim.suggest(trial, f"{prefix}.{name}") for name, dim in self.options}
        return RunSpec(self.strategy, ratio, options)


@dataclasses.dataclass(frozen=True)
class SearchSpace:
    """The parsed ``search:`` section (see the module docstring)."""

    trials: int
    sampler: str
    seed: int
    objectives: tuple[str, ...]
    entries: tuple[SpaceEntry, ...]
    held_out: dict[str, Any]
    population: int | None = None  # NSGA-II's population (None for tpe and random)

    @property
    def warning(self) -> str | None:
        """One line when the budget runs fewer than two NSGA-II generations (the front would be random
        draws), else ``None``."""
        if self.sampler != "nsga2" or self.trials >= 2 * self.population:
            return None
        return (f"search.trials={self.trials} with nsga2's population of {self.population} runs "
                f"{self.trials // self.population} full generation(s): the front is random draws, not evolved; "
                f"give search.trials >= {2 * self.population} (about {NSGA2_GENERATIONS} generations: "
                f"{NSGA2_GENERATIONS * self.population}) or search.sampler: tpe")

    def plan(self) -> str:
        """The sampler and what the budget will run, in words (before any trial)."""
        if self.sampler != "nsga2":
            return f"{SAMPLER_NAMES[self.sampler]}, {self.trials} trials"
        return (f"{SAMPLER_NAMES['nsga2']}, population {self.population}, {self.trials} trials: "
                f"{generations_text(self.trials, self.population)}")

    @property
    def directions(self) -> list[str]:
        return ["minimize" if BETTER[c] == "lower" else "maximize" for c in self.objectives]

    @classmethod
    def parse(cls, raw: Any, config: AblationConfig) -> SearchSpace:
        """Checks the whole section against ``config`` (strategies, options and ratios as ``tomerge ablate``
        checks its grid; objectives the run computes; held-out items that differ from the searched ones)
        and raises one :class:`ConfigError` listing every problem."""
        if not isinstance(raw, dict):
            raise ConfigError([f"the config needs a search: section (a mapping of {', '.join(SEARCH_KEYS)}), "
                               f"got {raw!r}"])
        problems = [f"unknown key 'search.{k}'{did_you_mean(str(k), SEARCH_KEYS) or f'; valid: {SEARCH_KEYS}'}"
                    for k in raw if k not in SEARCH_KEYS]
        trials, sampler, seed = raw.get("trials", 20), raw.get("sampler", "nsga2"), raw.get("seed", 0)
        population = raw.get("population")
        if isinstance(trials, bool) or not isinstance(trials, int) or trials < 1:
            problems.append(f"search.trials must be an integer >= 1, got {trials!r}")
        if population is not None and sampler != "nsga2":
            problems.append(f"search.population is NSGA-II's (sampler: nsga2); sampler {sampler!r} has none")
        elif population is not None and (isinstance(population, bool) or not isinstance(population, int)
                                         or population < 2):
            problems.append(f"search.population must be an integer >= 2, got {population!r}")
        elif sampler == "nsga2" and population is None and not problems:
            population = nsga2_population(trials)
        if sampler not in SAMPLERS:
            problems.append(f"search.sampler must be one of {SAMPLERS}, got {sampler!r}{did_you_mean(str(sampler), SAMPLERS)}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            problems.append(f"search.seed must be an integer, got {seed!r}")
        objectives = raw.get("objectives", ["flops", "fd_effnetlite0"])
        if not isinstance(objectives, list) or not objectives:
            problems.append(f"search.objectives must be a non-empty list of result columns, got {objectives!r}")
            objectives = []
        for name in objectives:
            if name not in BETTER:
                problems.append(f"search.objectives: {name!r} is not a numeric result column"
                                f"{did_you_mean(str(name), BETTER) or f'; valid: {sorted(BETTER)}'}")
        problems += _objective_inputs([o for o in objectives if o in BETTER], config)
        if len(set(objectives)) != len(objectives):
            problems.append(f"search.objectives repeats a column: {objectives}")
        entries = []
        space = raw.get("space")
        if not isinstance(space, list) or not space:
            problems.append("search.space must be a non-empty list of {strategy, ratio, options} entries")
            space = []
        backbones = ["native_dit"] if config.model.kind == "reference" else None
        for i, item in enumerate(space):
            entry, entry_problems_ = _parse_entry(i, item, backbones)
            problems += entry_problems_
            if entry is not None:
                entries.append(entry)
        held_out = raw.get("held_out") or {}
        problems += _held_out_problems(held_out, config)
        if problems:
            raise ConfigError(problems)
        return cls(trials, sampler, seed, tuple(objectives), tuple(entries), dict(held_out),
                   population if sampler == "nsga2" else None)

    def suggest(self, trial: Any) -> RunSpec:
        """The run of one trial: which entry, then its ratio and options (named per entry). NSGA-II draws every
        entry's and uses the chosen one's: it breeds only what every trial has, and draws the rest at random."""
        labels = [f"{i}:{e.strategy}" for i, e in enumerate(self.entries)]
        label = trial.suggest_categorical("entry", labels)
        if self.sampler == "nsga2":
            runs = [entry.suggest(trial, other) for entry, other in zip(self.entries, labels)]
            return runs[labels.index(label)]
        return self.entries[labels.index(label)].suggest(trial, label)

    def default_trials(self) -> list[dict[str, Any]]:
        """Optuna parameters of the trials that run each entry's strategy at its own defaults (the dataclass
        defaults: the authors' settings), one per entry whose every searched option holds its default; an entry's
        fixed values stay, a searched ratio is left to the sampler (a tune by FLOPs resolves it to the target).

        Example:
            >>> space = SearchSpace(1, "tpe", 0, ("psnr",), (SpaceEntry("fora", Dimension("fixed", (0.0,)),
            ...     (("interval", Dimension("choice", (2, 3, 4))),)),), {})
            >>> space.default_trials()
            [{'entry': '0:fora', '0:fora.interval': 1}]
        """
        from tomerge.registry import strategy_class

        trials = []
        for i, entry in enumerate(self.entries):
            label = f"{i}:{entry.strategy}"
            defaults = dataclass_defaults(strategy_class(entry.strategy))
            params = {f"{label}.{name}": dim.param_of(defaults.get(name, dataclasses.MISSING))
                      for name, dim in entry.options if dim.kind != "fixed"}
            if dataclasses.MISSING not in params.values():
                trials.append({"entry": label, **params})
        return trials

    def held_out_config(self, config: AblationConfig, runs: Sequence[RunSpec]) -> AblationConfig:
        return dataclasses.replace(config, name=f"{config.name}_held_out", grid=grid_of(runs), **self.held_out)


def _parse_entry(i: int, item: Any, backbones: list[str] | None) -> tuple[SpaceEntry | None, list[str]]:
    where = f"search.space[{i}]"
    if not isinstance(item, dict) or "strategy" not in item:
        return None, [f"{where}: entries are {{strategy, ratio, options}}, got {item!r}"]
    problems = [f"{where}: unknown key {k!r}{did_you_mean(str(k), ENTRY_KEYS) or f'; valid: {ENTRY_KEYS}'}"
                for k in item if k not in ENTRY_KEYS]
    ratio, ratio_problems = Dimension.parse(item.get("ratio", 0.5), f"{where}.ratio", default_step=RATIO_STEP)
    problems += ratio_problems
    options_raw = item.get("options") or {}
    if not isinstance(options_raw, dict):
        return None, [*problems, f"{where}.options must be a mapping {{option: value, list or range}}"]
    options = []
    for name, value in options_raw.items():
        dim, dim_problems = Dimension.parse(value, f"{where}.options.{name}")
        problems += dim_problems
        if dim is not None:
            options.append((name, dim))
    if problems or ratio is None:
        return None, problems
    entry = SpaceEntry(item["strategy"], ratio, tuple(options))
    for grid_entry in entry.grid_entries():  # the ablation's own checks, at every choice and range end
        for problem in entry_problems(i, grid_entry, backbones, prefix="search.space"):
            if problem not in problems:
                problems.append(problem)
    return (None if problems else entry), problems


def _objective_inputs(objectives: Sequence[str], config: AblationConfig) -> list[str]:
    """Objectives whose metric the run would not compute (the row would lack the column)."""
    m, needs = config.metrics, []
    if "clip_score" in objectives and m.clip_model is None:
        needs.append("search.objectives: clip_score needs metrics.clip_model")
    if "dino_dist" in objectives and m.dino_model is None:
        needs.append("search.objectives: dino_dist needs metrics.dino_model")
    if "fid" in objectives and (m.fid_weights is None or m.reference_images is None):
        needs.append("search.objectives: fid needs metrics.fid_weights and metrics.reference_images")
    if "fd_effnetlite0_ref" in objectives and m.reference_images is None and not (
            config.model.kind == "reference" and config.fd_reference_images):
        needs.append("search.objectives: fd_effnetlite0_ref needs metrics.reference_images (or the reference "
                     "model's fd_reference_images > 0)")
    return needs


def _held_out_problems(held_out: Any, config: AblationConfig) -> list[str]:
    if not isinstance(held_out, dict):
        return [f"search.held_out must be a mapping of item keys ({', '.join(HELD_OUT_KEYS)}), got {held_out!r}"]
    problems = [f"search.held_out: {k!r} is not an item key{did_you_mean(str(k), HELD_OUT_KEYS) or f'; valid: {HELD_OUT_KEYS}'}"
                for k in held_out if k not in HELD_OUT_KEYS]
    if problems or not held_out:
        return problems
    values = {k: tuple(v) if isinstance(v, list) else v for k, v in held_out.items()}
    try:
        other = dataclasses.replace(config, name=f"{config.name}_held_out", **values)
        searched = {(i.seed, i.label, i.prompt) for i in config.items()}
        shared = [i for i in other.items() if (i.seed, i.label, i.prompt) in searched]
    except (ConfigError, ValueError) as err:
        return [f"search.held_out: {p}" for p in getattr(err, "problems", [str(err)])]
    if shared:
        problems.append(f"search.held_out: {len(shared)} held-out item(s) are searched items too (same seed and "
                        f"class/prompt, e.g. seed {shared[0].seed}): give other seeds (e.g. seed: "
                        f"{config.seed + 10_000}) or other classes/prompts")
    return problems
