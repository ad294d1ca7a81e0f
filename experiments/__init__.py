"""The experiment layer: what `tomerge` runs, measures and draws. One stage per folder; a module imports only
from its own stage and the stages before it, and no module is longer than 450 lines, which
``tests/test_experiments_layout.py`` checks (docs/experiments.md, "Layout: which module owns what"):

=============== ==========================================================================================
``errors``      every user-facing error class and how the command line reports them
``plugins``     ``--plugin MODULE_OR_FILE`` and ``plugins:`` in a config: one-file strategies and backbones
``sources/``    what a run draws from: items (prompts or classes -> seeds), prompt sets, Fashion-MNIST, the
                reference DiT, its sampler and trainer, diffusers pipelines, local metric weights, the
                backbone coverage table
``config/``     the ablation config: schema (plain dataclasses), loading with ``--set`` overrides (it imports
                the ``plugins:`` the config names: its grid names their strategies), validation
``generation/`` images and videos for a list of items, in one process or with Lightning DDP; their files
                (written and read) and the pictures drawn from them
``measure/``    one timer, one FLOP counter, quality metrics and feature extractors, the one table of
                result columns (what each number is called and which way is better)
``runs/``       the run folder (written and read), and what fills run folders: the ablation and the search
``figures/``    plots and tables from run folders (reads ``runs/`` only, never runs a model)
``bench/``      kernel and end-to-end speed benchmarks, the GPU script
``commands/``   one thin file per ``tomerge`` subcommand: its arguments and its flow
``cli``         the ``tomerge`` entry point, wiring the commands together
=============== ==========================================================================================

Modules of a flat layout that moved into the stage folders fail to import with an error naming their new
spelling (:data:`MOVED_MODULES`); the four whose name is now a folder (``config``, ``sources``, ``figures``,
``bench``) answer their old names from the module that owns them.
"""

from __future__ import annotations

import importlib
import importlib.abc
import sys
from collections.abc import Callable
from typing import Any

# Old module (tomerge.experiments.NAME) -> its spelling now, under tomerge.experiments.
MOVED_MODULES = {
    "ablate": "runs.ablation", "columns": "measure.columns", "records": "runs.records", "search": "runs.search",
    "bench_e2e": "bench.e2e", "allocator": "bench.allocator",
    "coverage": "sources.coverage", "data": "sources.data", "prompt_sets": "sources.prompt_sets",
    "sampling": "sources.sampling", "train_reference": "sources.training",
    "files": "generation.files", "generate": "generation.generate",
    "flops": "measure.flops", "timing": "measure.timing", "metrics": "measure.metrics",
    "pareto": "figures.pareto",
    "bench.__main__": "commands.bench", "figures.__main__": "commands.figures",  # python -m ...bench, ...figures
}
# Old modules that were also commands (python -m tomerge.experiments.NAME) -> their file in commands/.
MOVED_COMMANDS = {"ablate": "ablate", "generate": "generate", "search": "search", "train_reference": "train_reference"}
# Old modules whose names went elsewhere: what the error says.
MOVED_NOTES = {
    "speed": "tomerge.experiments.measure.timing: NOISY_SPREAD, Timing, DenoiserProbe and median_and_spread keep "
             "their names, time_alternating(call, merging, denoiser, warmup, repeats) is time_baseline_and_merged",
}


class _MovedModules(importlib.abc.MetaPathFinder):
    """Answers an import of a moved module with a ``ModuleNotFoundError`` naming its new spelling. It is asked
    last (after the finders that find what exists), so it never hides a module."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> None:
        if not fullname.startswith(f"{__name__}."):
            return None
        old = fullname.removeprefix(f"{__name__}.")
        if old in MOVED_NOTES:
            raise ModuleNotFoundError(f"{fullname} is {MOVED_NOTES[old]}", name=fullname)
        if old in MOVED_MODULES:
            new = f"{__name__}.{MOVED_MODULES[old]}"
            command = f" (its command line: python -m {__name__}.commands.{MOVED_COMMANDS[old]})" \
                if old in MOVED_COMMANDS else ""
            raise ModuleNotFoundError(f"{fullname} is {new}{command}", name=fullname)
        return None


if not any(isinstance(finder, _MovedModules) for finder in sys.meta_path):
    sys.meta_path.append(_MovedModules())


def new_spelling(name: str, owner: str) -> str:
    """``name`` in its owner, relative to this package: ``owner.name``, or ``owner.new_name`` for an owner given
    as ``"owner:new_name"``."""
    owner, _, renamed = owner.partition(":")
    return f"{owner}.{renamed or name}"


def moved_names(module: str, moved: dict[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for the names that left ``module``: ``moved`` maps each to the module that owns
    it now (under ``tomerge.experiments``; ``"module:new_name"`` where it was renamed too), and asking
    ``module`` for one raises an ``AttributeError`` naming its new spelling.

    Example (in ``measure/metrics.py``)::

        __getattr__ = moved_names(__name__, {"load_video": "generation.files"})
    """

    def __getattr__(name: str) -> Any:
        if name in moved:
            raise AttributeError(f"{module}.{name} is {__name__}.{new_spelling(name, moved[name])}", name=name)
        raise AttributeError(f"module {module!r} has no attribute {name!r}", name=name)

    __getattr__.moved = moved  # type: ignore[attr-defined]  # read by forward_names
    return __getattr__


def forward_names(package: str, *modules: str) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package``, a folder that was a module: the names of the old module are
    answered from ``modules`` (their owners now, asked in order), imported when first asked; a name that left
    them (:func:`moved_names`) raises an ``AttributeError`` naming its new spelling."""

    def __getattr__(name: str) -> Any:
        if not name.startswith("__"):
            owners = [vars(importlib.import_module(module)) for module in modules]
            for owner in owners:
                if name in owner:
                    return owner[name]
            for owner in owners:
                moved = getattr(owner.get("__getattr__"), "moved", {})
                if name in moved:
                    raise AttributeError(f"{package}.{name} is {__name__}.{new_spelling(name, moved[name])}",
                                         name=name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}", name=name)

    return __getattr__
