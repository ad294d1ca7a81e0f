"""tomerge: training-free token merging for diffusion transformers.

Import cost is small: no strategy, backbone, diffusers or timm is imported here.
"""

from .context import MergeContext
from .plan import MergePlan
from .registry import get_strategy, list_backbones, list_strategies, register_backbone, register_strategy
from .strategy import MergeStrategy

__all__ = [
    "MergeContext", "MergePlan", "MergeStrategy",
    "get_strategy", "list_strategies", "register_strategy", "list_backbones", "register_backbone",
]
__version__ = "0.1.0"
