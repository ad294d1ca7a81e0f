"""A recipe: one registered strategy or schedule with its ratio and flat options, as a config's one-run grid
writes it (``tomerge tune``'s ``recipe.yaml``, which ``tomerge ablate`` and ``tomerge generate`` also read);
``tomerge.apply(pipe, recipe)`` attaches it."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any


@dataclasses.dataclass(frozen=True)
class Recipe:
    """``strategy`` (a registered name) at ``ratio`` with ``options`` (a grid entry's flat options: the strategy's
    or schedule's, the adapter's and the state's, sorted by :func:`tomerge.attach.apply_arguments`)."""

    strategy: str
    ratio: float
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def load(cls, path: str | Path) -> Recipe:
        """The recipe of a YAML config whose ``grid:`` is one entry with one ratio (e.g. ``recipe.yaml``).

        Raises:
            ValueError: the file's grid is not exactly one run.
        """
        import yaml  # PyYAML comes with diffusers (huggingface_hub)

        raw = yaml.safe_load(Path(path).read_text()) or {}
        grid = raw.get("grid") if isinstance(raw, dict) else None
        entry = grid[0] if isinstance(grid, list) and len(grid) == 1 and isinstance(grid[0], dict) else {}
        ratios = entry.get("ratios")
        if not (isinstance(entry.get("strategy"), str) and isinstance(ratios, list) and len(ratios) == 1):
            raise ValueError(f"{path}: a recipe is a config whose grid: is one entry {{strategy, ratios: [one ratio], "
                             f"options}}, got grid: {grid!r}")
        return cls(entry["strategy"], float(ratios[0]), dict(entry.get("options") or {}))
