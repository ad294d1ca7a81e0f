"""`MergeContext`: everything a strategy may know when it plans one merge, and nothing else."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class MergeContext:
    """What a strategy may use to plan the merge of one block's image tokens.

    Args:
        grid: ``(H, W)`` token grid, raster order; ``H * W`` must equal the token count ``N``.
        ratio: fraction of tokens to remove, in ``[0, 1)``; a strategy removes ``int(N * ratio)``
            (or fewer, if its structure caps it: it then warns).
        progress: position in the denoising trajectory, 0 (pure noise) to 1 (last step).
        step, num_steps: denoising step index and count (``num_steps`` ``None`` when unknown).
        layer, num_layers: index of the block among the model's merged blocks, and their count.
        block_kind: the adapter's name for the block type (``"joint"``, ``"single"``, ``"basic"``...).
        generator: the ``torch.Generator`` for this (step, layer), for strategies that draw.
        received_attention: ``[B, N]`` attention each image token received (recorded by the
            adapter's probe, or given by hand).
        streak: ``[B, N]`` number of consecutive merge decisions in which each token was merged.

    Example:
        >>> ctx = MergeContext(grid=(32, 32), ratio=0.5)
        >>> ctx.tokens_to_remove(1024)
        512
    """

    grid: tuple[int, int]
    ratio: float
    progress: float = 0.0
    step: int = 0
    num_steps: int | None = None
    layer: int = 0
    num_layers: int | None = None
    block_kind: str = "block"
    generator: torch.Generator | None = None
    received_attention: Tensor | None = None
    streak: Tensor | None = None

    def __post_init__(self) -> None:
        if (not isinstance(self.grid, (tuple, list)) or len(self.grid) != 2
                or not all(isinstance(g, int) and g > 0 for g in self.grid)):
            raise ValueError(f"grid must be (H, W) with positive ints, got {self.grid!r}")
        self.grid = (int(self.grid[0]), int(self.grid[1]))
        check_ratio(self.ratio)
        if not 0.0 <= float(self.progress) <= 1.0:
            raise ValueError(f"progress must be in [0, 1], got {self.progress}")

    @property
    def num_tokens(self) -> int:
        return self.grid[0] * self.grid[1]

    def tokens_to_remove(self, num_tokens: int) -> int:
        """``r = int(N * ratio)``, the number of tokens the context asks to remove."""
        return int(num_tokens * self.ratio)

    def check_tokens(self, x: Tensor) -> tuple[int, int, int]:
        """Validates ``x [B, N, C]`` against the grid and returns ``(B, N, C)``."""
        if x.dim() != 3:
            raise ValueError(f"expected image tokens [B, N, C], got shape {tuple(x.shape)}")
        B, N, C = x.shape
        if N != self.num_tokens:
            raise ValueError(
                f"{N} tokens do not fill the grid {self.grid} ({self.num_tokens} tokens); "
                "pass image tokens only, and the grid of this block"
            )
        for name in ("received_attention", "streak"):
            stat = getattr(self, name)
            if stat is not None and (stat.dim() != 2 or stat.shape[1] != N or stat.shape[0] not in (1, B)):
                raise ValueError(f"{name} must be [B={B}, N={N}], got {tuple(stat.shape)}")
        return B, N, C


def check_ratio(ratio: float) -> float:
    """Raises unless ``0 <= ratio < 1``; returns it as a float."""
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0.0 <= float(ratio) < 1.0:
        raise ValueError(f"ratio must be a number in [0, 1), got {ratio!r}")
    return float(ratio)
