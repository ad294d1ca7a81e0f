"""`tomesd`: ToMeSD bipartite soft matching (Bolya & Hoffman, "Token Merging for Fast Stable Diffusion", CVPRW
2023), with output parity to the ``tomesd`` 0.1.3 package.

One destination per ``sy x sx`` cell of the grid (drawn at random or the top-left one); the ``r`` sources most
cosine-similar to a destination merge into it as a plain mean, and unmerging copies the mean back. The algorithm,
its cells on video grids and how it differs from the package without changing outputs: docs/strategies.md,
"tomesd".
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import ClassVar

import torch
from torch import Tensor

from tomerge import MergeContext, MergePlan, MergeStrategy
from tomerge.options import check_choice, check_int
from tomerge.plan import unit_rows

RNGS = ("fork_global", "per_step_layer")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ToMeSD(MergeStrategy):
    """ToMeSD bipartite soft matching (the algorithm: docs/strategies.md, "tomesd").

    Args:
        sx, sy: destination stride in x and y (one destination per ``sy x sx`` cell).
        st: destination stride in time on a ``(T, H, W)`` grid (one destination per ``st x sy x sx`` box);
            1 (default): every frame has the cells of a 2-D grid, the same in every frame. A 2-D grid is
            one frame, so it needs ``st=1``.
        use_rand: draw each cell's destination at random (else its top-left token).
        rng: ``"fork_global"`` (as tomesd: a generator forked from the global RNG at first use,
            advanced by every draw) or ``"per_step_layer"`` (a fresh generator per step and layer,
            so split and batched guidance see the same layout).

    Example:
        >>> import torch
        >>> ctx = MergeContext(grid=(4, 4), ratio=0.5)
        >>> ToMeSD(use_rand=False).plan(torch.randn(1, 16, 8), ctx).num_removed
        8
    """

    name: ClassVar[str] = "tomesd"

    sx: int = 2
    sy: int = 2
    st: int = 1
    use_rand: bool = True
    rng: str = "fork_global"

    def __post_init__(self) -> None:
        super().__post_init__()
        what = "tomesd"
        check_int(self.sx, "sx", what, low=1)
        check_int(self.sy, "sy", what, low=1)
        check_int(self.st, "st", what, low=1, note="frames per cell on a (T, H, W) grid")
        if self.st * self.sx * self.sy < 2:
            raise ValueError(f"{what}: sx and sy (and st) must be >= 1 with st * sy * sx >= 2 (a cell of one "
                             f"token merges nothing), got sx={self.sx}, sy={self.sy}, st={self.st}")
        check_choice(self.rng, "rng", what, RNGS)

    @property
    def default_sublayers(self) -> frozenset[str]:
        return frozenset({"attn"})

    @property
    def plan_input(self) -> str:
        return "block_input"

    @property
    def uses_generator(self) -> bool:
        return self.use_rand

    @property
    def generator_policy(self) -> str:
        return self.rng

    def _cells(self, ctx: MergeContext) -> tuple[int, int, int]:
        """``(depth, rows, cols)``: the cells along time, height and width."""
        rows, cols = ctx.height // self.sy, ctx.width // self.sx
        if rows == 0 or cols == 0:
            raise ValueError(f"grid {ctx.grid} is smaller than one {self.sy}x{self.sx} cell")
        depth = ctx.frames // self.st
        if depth == 0:
            raise ValueError(f"grid {ctx.grid} has {ctx.frames} frame(s), fewer than one cell of st={self.st} "
                             "frames (a 2-D grid is one frame)")
        return depth, rows, cols

    def draw(self, ctx: MergeContext, batch: int) -> Tensor | None:
        """``[draws, rows, cols]`` long: each cell's destination inside its ``st x sy x sx`` box, or ``None`` (the
        top-left one) without ``use_rand`` or for an odd batch (tomesd: it cannot hold cond/uncond pairs). With
        ``st=1`` one 2-D draw serves every frame (the same draw, and generator use, as a 2-D grid); with ``st > 1``
        every box draws its own."""
        depth, rows, cols = self._cells(ctx)
        if not self.use_rand or batch % 2 != 0:
            return None
        gen = ctx.generator
        draws = 1 if self.st == 1 else depth
        size = (rows, cols, 1) if self.st == 1 else (draws, rows, cols, 1)
        offset = torch.randint(self.st * self.sy * self.sx, size=size, device=gen.device, generator=gen)
        return offset.view(draws, rows, cols)  # [draws, rows, cols]

    def select_destinations(self, x: Tensor, ctx: MergeContext) -> Tensor:
        B = x.shape[0]
        H, W = ctx.height, ctx.width
        depth, rows, cols = self._cells(ctx)
        offset = ctx.draws if ctx.draws is not None else self.draw(ctx, B)  # [draws, rows, cols] or None
        if offset is None:
            offset = torch.zeros(1, rows, cols, dtype=torch.long, device=x.device)
        offset = offset.to(x.device)
        cell_t = torch.arange(depth, device=x.device).view(depth, 1, 1) * self.st
        cell_y = torch.arange(rows, device=x.device).view(1, rows, 1) * self.sy
        cell_x = torch.arange(cols, device=x.device).view(1, 1, cols) * self.sx
        area = self.sy * self.sx  # positions of one frame of a cell
        t = cell_t + offset // area  # [depth, rows, cols] (offset broadcasts over frames when st=1)
        y = cell_y + offset % area // self.sx  # [depth or 1, rows, cols]
        xx = cell_x + offset % self.sx  # [depth or 1, rows, cols]
        D = depth * rows * cols
        return ((t * H + y) * W + xx).flatten().expand(B, D)  # [B, D], raster order (frame, row, column)

    def merge_matrix(self, x: Tensor, dst: Tensor, ctx: MergeContext) -> MergePlan:
        B, N, _ = x.shape
        D = dst.shape[1]
        S = N - D  # destinations are distinct (one per cell): the count needs no look at the data
        is_dst = torch.zeros(N, dtype=torch.int8, device=x.device)
        is_dst[dst[0]] = 1  # one layout for the whole batch
        # The non-destinations in raster order, without nonzero() (a host sync on CUDA): a stable sort
        # puts the zeros first, in position order.
        src = torch.sort(is_dst, stable=True).indices[:S]  # [S]
        r = ctx.tokens_to_remove(N)
        if r > S:
            warnings.warn(
                f"tomesd: ratio {ctx.ratio} asks to remove {r} of {N} tokens, but only {S} are "
                f"sources with sx={self.sx}, sy={self.sy}, st={self.st}; removing {S}", stacklevel=3)
            r = S

        a, b = unit_rows(x, src, dst[0], eps=1e-6)  # [B, S, C], [B, D, C] unit rows
        scores = a @ b.transpose(1, 2)  # [B, S, D] cosine similarity
        best, best_dst = scores.max(dim=-1)  # [B, S]
        order = best.argsort(dim=-1, descending=True, stable=True)  # [B, S] most similar first
        merged_rank, unmerged_rank = order[:, :r], order[:, r:]
        merged = src[merged_rank]  # [B, r] token positions
        unmerged = src[unmerged_rank]  # [B, S - r]
        merged_into = best_dst.gather(1, merged_rank)  # [B, r] index into dst
        return MergePlan.from_matching(dst.contiguous(), unmerged, merged, merged_into, N)

