"""`tomesd`: ToMeSD bipartite soft matching (Bolya & Hoffman, "Token Merging for Fast Stable
Diffusion", CVPRW 2023), with output parity to the ``tomesd`` 0.1.3 package.

Algorithm, on the block's input hidden states ``x [B, N, C]`` on an ``H x W`` grid:

1. Split the grid into ``sy x sx`` cells; one position per full cell is a destination: drawn
   uniformly (one draw shared by the batch) or, with ``use_rand=False`` (or an odd batch, as in
   tomesd), the top-left one. Leftover rows/columns are sources.
2. ``r = int(N * ratio)``, capped at the number of sources (with a warning).
3. Every source finds its most cosine-similar destination; the ``r`` sources with the highest
   similarity merge into it, the rest keep their own slot.
4. A destination slot holds the plain mean of itself and its merged sources; unmerging copies it back.

Differences from the package that do not change outputs: slots are ordered
``[destinations, unmerged sources]`` instead of ``[unmerged, destinations]`` (attention and MLP are
permutation-equivariant without in-block positions), ties in similarity are broken by a stable sort in
raster order, and normalisation has an epsilon so all-zero tokens give no NaN.
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
    """ToMeSD bipartite soft matching (see the module docstring).

    Args:
        sx, sy: destination stride in x and y (one destination per ``sy x sx`` cell).
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
    use_rand: bool = True
    rng: str = "fork_global"

    def __post_init__(self) -> None:
        super().__post_init__()
        what = "tomesd"
        check_int(self.sx, "sx", what, low=1)
        check_int(self.sy, "sy", what, low=1)
        if self.sx * self.sy < 2:
            raise ValueError(f"{what}: sx and sy must be >= 1 with sx * sy >= 2 (a cell of one token merges "
                             f"nothing), got sx={self.sx}, sy={self.sy}")
        check_choice(self.rng, "rng", what, RNGS)

    @property
    def default_sublayers(self) -> frozenset[str]:
        return frozenset({"attn"})

    @property
    def metric(self) -> str:
        return "block_input"

    @property
    def uses_generator(self) -> bool:
        return self.use_rand

    @property
    def generator_policy(self) -> str:
        return self.rng

    @property
    def batch_independent(self) -> bool:
        return not self.use_rand  # one random layout is drawn for the whole batch

    def select_destinations(self, x: Tensor, ctx: MergeContext) -> Tensor:
        B = x.shape[0]
        H, W = ctx.grid
        rows, cols = H // self.sy, W // self.sx
        if rows == 0 or cols == 0:
            raise ValueError(f"grid {ctx.grid} is smaller than one {self.sy}x{self.sx} cell")
        if self.use_rand and B % 2 == 0:  # tomesd: an odd batch cannot hold cond/uncond pairs
            gen = ctx.generator
            offset = torch.randint(self.sy * self.sx, size=(rows, cols, 1), device=gen.device, generator=gen)
            offset = offset.to(x.device).squeeze(-1)  # [rows, cols] index inside each cell
        else:
            offset = torch.zeros(rows, cols, dtype=torch.long, device=x.device)
        cell_y = torch.arange(rows, device=x.device).view(rows, 1) * self.sy
        cell_x = torch.arange(cols, device=x.device).view(1, cols) * self.sx
        y = cell_y + offset // self.sx  # [rows, cols]
        xx = cell_x + offset % self.sx  # [rows, cols]
        return (y * W + xx).flatten().expand(B, rows * cols)  # [B, D], raster order

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
                f"sources with sx={self.sx}, sy={self.sy}; removing {S}", stacklevel=3)
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

