"""Context tokens in the image stream: tokens that ride along with the generated image (the *target*), unmerged.

Reference images of editing calls and FramePack's and Helios's history latents sit in the image stream before or
after the target. Only the target is merged; the context tokens pass every merged sublayer at full length and keep
their rotary rows. :class:`ContextTokens` describes one call's stream ``[before, target, after]``: it takes the
target out, puts a merged or unmerged target back, and extends the plan's representatives to the whole stream, so
that rotary tables and key masks are gathered with the context rows kept. Which families put them where:
docs/backbones/adding-a-family.md ("Context tokens") and the family pages.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

import torch
from torch import Tensor


@dataclasses.dataclass(frozen=True)
class ContextTokens:
    """The context tokens of a model call's image stream: ``before`` tokens ahead of the target, ``after``
    behind it (the target's length follows from the stream's, so a merged stream is read the same way).

    Example:
        >>> ctx = ContextTokens(after=2)                                   # [target (3), reference (2)]
        >>> stream = torch.arange(5.0).view(1, 5, 1)
        >>> ctx.target(stream).flatten().tolist()
        [0.0, 1.0, 2.0]
        >>> ctx.with_target(stream, torch.zeros(1, 2, 1)).flatten().tolist()  # 3 target tokens merged to 2
        [0.0, 0.0, 3.0, 4.0]
        >>> ctx.stream_positions(torch.tensor([[2, 0]]), 3).tolist()
        [[2, 0, 3, 4]]
    """

    before: int = 0
    after: int = 0

    def __post_init__(self) -> None:
        if self.before < 0 or self.after < 0:
            raise ValueError(f"context token counts must be >= 0, got before={self.before}, after={self.after}")

    def __bool__(self) -> bool:
        return self.before > 0 or self.after > 0

    @property
    def count(self) -> int:
        """The number of context tokens."""
        return self.before + self.after

    def check(self, stream: Tensor, what: str) -> None:
        """Raises unless ``stream [B, L, C]`` is long enough to hold the context tokens."""
        if stream.shape[1] < self.count:
            raise RuntimeError(f"tomerge: {what} got {tuple(stream.shape)}, shorter than its {self.before} + "
                               f"{self.after} context (reference-image) tokens")

    def target(self, stream: Tensor) -> Tensor:
        """``[B, before + N + after, C] -> [B, N, C]`` (also for a merged stream: ``N`` is then ``M``)."""
        if not self:
            return stream
        return stream[:, self.before: stream.shape[1] - self.after]

    def with_target(self, stream: Tensor, target: Tensor) -> Tensor:
        """``stream`` with its target replaced by ``target [B, N', C']``: ``[B, before + N' + after, C']``."""
        if not self:
            return target
        return torch.cat([stream[:, : self.before], target, stream[:, stream.shape[1] - self.after:]], dim=1)

    def stream_positions(self, dst: Tensor, num_tokens: int) -> Tensor:
        """The plan's representatives ``dst [B, M]`` (target positions ``0..N-1``, ``N = num_tokens``) as
        positions in the stream ``[B, before + M + after]``: each context token represents itself, so a gather
        of the stream's rows with them keeps the context rows and gathers the target's."""
        if not self:
            return dst
        B = dst.shape[0]
        ahead = torch.arange(self.before, device=dst.device).expand(B, -1)  # [B, before]
        behind = torch.arange(self.before + num_tokens, self.before + num_tokens + self.after,
                              device=dst.device).expand(B, -1)  # [B, after]
        return torch.cat([ahead, dst + self.before, behind], dim=1)  # [B, before + M + after]


NO_CONTEXT = ContextTokens()


def beyond_grid(stream: Tensor, grid: tuple[int, ...] | None, side: Literal["first", "last"]) -> ContextTokens:
    """The context tokens of an image stream ``[B, C + N, C']`` whose target is a model call's ``grid`` (``N`` tokens):
    the other ``C`` tokens, on ``side`` (FramePack's and Helios's history latents, first). A stream shorter than the
    grid (or a call without one) has none: its grid does not match, it is not merged.

    Example:
        >>> beyond_grid(torch.zeros(1, 7, 2), (2, 2), "first")
        ContextTokens(before=3, after=0)
    """
    if grid is None or stream.shape[1] < math.prod(grid):
        return NO_CONTEXT
    C = int(stream.shape[1]) - math.prod(grid)
    return ContextTokens(before=C) if side == "first" else ContextTokens(after=C)
