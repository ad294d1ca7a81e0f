"""`MergeContext`: everything a strategy may know when it plans one merge, and nothing else."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

Grid = tuple[int, ...]
"""A token grid in raster order: ``(H, W)`` for images, ``(T, H, W)`` for video (frames x height x width; token
``(t, h, w)`` is at index ``(t * H + h) * W + w``). A 2-D grid is one frame (``T = 1``)."""


def check_grid(grid: object) -> Grid:
    """Raises unless ``grid`` is ``(H, W)`` or ``(T, H, W)`` of positive ints; returns it as a tuple.

    Example:
        >>> check_grid([2, 4, 4])
        (2, 4, 4)
        >>> check_grid((4, 0))
        Traceback (most recent call last):
            ...
        ValueError: grid must be (H, W) or (T, H, W) with positive ints, got (4, 0)
    """
    if (not isinstance(grid, (tuple, list)) or len(grid) not in (2, 3)
            or not all(isinstance(g, int) and not isinstance(g, bool) and g > 0 for g in grid)):
        raise ValueError(f"grid must be (H, W) or (T, H, W) with positive ints, got {grid!r}")
    return tuple(int(g) for g in grid)


def grid_frames(grid: Grid) -> tuple[int, int, int]:
    """``(T, H, W)`` of a 2-D or 3-D grid (``T = 1`` for ``(H, W)``), for code that handles both alike.

    Example:
        >>> grid_frames((4, 6)), grid_frames((2, 4, 6))
        ((1, 4, 6), (2, 4, 6))
    """
    if len(grid) == 2:
        return 1, grid[0], grid[1]
    T, H, W = grid
    return T, H, W


@dataclass(frozen=True)
class MergeContext:
    """What a strategy may use to plan the merge of one block's image tokens.

    Frozen: assigning a field raises ``dataclasses.FrozenInstanceError``; a context that differs in some fields
    is derived with ``dataclasses.replace(ctx, field=value)``, validated like a new one (except inside a compiled
    graph, where it comes from a context validated eagerly). Work a strategy computes for its own two stages is
    no field of it: the strategy's :meth:`~tomerge.MergeStrategy.plan` passes it between them.

    Args:
        grid: ``(H, W)`` token grid, or ``(T, H, W)`` for video (frames x height x width), raster order
            (token ``(t, h, w)`` at ``(t * H + h) * W + w``); the product must equal the token count ``N``.
            Every built-in strategy handles both; what its windows, cells or tiles become in 3-D is in
            docs/strategies.md ("3-D (video) token grids"). A 2-D grid is one frame.
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
        draws: what the strategy's :meth:`~tomerge.MergeStrategy.draw` returned for this plan (drawn by the merge
            state outside compiled graphs), or ``None``: the strategy draws from ``generator`` itself.
        removal: ``[r, 0]`` (an empty tensor): ``r = int(N * ratio)`` for the grid's ``N`` as a tensor size, set by
            the merge state. ``torch.compile`` treats a tensor size that changes between calls as dynamic
            (automatic dynamic shapes), so a ratio curve compiles once more and then reuses one graph for every
            count, where the float ratio or a Python int would be a constant of the graph (docs/compile.md).

    Example:
        >>> ctx = MergeContext(grid=(32, 32), ratio=0.5)
        >>> ctx.tokens_to_remove(1024)
        512
        >>> video = MergeContext(grid=(4, 16, 16), ratio=0.5)
        >>> video.num_tokens, video.frames, video.frame_tokens
        (1024, 4, 256)
        >>> import dataclasses
        >>> later = dataclasses.replace(ctx, step=3, progress=0.5)   # a derived context; ctx is unchanged
        >>> later.step, ctx.step
        (3, 0)
    """

    grid: Grid
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
    removal: Tensor | None = None
    draws: Tensor | None = None

    def __post_init__(self) -> None:
        if torch.compiler.is_compiling():
            # Derived inside a compiled graph (dataclasses.replace) from a context validated eagerly: checking the
            # floats again would make the graph guard on their values (progress changes every step: a recompile)
            return
        object.__setattr__(self, "grid", check_grid(self.grid))  # how a frozen dataclass sets a field
        check_ratio(self.ratio)
        if not 0.0 <= float(self.progress) <= 1.0:
            raise ValueError(f"progress must be in [0, 1], got {self.progress}")

    @property
    def num_tokens(self) -> int:
        """``N``: ``H * W``, or ``T * H * W``."""
        return math.prod(self.grid)

    @property
    def frames(self) -> int:
        """``T``, the number of frames (1 for a 2-D grid)."""
        return grid_frames(self.grid)[0]

    @property
    def height(self) -> int:
        """``H``, token rows per frame."""
        return grid_frames(self.grid)[1]

    @property
    def width(self) -> int:
        """``W``, token columns per frame."""
        return grid_frames(self.grid)[2]

    @property
    def frame_tokens(self) -> int:
        """``H * W``, the tokens of one frame (the offset from a token to the same position one frame later)."""
        return self.height * self.width

    def tokens_to_remove(self, num_tokens: int) -> int:
        """``r = int(N * ratio)``, the number of tokens the context asks to remove (the length of ``removal`` when
        it is set and ``N`` fills the grid)."""
        if self.removal is not None and num_tokens == self.num_tokens:
            return self.removal.shape[0]
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
