"""`facility_location`: ToMA's submodular destination selection with dense merge matrices (Lu et al., "ToMA: Token
Merge with Attention for Diffusion Models", ICML 2025).

The tokens are cut into local tiles (squares or raster stripes; on video grids per group of frames); in each
tile a greedy facility location picks the destinations that best cover the tile by cosine similarity, and every
token is spread over its tile's destinations by a softmax of its similarities. Merging and unmerging are
tile-local batched matmuls, never a global ``N x M`` matrix. The algorithm, its options and where it deviates
from the authors' code (both behaviours are options): docs/strategies.md, "facility_location".
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import ClassVar

import torch
from torch import Tensor

from tomerge.context import Grid, MergeContext, grid_frames
from tomerge.options import check_bool, check_choice, check_int, check_number
from tomerge.plan import MergePlan, take_rows
from tomerge.strategy import MergeStrategy

LOCALITIES = ("tiles", "stripes")
UNMERGES = ("transpose", "pinv")
_EPS = 1e-6


@dataclasses.dataclass(frozen=True, kw_only=True)
class FacilityLocation(MergeStrategy):
    """ToMA facility-location merging (the algorithm: docs/strategies.md, "facility_location").

    Args:
        locality: ``"tiles"`` (square ``t x t`` blocks of the grid) or ``"stripes"`` (raster runs).
        num_tiles: target tile count ``T``; sets the tile side (tiles) or the stripe length (stripes).
        tile_size: tile side ``t`` overriding ``num_tiles`` (tiles only).
        tile_frames: frames per tile on a ``(T, H, W)`` grid (tiles and stripes); 1 (default): per frame.
        temperature: ``tau`` of ``softmax(L / tau)``; small means practically hard assignments.
        mask_selected: never pick a chosen destination again (the authors' code does not mask).
        shared_destinations: select on batch element 0 and share the destinations (as the authors do).
        unmerge_matrix: ``"transpose"`` (``U = A^T``) or ``"pinv"`` (``U = pinv(W)`` per tile).
        max_tile_tokens: the most tokens a tile may hold: a tile of ``s`` tokens keeps ``s x s`` float32
            similarities per sample and the greedy selection passes over them once per destination, so one global
            tile at video sizes (32k tokens: 4 GiB per sample, 16k passes) is refused with its cost.
        ratio: default ratio when applied without one (planning uses ``ctx.ratio``).

    Example:
        >>> FacilityLocation(locality="stripes", num_tiles=8).tile_layout((4, 4)).shape
        torch.Size([8, 2])
    """

    name: ClassVar[str] = "facility_location"

    locality: str = "tiles"
    num_tiles: int = 64
    tile_size: int | None = None
    tile_frames: int = 1
    temperature: float = 1e-3
    mask_selected: bool = True
    shared_destinations: bool = False
    unmerge_matrix: str = "transpose"
    max_tile_tokens: int = 4096

    def __post_init__(self) -> None:
        super().__post_init__()
        what = "facility_location"
        check_choice(self.locality, "locality", what, LOCALITIES)
        check_int(self.num_tiles, "num_tiles", what, low=1)
        check_int(self.tile_size, "tile_size", what, low=1, optional=True)
        check_int(self.tile_frames, "tile_frames", what, low=1, note="frames per tile on a (T, H, W) grid")
        if self.tile_size is not None and self.locality != "tiles":
            raise ValueError(f"{what}: tile_size is the side of square tiles; for stripes set num_tiles instead")
        check_number(self.temperature, "temperature", what, low=0, low_open=True)
        check_bool(self.mask_selected, "mask_selected", what)
        check_bool(self.shared_destinations, "shared_destinations", what)
        check_choice(self.unmerge_matrix, "unmerge_matrix", what, UNMERGES)
        check_int(self.max_tile_tokens, "max_tile_tokens", what, low=1)

    # ------------------------------------------------------------------ layout
    def tile_side(self, grid: Grid) -> int:
        """Tile side ``t``: ``tile_size``, else ``max(1, round(sqrt(H * W / num_tiles)))`` (one frame's ``H * W``)."""
        if self.tile_size is not None:
            return self.tile_size
        _, H, W = grid_frames(grid)
        return max(1, round(math.sqrt(H * W / self.num_tiles)))

    def stripe_length(self, grid: Grid) -> int:
        """Stripe length ``s = ceil(tile_frames * H * W / num_tiles)`` (``ceil(N / num_tiles)`` on a 2-D grid)."""
        _, H, W = grid_frames(grid)
        return -(-(self.tile_frames * H * W) // self.num_tiles)

    def tile_layout(self, grid: Grid, device: torch.device | str = "cpu") -> Tensor:
        """Token position of every tile member.

        Args:
            grid: ``(H, W)`` or ``(T, H, W)`` token grid in raster order.
            device: where to build the layout.

        Returns:
            ``[T, s]`` long positions (``T`` tiles of ``s`` slots); ``N`` (the token count) marks padding. Tiles
            are in raster order of the tile grid (group of frames, tile row, tile column; stripes: group, then
            position), members in raster order inside the tile (frame, row, column).
        """
        frames, H, W = grid_frames(grid)
        N = frames * H * W
        depth = self.tile_frames
        side = self.stripe_length(grid) if self.locality == "stripes" else depth * self.tile_side(grid) ** 2
        if side > self.max_tile_tokens:
            tiles = N / side
            raise ValueError(
                f"facility_location: tiles of {side} tokens on grid {tuple(grid)} (about {tiles:.3g} tiles): their "
                f"similarities take {tiles * side * side * 4 / 2**30:.2f} GiB per sample in float32 and the greedy "
                f"selection passes over them once per destination; use more tiles (num_tiles, tile_size, "
                f"tile_frames) or raise max_tile_tokens (now {self.max_tile_tokens})")
        groups = -(-frames // depth)  # groups of `depth` frames, the last one possibly shorter
        g = torch.arange(groups, device=device)
        if self.locality == "stripes":
            s = self.stripe_length(grid)
            per_group = -(-(depth * H * W) // s)  # stripes of a full group: no stripe is all padding
            last = frames - (groups - 1) * depth  # frames of the last group
            count = (groups - 1) * per_group + -(-(last * H * W) // s)  # the last group may need fewer stripes
            offset = torch.arange(per_group * s, device=device).view(1, per_group, s)  # [1, per_group, s] in group
            group_len = ((frames - g * depth).clamp(max=depth) * (H * W)).view(groups, 1, 1)  # [groups, 1, 1]
            pos = torch.where(offset < group_len, g.view(groups, 1, 1) * (depth * H * W) + offset, N)  # [groups, per_group, s]
            return pos.reshape(groups * per_group, s)[:count]  # [T, s]: drop the last group's empty stripes
        t = self.tile_side(grid)
        nty, ntx = -(-H // t), -(-W // t)
        frame = g.view(groups, 1, 1, 1, 1, 1) * depth + torch.arange(depth, device=device).view(1, 1, 1, depth, 1, 1)
        ty = torch.arange(nty, device=device).view(1, nty, 1, 1, 1, 1)
        tx = torch.arange(ntx, device=device).view(1, 1, ntx, 1, 1, 1)
        a = torch.arange(t, device=device)
        row = ty * t + a.view(1, 1, 1, 1, t, 1)  # [1, nty, 1, 1, t, 1]
        col = tx * t + a.view(1, 1, 1, 1, 1, t)  # [1, 1, ntx, 1, 1, t]
        inside = (frame < frames) & (row < H) & (col < W)  # [groups, nty, ntx, depth, t, t]
        pos = torch.where(inside, (frame * H + row) * W + col, N)  # [groups, nty, ntx, depth, t, t]
        return pos.reshape(groups * nty * ntx, depth * t * t)  # [T, s]

    # ------------------------------------------------------------------ the algorithm
    def plan(self, x: Tensor, ctx: MergeContext, destinations: Tensor | None = None) -> MergePlan:
        """:meth:`MergeStrategy.plan <tomerge.MergeStrategy.plan>`, with the tile similarities ``[B, T, s, s]``
        both stages need computed once."""
        identity = self.identity_plan(x, ctx)
        if identity is not None:
            return identity
        similarities = _similarities(x, self.tile_layout(ctx.grid, x.device))  # [B, T, s, s]
        if destinations is None:
            destinations = self.select_destinations(x, ctx, similarities)
        return self.merge_matrix(x, destinations, ctx, similarities)

    def select_destinations(self, x: Tensor, ctx: MergeContext, similarities: Tensor | None = None) -> Tensor:
        """Greedy facility location in every tile.

        Args:
            x: ``[B, N, C]`` image-token features (any float dtype).
            ctx: the merge context (grid and ratio).
            similarities: ``[B, T, s, s]`` the tile similarities of ``x`` (passed by :meth:`plan`); ``None``:
                computed here.

        Returns:
            ``[B, M]`` long token positions, ``M = T*d``, slot ``m = t*d + j`` is tile ``t``'s ``j``-th pick.
        """
        B, N, _ = ctx.check_tokens(x)
        layout = self.tile_layout(ctx.grid, x.device)  # [T, s]
        d = self._dst_per_tile(N, layout.shape[0], ctx)
        if similarities is None:
            S = _similarities(x[:1] if self.shared_destinations else x, layout)  # [b, T, s, s]
        else:
            S = similarities[:1] if self.shared_destinations else similarities  # [b, T, s, s]: b = 1: sample 0
        local, _ = self._greedy(S, layout == N, d, self._fewest_members(ctx.grid))  # [b, T, d] (b = 1 when shared)
        return _positions(layout, local).expand(B, -1)  # [B, M]

    def merge_matrix(self, x: Tensor, dst: Tensor, ctx: MergeContext,
                     similarities: Tensor | None = None) -> MergePlan:
        """Soft tiled merge/unmerge matrices from the destinations.

        Args:
            x: ``[B, N, C]`` image-token features.
            dst: ``[B, M]`` (or ``[1, M]``) destinations from :meth:`select_destinations`: slot ``m = t*d + j``
                must hold a token of tile ``t``.
            ctx: the merge context.
            similarities: ``[B, T, s, s]`` the tile similarities of ``x`` (passed by :meth:`plan`); ``None``:
                computed here.

        Returns:
            A soft tiled :class:`MergePlan` with ``W [B, T, d, s]`` and ``U [B, T, s, d]`` (fp32).
        """
        B, N, C = ctx.check_tokens(x)
        layout = self.tile_layout(ctx.grid, x.device)  # [T, s]
        # Called on its own (no similarities), the destinations are given by hand: their values are checked.
        # Inside plan() they were just selected, or kept from an earlier plan of this grid.
        local = self._tile_members(dst, layout, B, ctx.grid, check_values=similarities is None)  # [b, T, d]
        S = _similarities(x, layout) if similarities is None else similarities  # [B, T, s, s]
        L = _rows(S, local.expand(B, -1, -1))  # [B, T, d, s]
        return self._matrices(L, dst.expand(B, -1), layout, N)

    def _tile_members(self, dst: Tensor, layout: Tensor, batch: int, grid: Grid, check_values: bool) -> Tensor:
        """``[b, T, d]``: the member index inside its tile of every destination ``dst [b, T*d]`` (``b`` is 1 or
        ``batch``) of the tiles ``layout [T, s]`` (``N`` marks padding).

        Raises ``ValueError`` unless ``dst`` is ``[b, T*d]``; with ``check_values``, also unless every slot
        ``t*d + j`` holds a token of tile ``t``. The value checks read the host, so a compiled graph skips them
        (they would break it and synchronise).
        """
        T, s = layout.shape
        N = math.prod(grid)
        checked = check_values and not torch.compiler.is_compiling()
        if (dst.dim() != 2 or dst.shape[0] not in (1, batch) or dst.shape[1] % T != 0
                or checked and (dst.min() < 0 or dst.max() >= N)):
            raise ValueError(
                f"dst must be [B={batch}, T*d] token positions with T={T} tiles for grid {grid}, got "
                f"{tuple(dst.shape)}; pass the output of select_destinations for the same x and ctx"
            )
        d = dst.shape[1] // T
        member = torch.empty(N + 1, dtype=torch.long, device=layout.device)
        member[layout.flatten()] = torch.arange(T * s, device=layout.device)  # [N + 1]: tile-layout row of every token
        start = torch.arange(T, device=layout.device).view(1, T, 1) * s  # [1, T, 1] first row of every tile
        local = member[dst].view(-1, T, d) - start  # [b, T, d] member index inside the tile
        if checked and (local.min() < 0 or local.max() >= s):
            raise ValueError(f"dst slot t*d + j must be a token of tile t (tile_layout({grid})); "
                             "pass the output of select_destinations for the same x and ctx")
        return local

    def _greedy(self, S: Tensor, pad: Tensor, d: int, fewest: int) -> tuple[Tensor, Tensor]:
        """``d`` greedy facility-location picks per tile of the similarities ``S [b, T, s, s]`` (``pad [T, s]``
        marks padding members; the smallest tile has ``fewest`` real members).

        Returns:
            ``[b, T, d]`` member index of every pick inside its tile, and the picks' similarity rows
            ``[b, T, d, s]`` (``S[..., pick, :]``).
        """
        b, T, s, _ = S.shape
        pad_bias = torch.zeros(T, s, device=S.device).masked_fill_(pad, float("-inf"))  # [T, s]
        bias = pad_bias.expand(b, T, s).clone()  # [b, T, s]: -inf where a member may not be picked
        # A tile with fewer real members than d runs out of candidates (only with mask_selected): from then
        # on it repeats a real member. Only then is the per-pick check needed (known from the grid: no sync).
        rows, picks = [], []
        excess = torch.empty_like(S)  # [b, T, s, s] reused by every pick
        for k in range(d):
            if k == 0:
                gain = S.sum(-1)  # [b, T, s] row sums
            else:  # sum_i max(S[v, i], m_i) = sum_i relu(S[v, i] - m_i) + sum_i m_i, and the last sum is
                # the same for every candidate v: the same argmax, in two passes over S instead of three
                gain = torch.maximum(S, coverage.unsqueeze(-2), out=excess).sum(-1)  # [b, T, s]
            allowed = bias
            if self.mask_selected and k >= fewest:
                exhausted = torch.isneginf(bias).all(-1, keepdim=True)  # [b, T, 1]
                allowed = torch.where(exhausted, pad_bias, bias)  # exhausted tiles repeat a real member
            pick = (gain + allowed).argmax(-1, keepdim=True)  # [b, T, 1]
            if self.mask_selected:
                bias.scatter_(-1, pick, float("-inf"))
            row = _rows(S, pick)  # [b, T, 1, s]
            coverage = row.squeeze(-2) if k == 0 else torch.maximum(coverage, row.squeeze(-2))  # [b, T, s]
            rows.append(row)
            picks.append(pick)
        return torch.cat(picks, dim=-1), torch.cat(rows, dim=-2)  # [b, T, d], [b, T, d, s]

    def _matrices(self, L: Tensor, dst: Tensor, layout: Tensor, N: int) -> MergePlan:
        """The soft plan from the destinations' similarity rows ``L [B, T, d, s]`` and their positions ``dst [B, M]``."""
        B, T, d, s = L.shape
        A = torch.softmax(L / self.temperature, dim=-2)  # [B, T, d, s], each column sums to 1
        A = A * (layout != N).to(A.dtype).view(1, T, 1, s)  # padding columns get zero weight
        W = A / A.sum(-1, keepdim=True).clamp_min(torch.finfo(A.dtype).tiny)  # [B, T, d, s]
        if self.unmerge_matrix == "pinv":
            U = torch.linalg.pinv(W)  # [B, T, s, d]
        else:
            U = A.transpose(-1, -2)  # [B, T, s, d]
        return MergePlan.soft(W, U, dst, N, tile_tokens=layout)

    # ------------------------------------------------------------------ internals
    def _fewest_members(self, grid: Grid) -> int:
        """Real tokens in the smallest tile of :meth:`tile_layout` (the last stripe of a group, or the
        bottom-right tile of the last group of frames)."""
        frames, H, W = grid_frames(grid)
        depth = self.tile_frames
        last = frames - (-(-frames // depth) - 1) * depth  # frames of the last group
        if self.locality == "stripes":
            s = self.stripe_length(grid)
            sizes = {last * H * W} | ({depth * H * W} if frames > last else set())  # tokens of a group
            return min(n - (-(-n // s) - 1) * s for n in sizes)
        t = self.tile_side(grid)
        return last * (H - (-(-H // t) - 1) * t) * (W - (-(-W // t) - 1) * t)

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


def _similarities(x: Tensor, layout: Tensor) -> Tensor:
    """Cosine similarities inside every tile, ``S = X X^T`` of the unit features ``X = F.normalize(x.float(), eps)``
    in tile layout.

    The raw rows are gathered once and their Gram matrix is scaled by the norms on its diagonal
    (``S_ij = <x_i, x_j> / (max(|x_i|, eps) max(|x_j|, eps))``): no normalised copy of ``x``, no norm pass over it.

    Args:
        x: ``[B, N, C]`` features (any float dtype).
        layout: ``[T, s]`` token positions, ``N`` for padding.

    Returns:
        ``[B, T, s, s]`` fp32; rows and columns of padding members, and of all-zero tokens, are zero (never NaN).
    """
    B, N, C = x.shape
    T, s = layout.shape
    flat = layout.flatten()  # [T*s]
    X = take_rows(x, flat.clamp(max=N - 1)).float()  # [B, T*s, C]; padding reads a real row, zeroed below
    if flat.numel() > N:  # every token is in one tile, so more slots than tokens means padding
        X.masked_fill_((flat == N).view(1, -1, 1), 0)
    X = X.view(B, T, s, C)  # [B, T, s, C]
    S = X @ X.transpose(-1, -2)  # [B, T, s, s] dot products
    norm = S.diagonal(dim1=-2, dim2=-1).sqrt().clamp_min(_EPS)  # [B, T, s] (a copy, so S may change below)
    return S.div_(norm.unsqueeze(-1)).div_(norm.unsqueeze(-2))


def _rows(S: Tensor, local: Tensor) -> Tensor:
    """``S[b, t, local[b, t, j], :]``: the rows ``local [b, T, k]`` of every tile's similarities ``S [b, T, s, s]``,
    as ``[b, T, k, s]``."""
    return S.gather(-2, local.unsqueeze(-1).expand(-1, -1, -1, S.shape[-1]))


def _positions(layout: Tensor, local: Tensor) -> Tensor:
    """``[b, T*d]`` token positions of the member indices ``local [b, T, d]`` of the tiles ``layout [T, s]``."""
    b, T, d = local.shape
    return layout.expand(b, T, layout.shape[1]).gather(-1, local).reshape(b, T * d)
