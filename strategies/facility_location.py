"""`facility_location`: ToMA's submodular destination selection with dense merge matrices.

Reference: W. Lu et al., "ToMA: Token Merge with Attention for Diffusion Models", ICML 2025.

Algorithm (all tiles and batch elements at once; the only Python loop runs over the ``d`` picks):

1. Features: the tokens entering the sublayer, L2-normalised in fp32 (with an epsilon, so an all-zero
   token is a zero vector, never NaN).
2. Locality: the ``N = H*W`` tokens are split into ``T`` groups of ``s`` slots (:meth:`tile_layout`).
   ``"tiles"``: ``t x t`` square blocks of the raster grid. The side is ``tile_size`` if given, else
   ``t = max(1, round(sqrt(N / num_tiles)))`` (so about ``num_tiles`` tiles cover the grid; 64x64 tokens
   with 256 tiles gives the authors' 4x4 tiles). Grids not divisible by ``t`` are padded to whole tiles.
   ``"stripes"``: contiguous runs of the raster sequence of length ``s = ceil(N / num_tiles)``, i.e.
   ``ceil(N / s)`` stripes (the last one padded). Padding slots hold position ``N`` in the layout, have
   zero features, are never selected and get zero merge weight.
3. Destinations: ``d = (N - r) // T`` per tile with ``r = ctx.tokens_to_remove(N)`` (at least 1), so
   ``M = T*d`` slots and ``num_removed = N - M >= r`` (fewer, with a warning, only when ``d`` had to be
   raised to 1). Greedy facility location per tile on ``S = X X^T [B, T, s, s]``: the first pick
   maximises the row sum, each later pick the coverage gain ``sum_i relu(S[v, i] - m_i)`` with
   ``m_i = max_{j in D} S[j, i]``.
4. Merge matrix: ``L = X_dst X_tile^T [B, T, d, s]``, ``A = softmax(L / tau)`` over the destinations
   (each token distributes itself over its tile's destinations), ``W = A / A.sum(-1)`` (rows sum to 1),
   unmerge ``U = A^T`` (raw; for a hard assignment it equals ``pinv(W)``), or ``pinv(W)`` per tile.

Where we deviate from the authors' code (both behaviours are options):
    * ``mask_selected=True``: chosen candidates are masked; the authors' code does not, which picks
      duplicates on flat regions (all gains 0). ``False`` reproduces it.
    * ``shared_destinations=False``: destinations are chosen per batch element; the authors select on
      batch element 0 and share them (``True``). Merge matrices always use each element's features.
    * An edge tile of a padded grid may hold fewer real tokens than ``d``; once its real tokens are all
      chosen, later picks repeat one of them. Duplicate slots split the token's weight equally, so
      merge and unmerge stay exact; they only waste a slot.

Example:
    >>> import torch
    >>> from tomerge import MergeContext
    >>> plan = FacilityLocation(num_tiles=4).plan(torch.randn(2, 64, 16), MergeContext(grid=(8, 8), ratio=0.5))
    >>> plan.num_removed, tuple(plan.merge(torch.randn(2, 64, 16)).shape)
    (32, (2, 32, 16))
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import ClassVar

import torch
from torch import Tensor

from tomerge.context import MergeContext
from tomerge.plan import MergePlan, take_rows, unit_rows
from tomerge.strategy import MergeStrategy

LOCALITIES = ("tiles", "stripes")
UNMERGES = ("transpose", "pinv")
_EPS = 1e-6


@dataclasses.dataclass(frozen=True, kw_only=True)
class FacilityLocation(MergeStrategy):
    """ToMA facility-location merging (see the module docstring for the algorithm).

    Args:
        locality: ``"tiles"`` (square ``t x t`` blocks of the grid) or ``"stripes"`` (raster runs).
        num_tiles: target tile count ``T``; sets the tile side (tiles) or the stripe length (stripes).
        tile_size: tile side ``t`` overriding ``num_tiles`` (tiles only).
        temperature: ``tau`` of ``softmax(L / tau)``; small means practically hard assignments.
        mask_selected: never pick a chosen destination again (the authors' code does not mask).
        shared_destinations: select on batch element 0 and share the destinations (as the authors do).
        unmerge: ``"transpose"`` (``U = A^T``) or ``"pinv"`` (``U = pinv(W)`` per tile).
        ratio: default ratio when applied without one (planning uses ``ctx.ratio``).

    Example:
        >>> FacilityLocation(locality="stripes", num_tiles=8).tile_layout((4, 4)).shape
        torch.Size([8, 2])
    """

    name: ClassVar[str] = "facility_location"
    default_sublayers: ClassVar[frozenset[str]] = frozenset({"attn", "mlp"})

    locality: str = "tiles"
    num_tiles: int = 64
    tile_size: int | None = None
    temperature: float = 1e-3
    mask_selected: bool = True
    shared_destinations: bool = False
    unmerge: str = "transpose"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.locality not in LOCALITIES:
            raise ValueError(f"locality must be one of {LOCALITIES}, got {self.locality!r}")
        if isinstance(self.num_tiles, bool) or not isinstance(self.num_tiles, int) or self.num_tiles < 1:
            raise ValueError(f"num_tiles must be a positive int, got {self.num_tiles!r}")
        if self.tile_size is not None:
            if isinstance(self.tile_size, bool) or not isinstance(self.tile_size, int) or self.tile_size < 1:
                raise ValueError(f"tile_size must be a positive int or None, got {self.tile_size!r}")
            if self.locality != "tiles":
                raise ValueError("tile_size is the side of square tiles; for stripes set num_tiles instead")
        if (isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float))
                or not math.isfinite(self.temperature) or self.temperature <= 0):
            raise ValueError(f"temperature must be a finite number > 0, got {self.temperature!r}")
        for flag in ("mask_selected", "shared_destinations"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"{flag} must be True or False, got {getattr(self, flag)!r}")
        if self.unmerge not in UNMERGES:
            raise ValueError(f"unmerge must be one of {UNMERGES}, got {self.unmerge!r}")

    # ------------------------------------------------------------------ layout
    def tile_side(self, grid: tuple[int, int]) -> int:
        """Tile side ``t``: ``tile_size``, else ``max(1, round(sqrt(N / num_tiles)))``."""
        if self.tile_size is not None:
            return self.tile_size
        return max(1, round(math.sqrt(grid[0] * grid[1] / self.num_tiles)))

    def tile_layout(self, grid: tuple[int, int], device: torch.device | str = "cpu") -> Tensor:
        """Token position of every tile member.

        Args:
            grid: ``(H, W)`` token grid in raster order.
            device: where to build the layout.

        Returns:
            ``[T, s]`` long positions; ``N = H*W`` marks padding. Tiles are in raster order of the tile
            grid, members in raster order inside the tile.
        """
        H, W = grid
        N = H * W
        if self.locality == "stripes":
            s = -(-N // self.num_tiles)  # ceil(N / num_tiles)
            T = -(-N // s)  # ceil(N / s): no stripe is all padding
            pos = torch.arange(T * s, device=device)  # [T*s]
            return pos.clamp(max=N).view(T, s)  # [T, s]
        t = self.tile_side(grid)
        nty, ntx = -(-H // t), -(-W // t)
        ty = torch.arange(nty, device=device).view(nty, 1, 1, 1)
        tx = torch.arange(ntx, device=device).view(1, ntx, 1, 1)
        a = torch.arange(t, device=device).view(1, 1, t, 1)
        row = ty * t + a  # [nty, 1, t, 1]
        col = tx * t + a.view(1, 1, 1, t)  # [1, ntx, 1, t]
        pos = torch.where((row < H) & (col < W), row * W + col, N)  # [nty, ntx, t, t]
        return pos.reshape(nty * ntx, t * t)  # [T, s]

    # ------------------------------------------------------------------ the algorithm
    def plan(self, x: Tensor, ctx: MergeContext) -> MergePlan:
        """:meth:`select_destinations` then :meth:`merge_matrix`, with the tiled unit features computed once
        and shared by both (a subclass that overrides either method gets the plain template)."""
        cls = type(self)
        if (cls.select_destinations is not FacilityLocation.select_destinations
                or cls.merge_matrix is not FacilityLocation.merge_matrix):
            return super().plan(x, ctx)
        B, N, _ = ctx.check_tokens(x)
        if ctx.tokens_to_remove(N) == 0:
            return MergePlan.identity(B, N, device=x.device)
        layout = self.tile_layout(ctx.grid, x.device)  # [T, s]
        X = _features(x, layout)  # [B, T, s, C]
        # Shared destinations select on sample 0's own features (as select_destinations does).
        Xs = _features(x[:1], layout) if self.shared_destinations else X
        dst = self._greedy(Xs, layout, self._dst_per_tile(N, layout.shape[0], ctx), N).expand(B, -1)  # [B, M]
        return self._matrices(X, dst, layout, N)

    def select_destinations(self, x: Tensor, ctx: MergeContext) -> Tensor:
        """Greedy facility location in every tile.

        Args:
            x: ``[B, N, C]`` image-token features (any float dtype).
            ctx: the merge context (grid and ratio).

        Returns:
            ``[B, M]`` long token positions, ``M = T*d``, slot ``m = t*d + j`` is tile ``t``'s ``j``-th pick.
        """
        B, N, _ = ctx.check_tokens(x)
        layout = self.tile_layout(ctx.grid, x.device)  # [T, s]
        d = self._dst_per_tile(N, layout.shape[0], ctx)
        source = x[:1] if self.shared_destinations else x
        X = _features(source, layout)  # [b, T, s, C] (b = 1 when shared)
        return self._greedy(X, layout, d, N).expand(B, -1)  # [B, M]

    def merge_matrix(self, x: Tensor, dst: Tensor, ctx: MergeContext) -> MergePlan:
        """Soft tiled merge/unmerge matrices from the destinations.

        Args:
            x: ``[B, N, C]`` image-token features.
            dst: ``[B, M]`` (or ``[1, M]``) destinations from :meth:`select_destinations`.
            ctx: the merge context.

        Returns:
            A soft tiled :class:`MergePlan` with ``W [B, T, d, s]`` and ``U [B, T, s, d]`` (fp32).
        """
        B, N, C = ctx.check_tokens(x)
        layout = self.tile_layout(ctx.grid, x.device)  # [T, s]
        T, s = layout.shape
        if dst.dim() != 2 or dst.shape[0] not in (1, B) or dst.shape[1] % T != 0:
            raise ValueError(
                f"dst must be [B={B}, T*d] with T={T} tiles for grid {ctx.grid}, got {tuple(dst.shape)}; "
                "pass the output of select_destinations for the same x and ctx"
            )
        return self._matrices(_features(x, layout), dst.expand(B, -1), layout, N)

    def _greedy(self, X: Tensor, layout: Tensor, d: int, num_tokens: int) -> Tensor:
        """``[b, T*d]`` destinations: ``d`` greedy facility-location picks per tile of unit features ``X [b, T, s, C]``
        (``layout`` marks padding with ``num_tokens``)."""
        T, s = layout.shape
        pad = layout == num_tokens  # [T, s]
        S = X @ X.transpose(-1, -2)  # [b, T, s, s]
        coverage = torch.zeros_like(S[..., 0, :])  # [b, T, s]
        chosen = torch.zeros(S.shape[:-1], dtype=torch.bool, device=X.device)  # [b, T, s]
        excess = torch.empty_like(S)  # [b, T, s, s] reused by every pick
        picks = []
        for k in range(d):
            if k == 0:
                gain = S.sum(-1)  # [b, T, s] row sums
            else:  # sum_i relu(S[v, i] - m_i), in one reused buffer
                gain = torch.sub(S, coverage.unsqueeze(-2), out=excess).clamp_min_(0).sum(-1)  # [b, T, s]
            blocked = (pad | chosen) if self.mask_selected else pad.expand_as(chosen)  # [b, T, s]
            exhausted = blocked.all(-1, keepdim=True)  # [b, T, 1]: every real token already chosen
            blocked = torch.where(exhausted, pad, blocked)  # then repeat a real token, never padding
            pick = gain.masked_fill(blocked, float("-inf")).argmax(-1, keepdim=True)  # [b, T, 1]
            chosen = chosen.scatter(-1, pick, True)
            row = take_rows(S.view(-1, s, s), pick.view(-1, 1)).view(coverage.shape)  # [b, T, s] = S[.., pick, :]
            coverage = row if k == 0 else torch.maximum(coverage, row)
            picks.append(pick)
        local = torch.cat(picks, dim=-1)  # [b, T, d]
        dst = layout.expand(local.shape[0], T, s).gather(-1, local)  # [b, T, d]
        return dst.reshape(dst.shape[0], T * d)  # [b, M]

    def _matrices(self, X: Tensor, dst: Tensor, layout: Tensor, N: int) -> MergePlan:
        """The soft plan from tiled unit features ``X [B, T, s, C]`` and destinations ``dst [B, M]`` of ``N`` tokens."""
        B, T, s, C = X.shape
        d = dst.shape[1] // T
        flat = layout.flatten()  # [T*s]
        member = torch.empty(N + 1, dtype=torch.long, device=X.device)
        member[flat] = torch.arange(T * s, device=X.device)  # [N + 1]: row of every token in X.view(B, T*s, C)
        X_dst = take_rows(X.view(B, T * s, C), member[dst]).view(B, T, d, C)  # [B, T, d, C] unit destination rows
        L = X_dst @ X.transpose(-1, -2)  # [B, T, d, s]
        A = torch.softmax(L / self.temperature, dim=-2)  # [B, T, d, s], each column sums to 1
        A = A * (layout != N).to(A.dtype).view(1, T, 1, s)  # padding columns get zero weight
        W = A / A.sum(-1, keepdim=True).clamp_min(torch.finfo(A.dtype).tiny)  # [B, T, d, s]
        if self.unmerge == "pinv":
            U = torch.linalg.pinv(W)  # [B, T, s, d]
        else:
            U = A.transpose(-1, -2)  # [B, T, s, d]
        return MergePlan.soft(W, U, dst, N, tile_tokens=layout)

    # ------------------------------------------------------------------ internals
    def _dst_per_tile(self, N: int, T: int, ctx: MergeContext) -> int:
        """``d = (N - r) // T``, at least 1 (warns when that removes fewer than ``r`` tokens)."""
        r = ctx.tokens_to_remove(N)
        d = (N - r) // T
        if d == 0:
            warnings.warn(
                f"facility_location: {T} tiles need one destination each, so only {N - T} of the {r} "
                f"requested tokens of grid {ctx.grid} are removed; use fewer tiles (num_tiles or tile_size)",
                stacklevel=3,
            )
            d = 1
        return d


def _features(x: Tensor, layout: Tensor) -> Tensor:
    """Unit features in tile layout, as ``_tile(F.normalize(x.float(), eps), layout)`` computes them, with
    :func:`~tomerge.plan.unit_rows` (no normalised copy of ``x``, no zero-padded copy).

    Args:
        x: ``[B, N, C]`` features (any float dtype).
        layout: ``[T, s]`` token positions, ``N`` for padding.

    Returns:
        ``[B, T, s, C]`` fp32 unit rows, contiguous; padding rows are zero (an all-zero token stays zero,
        never NaN).
    """
    B, N, C = x.shape
    flat = layout.flatten()  # [T*s]
    (X,) = unit_rows(x, flat.clamp(max=N - 1), eps=_EPS)  # [B, T*s, C]; padding reads a real row, zeroed below
    if flat.numel() > N:  # every token is in one tile, so more slots than tokens means padding
        X.masked_fill_((flat == N).view(1, -1, 1), 0)
    return X.view(B, *layout.shape, C)
