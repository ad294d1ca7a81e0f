"""tomerge: training-free token merging for diffusion transformers.

Import cost is small: nothing is imported here until it is first used (``tomerge.apply`` imports
torch and the core; ``tomerge.list_strategies()`` reads entry points only, without torch), and no
strategy, backbone, diffusers or timm is imported before a strategy or backbone is looked up.

Example:
    >>> import torch, tomerge
    >>> x = torch.randn(2, 64, 32)                                   # [B, N, C] image tokens
    >>> ctx = tomerge.MergeContext(grid=(8, 8), ratio=0.5)
    >>> plan = tomerge.get_strategy("ssm", round_windows=1).plan(x, ctx)
    >>> plan.merge(x).shape[1] == 64 - plan.num_removed
    True
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Public name -> the submodule defining it, imported on first access (PEP 562), so that `import
# tomerge` (and the `tomerge` command's start-up, whose package is tomerge.experiments) costs no torch.
_EXPORTS = {
    "apply": "attach", "remove": "attach", "merging": "attach", "MergeHandle": "attach",
    "MergeContext": "context", "MergePlan": "plan", "MergeStrategy": "strategy",
    "Schedule": "schedule", "Constant": "schedule", "Decision": "schedule", "Where": "schedule",
    "get_strategy": "registry", "list_strategies": "registry", "register_strategy": "registry",
    "list_backbones": "registry", "register_backbone": "registry", "Recipe": "recipe",
    "tune": "experiments.commands.tune",
}
_SUBMODULES = ("adapter", "attach", "block_cache", "context", "contract", "feature_cache", "plan", "probe", "recipe",
               "registry", "schedule", "state", "strategy", "streaks", "technique", "text_bias", "strategies",
               "backbones", "experiments")

__all__ = [
    "apply", "remove", "merging", "MergeHandle",
    "MergeContext", "MergePlan", "MergeStrategy", "Schedule", "Constant", "Decision", "Where",
    "get_strategy", "list_strategies", "register_strategy", "list_backbones", "register_backbone", "Recipe", "tune",
]
__version__ = "0.1.0"

if TYPE_CHECKING:  # what the lazy names are, for type checkers and IDEs
    from .attach import MergeHandle, apply, merging, remove
    from .context import MergeContext
    from .experiments.commands.tune import tune
    from .plan import MergePlan
    from .recipe import Recipe
    from .registry import get_strategy, list_backbones, list_strategies, register_backbone, register_strategy
    from .schedule import Constant, Decision, Schedule, Where
    from .strategy import MergeStrategy


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
        globals()[name] = value  # later lookups are plain attribute reads
        return value
    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS, *_SUBMODULES})
