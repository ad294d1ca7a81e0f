"""``ssm``: similarity-prioritized structure merging, the early (structure) phase of SDTM (CVPR 2025).

Early in denoising a diffusion transformer lays out low-frequency structure, so ``k x k`` windows whose tokens are
already alike are merged into one slot each, the most self-similar windows first (plus a persistence prior from
merge streaks). The algorithm and where it follows or leaves the authors' code: docs/strategies.md, "ssm".

Example:
    >>> import torch
    >>> from tomerge import MergeContext
    >>> x = torch.randn(2, 64, 8)
    >>> plan = SSM(round_windows=1).plan(x, MergeContext(grid=(8, 8), ratio=0.5))
    >>> plan.num_removed                  # floor(32 / 3) = 10 windows of 4 tokens -> 30 removed
    30
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import ClassVar

import torch
from torch import Tensor

from tomerge.context import Grid, MergeContext, grid_frames
from tomerge.options import check_bool, check_int, check_number
from tomerge.plan import MergePlan, unit_rows
from tomerge.strategy import MergeStrategy

EPS = 1e-6  # feature-norm epsilon: an all-zero token normalises to 0, not NaN
STAT_EPS = 1e-12  # floor for the mean of a per-token statistic (all-zero rows stay 0)


def window_tokens(grid: Grid, window: int, device: torch.device | str = "cpu", temporal_window: int = 1) -> Tensor:
    """Token positions of every full window of a raster-order grid.

    Args:
        grid: ``(H, W)`` or ``(T, H, W)`` token grid (a 2-D grid is one frame).
        window: window side ``k`` in space.
        device: device of the result.
        temporal_window: window depth ``kt`` in frames (1: windows never span frames).

    Returns:
        ``[nW, K]`` long, ``nW = (T // kt) * (H // k) * (W // k)`` windows in raster order (frame block, row,
        column), each listing its ``K = kt * k * k`` token positions in raster order (frame, row, column;
        so column 0 is the top-left token of the window's first frame). ``nW`` is 0 when the grid is smaller
        than one window.

    Example:
        >>> window_tokens((2, 4), 2).tolist()
        [[0, 1, 4, 5], [2, 3, 6, 7]]
        >>> window_tokens((2, 2, 2), 2, temporal_window=2).tolist()
        [[0, 1, 2, 3, 4, 5, 6, 7]]
    """
    T, H, W = grid_frames(grid)
    k, kt = window, temporal_window
    Tw, Hw, Ww = T // kt, H // k, W // k
    pos = torch.arange(T * H * W, device=device).view(T, H, W)[: Tw * kt, : Hw * k, : Ww * k]  # [Tw*kt, Hw*k, Ww*k]
    pos = pos.reshape(Tw, kt, Hw, k, Ww, k).permute(0, 2, 4, 1, 3, 5)  # [Tw, Hw, Ww, kt, k, k]
    return pos.reshape(Tw * Hw * Ww, kt * k * k)  # [nW, K]


def window_offsets(grid: Grid, window: int, device: torch.device | str = "cpu", temporal_window: int = 1) -> Tensor:
    """``[K]`` raster offsets of a window's members from its first (top-left, first-frame) token, in the member
    order of :func:`window_tokens`.

    Example:
        >>> window_offsets((3, 4, 5), 2, temporal_window=2).tolist()
        [0, 1, 5, 6, 20, 21, 25, 26]
    """
    _, H, W = grid_frames(grid)
    dt, dy, dx = torch.meshgrid(torch.arange(temporal_window, device=device), torch.arange(window, device=device),
                                torch.arange(window, device=device), indexing="ij")  # [kt, k, k] each
    return ((dt * H + dy) * W + dx).flatten()  # [K]


def normalized_stat(stat: Tensor, batch: int) -> Tensor:
    """``stat / mean(stat)`` per sample, in fp32, eps-safe (an all-zero row stays 0).

    Args:
        stat: ``[B, N]`` or ``[1, N]`` non-negative per-token statistic (streak, received attention).
        batch: ``B``; a ``[1, N]`` statistic is expanded to it.

    Returns:
        ``[B, N]`` float32.
    """
    stat = stat.float().expand(batch, -1)  # [B, N]
    return stat / stat.mean(dim=1, keepdim=True).clamp_min(STAT_EPS)


class SpaceTimeWindows:
    """Window helpers of the strategies with ``window`` (side ``k``) and ``temporal_window`` (``kt`` frames)
    options: SSM, and IDM's local variant."""

    @property
    def window_size(self) -> int:
        """``K = kt * k * k``, tokens per window (``k * k`` with the default ``temporal_window=1``)."""
        return self.temporal_window * self.window * self.window

    @property
    def window_label(self) -> str:
        """``"kxk"``, or ``"ktxkxk"`` with a temporal window, for messages."""
        space = f"{self.window}x{self.window}"
        return space if self.temporal_window == 1 else f"{self.temporal_window}x{space}"

    def windows(self, grid: Grid, device: torch.device | str = "cpu") -> Tensor:
        """``[nW, K]``: :func:`window_tokens` with this strategy's window sizes."""
        return window_tokens(grid, self.window, device, self.temporal_window)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SSM(SpaceTimeWindows, MergeStrategy):
    """Similarity-prioritized structure merging (SDTM, CVPR 2025; docs/strategies.md, "ssm").

    Args:
        window: window side ``k`` (``k x k`` windows, ``K = k * k`` tokens each); at least 2.
        temporal_window: window depth ``kt`` in frames on a ``(T, H, W)`` grid (``kt x k x k`` windows,
            ``K = kt * k * k``); 1 (default): windows per frame. A 2-D grid is one frame: with ``kt > 1`` it has
            no full window (the cap warns, nothing merges).
        alpha_s: weight of the persistence prior (uses ``ctx.streak`` when given); ``>= 0``.
        round_windows: round the number of merged windows down to a multiple of this (authors'
            code: 16); 1 disables. Never rounds a positive count down to 0.
        include_self: score windows by the mean over all ``K * K`` similarity pairs, the diagonal included
            (the authors' code), instead of the ``K * (K - 1)`` off-diagonal pairs (the paper; default).
        ratio: default ratio when applied alone (planning uses ``ctx.ratio``).
    """

    name: ClassVar[str] = "ssm"

    window: int = 2
    temporal_window: int = 1
    alpha_s: float = 0.05
    round_windows: int = 16
    include_self: bool = False

    @property
    def uses_streak(self) -> bool:
        return True

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int(self.window, "window", "ssm", low=2, note="k x k windows")
        check_int(self.temporal_window, "temporal_window", "ssm", low=1, note="frames per window")
        check_number(self.alpha_s, "alpha_s", "ssm", low=0, note="0 disables the prior")
        check_int(self.round_windows, "round_windows", "ssm", low=1, note="1 disables rounding")
        check_bool(self.include_self, "include_self", "ssm")

    # ------------------------------------------------------------------ pure helpers
    def num_windows(self, num_tokens: int, num_full_windows: int, ctx: MergeContext) -> int:
        """How many windows to merge: ``floor(r / (K - 1))``, capped, then rounded.

        Args:
            num_tokens: ``N``.
            num_full_windows: ``nW``, the candidates.
            ctx: gives the ratio.

        Returns:
            ``n_win`` with ``0 <= n_win <= nW``. Warns when the cap ``nW`` applies.
        """
        r = ctx.tokens_to_remove(num_tokens)
        n_win = r // (self.window_size - 1)
        if n_win > num_full_windows:
            warnings.warn(
                f"ssm: ratio {ctx.ratio} asks to remove {r} of {num_tokens} tokens ({n_win} windows), but the "
                f"grid {ctx.grid} has only {num_full_windows} full {self.window_label} windows; capping "
                f"at {num_full_windows} windows ({num_full_windows * (self.window_size - 1)} tokens removed)",
                stacklevel=4,  # the caller of MergeStrategy.plan
            )
            n_win = num_full_windows
        rounded = n_win - n_win % self.round_windows
        return rounded if rounded > 0 else n_win

    def window_scores(self, x: Tensor, ctx: MergeContext) -> Tensor:
        """Score of every full window: mean cosine similarity (off-diagonal, or all ``K * K`` pairs with
        ``include_self``) + persistence prior.

        Args:
            x: ``[B, N, C]`` token features (any float dtype; computed in fp32).
            ctx: gives the grid and, optionally, ``streak [B, N]``.

        Returns:
            ``[B, nW]`` float32 scores, windows in raster order.
        """
        B = x.shape[0]
        K = self.window_size
        windows = self.windows(ctx.grid, x.device)  # [nW, K]
        (xw,) = unit_rows(x, windows.flatten(), eps=EPS)  # [B, nW*K, C] unit rows
        xw = xw.view(B, *windows.shape, x.shape[-1])  # [B, nW, K, C]
        gram = xw @ xw.transpose(-1, -2)  # [B, nW, K, K]
        if self.include_self:
            score = gram.sum(dim=(-1, -2)) / (K * K)  # [B, nW], the diagonal (1 per nonzero token) included
        else:
            off_diagonal = ~torch.eye(K, dtype=torch.bool, device=x.device)  # [K, K]
            score = (gram * off_diagonal).sum(dim=(-1, -2)) / (K * (K - 1))  # [B, nW]
        if ctx.streak is not None and self.alpha_s > 0:
            prior = normalized_stat(ctx.streak, B)[:, windows].mean(dim=-1)  # [B, nW]
            score = score + self.alpha_s * prior
        return score

    # ------------------------------------------------------------------ the strategy
    def select_destinations(self, x: Tensor, ctx: MergeContext) -> Tensor:
        """Selects the windows to merge.

        Args:
            x: ``[B, N, C]`` token features.
            ctx: the merge context.

        Returns:
            ``[B, M]`` long slot representatives: the top-left tokens of the ``n_win`` selected windows
            (raster order), then every token outside them (raster order). ``M = N - n_win * (K - 1)``.
        """
        B, N, _ = x.shape
        K = self.window_size
        windows = self.windows(ctx.grid, x.device)  # [nW, K]
        n_win = self.num_windows(N, windows.shape[0], ctx)
        if n_win == 0:
            return torch.arange(N, device=x.device).expand(B, N)  # [B, N]
        score = self.window_scores(x, ctx)  # [B, nW]
        # Stable descending sort: ties go to the first window in raster order (deterministic).
        chosen = torch.sort(score, dim=1, descending=True, stable=True).indices[:, :n_win]  # [B, n_win]
        chosen = chosen.sort(dim=1).values  # [B, n_win], raster order of windows
        members = windows[chosen]  # [B, n_win, K]
        in_window = torch.zeros(B, N, dtype=torch.int8, device=x.device)
        in_window.scatter_(1, members.flatten(1), 1)  # [B, N], 1 inside a selected window
        # Stable sort puts the tokens outside selected windows first, in raster order.
        singles = torch.sort(in_window, dim=1, stable=True).indices[:, : N - n_win * K]  # [B, N - n_win*K]
        return torch.cat([members[..., 0], singles], dim=1)  # [B, M]

    def merge_matrix(self, x: Tensor, dst: Tensor, ctx: MergeContext) -> MergePlan:
        """Builds the hard plan from :meth:`select_destinations`' output.

        Args:
            x: ``[B, N, C]`` token features (only the shape is used).
            dst: ``[B, M]`` as returned by :meth:`select_destinations`.
            ctx: the merge context.

        Returns:
            A hard :class:`MergePlan` with ``M`` slots (the identity plan when no window is merged).
        """
        B, N, _ = x.shape
        K = self.window_size
        M = dst.shape[1]
        n_win = (N - M) // (K - 1)
        if n_win == 0:
            return MergePlan.identity(B, N, device=x.device)
        offsets = window_offsets(ctx.grid, self.window, x.device, self.temporal_window)  # [K] from the first token
        members = dst[:, :n_win, None] + offsets  # [B, n_win, K]
        window_slots = torch.arange(n_win, device=x.device).view(1, n_win, 1).expand(B, n_win, K)  # [B, n_win, K]
        single_slots = torch.arange(n_win, M, device=x.device).expand(B, M - n_win)  # [B, M - n_win]
        assign = torch.empty(B, N, dtype=torch.long, device=x.device)
        assign.scatter_(1, members.flatten(1), window_slots.flatten(1))  # [B, N]
        assign.scatter_(1, dst[:, n_win:], single_slots)  # [B, N]
        return MergePlan.hard(assign, dst)
