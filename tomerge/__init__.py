"""tomerge: training-free token merging for diffusion transformers.

Import cost is small: no strategy, backbone, diffusers or timm is imported here.

Example:
    >>> import torch, tomerge
    >>> x = torch.randn(2, 64, 32)                                   # [B, N, C] image tokens
    >>> ctx = tomerge.MergeContext(grid=(8, 8), ratio=0.5)
    >>> plan = tomerge.get_strategy("ssm", round_windows=1).plan(x, ctx)
    >>> plan.merge(x).shape[1] == 64 - plan.num_removed
    True
"""

from .attach import MergeHandle, apply, merging, remove
from .context import MergeContext
from .plan import MergePlan
from .registry import get_strategy, list_backbones, list_strategies, register_backbone, register_strategy
from .schedule import Constant, Decision, Schedule, Where
from .strategy import MergeStrategy

__all__ = [
    "apply", "remove", "merging", "MergeHandle",
    "MergeContext", "MergePlan", "MergeStrategy", "Schedule", "Constant", "Decision", "Where",
    "get_strategy", "list_strategies", "register_strategy", "list_backbones", "register_backbone",
]
__version__ = "0.1.0"
