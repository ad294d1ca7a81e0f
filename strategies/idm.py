"""``idm``: inattentive-prioritized detail merging, the late (detail) phase of SDTM.

Reference: H. Fang, S. Tang, J. Cao, E. Zhang, F. Tang, T.-Y. Lee, "Attend to Not Attended:
Structure-then-Detail Token Merging for Post-training DiT Acceleration", CVPR 2025
(arXiv:2505.11707, code: https://github.com/ICTMCG/SDTM).

"Attend to not attended": late in denoising the model refines detail where it looks, so tokens that
receive little attention can borrow the computation of a similar, attended token. Per batch element:

1. Destinations: split the grid into non-overlapping ``k x k`` windows (``K = k * k``). In every full
   window one token is the destination:
   * ``variant="attention"`` (paper, default): the token with the highest received attention
     ``ctx.received_attention [B, N]`` (ties: the first in raster order);
   * ``variant="streak"`` (authors' 2025 release, which drops attention maps): the token with the
     longest merge streak ``ctx.streak [B, N]`` (ties: the first; without a streak, the top-left).
   All other tokens are sources, including those in rows/columns left over when ``H`` or ``W`` is not
   divisible by ``k``.
2. Inattentiveness priority ``P = -a / mean(a) + alpha_d * streak / mean(streak)`` (means per sample,
   eps-safe; the streak term is 0 without ``ctx.streak``; for the streak variant ``a`` is the received
   attention when given, zeros otherwise).
3. The ``r = int(N * ratio)`` sources with the highest priority (ties: raster order) merge into their
   most cosine-similar destination (fp32, eps-normalised features; global over all destinations as in
   ToMeSD's bipartite step). ``r`` is capped at the number of sources, with a warning.
   ``local=True`` restricts each source to its own window's destination. Leftover tokens outside full
   windows have no window, so with ``local=True`` they never merge (they count as unmergeable for the
   cap).
4. Merge = mean of a destination and its merged sources; unmerge copies it back. Slots are ordered
   ``[destinations in window order..., unmerged sources in raster order...]``.

In the SDTM schedule IDM merges only the MLP input; attention runs at full length, which is where the
received attention comes from. Everything is vectorised (no loop over tokens or windows, no host sync).

Example:
    >>> import torch
    >>> from tomerge import MergeContext
    >>> x, a = torch.randn(2, 16, 8), torch.rand(2, 16)
    >>> plan = IDM().plan(x, MergeContext(grid=(4, 4), ratio=0.5, received_attention=a))
    >>> plan.num_removed
    8
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import ClassVar

import torch
from torch import Tensor

from tomerge.context import MergeContext
from tomerge.plan import MergePlan, unit_rows
from tomerge.strategy import MergeStrategy

from .ssm import EPS, normalized_stat, window_tokens

VARIANTS = ("attention", "streak")


@dataclasses.dataclass(frozen=True, kw_only=True)
class IDM(MergeStrategy):
    """Inattentive-prioritized detail merging (SDTM, CVPR 2025); see the module docstring.

    Args:
        window: window side ``k``; one destination per full ``k x k`` window; at least 2.
        alpha_d: weight of the streak term of the priority; ``>= 0``.
        variant: ``"attention"`` (paper: destination = most attended token of the window; needs
            ``ctx.received_attention``) or ``"streak"`` (released code: longest merge streak).
        local: restrict every source to its own window's destination instead of global matching.
        ratio: default ratio when applied alone (planning uses ``ctx.ratio``).
    """

    name: ClassVar[str] = "idm"
    default_sublayers: ClassVar[frozenset[str]] = frozenset({"mlp"})
    uses_streak: ClassVar[bool] = True

    window: int = 2
    alpha_d: float = 0.05
    variant: str = "attention"
    local: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 2:
            raise ValueError(f"idm: window must be an int >= 2 (k x k windows), got {self.window!r}")
        if (isinstance(self.alpha_d, bool) or not isinstance(self.alpha_d, (int, float))
                or not math.isfinite(self.alpha_d) or self.alpha_d < 0):
            raise ValueError(f"idm: alpha_d must be a finite number >= 0 (0 ignores streaks), got {self.alpha_d!r}")
        if self.variant not in VARIANTS:
            raise ValueError(
                f"idm: variant must be one of {VARIANTS} ('attention' = paper, 'streak' = authors' released "
                f"code), got {self.variant!r}"
            )
        if not isinstance(self.local, bool):
            raise ValueError(f"idm: local must be a bool, got {self.local!r}")

    @property
    def needs(self) -> frozenset[str]:  # type: ignore[override]
        """``{"received_attention"}`` for the attention variant, nothing for the streak variant."""
        return frozenset({"received_attention"}) if self.variant == "attention" else frozenset()

    # ------------------------------------------------------------------ pure helpers
    def priority(self, ctx: MergeContext, batch: int, num_tokens: int, device: torch.device) -> Tensor:
        """Inattentiveness priority ``P = -a / mean(a) + alpha_d * streak / mean(streak)``.

        Args:
            ctx: gives ``received_attention`` and ``streak`` (either may be ``None``: term 0).
            batch, num_tokens: ``B`` and ``N``.
            device: device of the result.

        Returns:
            ``[B, N]`` float32; higher merges first.
        """
        P = torch.zeros(batch, num_tokens, device=device)  # [B, N]
        if ctx.received_attention is not None:
            P = P - normalized_stat(ctx.received_attention, batch)
        if ctx.streak is not None and self.alpha_d > 0:
            P = P + self.alpha_d * normalized_stat(ctx.streak, batch)
        return P

    def num_sources(self, num_tokens: int, num_windows: int) -> int:
        """How many tokens may merge: every non-destination (only those inside windows if ``local``)."""
        if num_windows == 0:
            return 0
        if self.local:
            return num_windows * (self.window * self.window - 1)
        return num_tokens - num_windows

    # ------------------------------------------------------------------ the strategy
    def select_destinations(self, x: Tensor, ctx: MergeContext) -> Tensor:
        """One destination per full window: the most attended token (or longest streak).

        Args:
            x: ``[B, N, C]`` token features (only the shape is used).
            ctx: gives the grid and ``received_attention`` / ``streak``.

        Returns:
            ``[B, nW]`` long token positions, one per full window, windows in raster order.
        """
        B, N, _ = x.shape
        windows = window_tokens(ctx.grid, self.window, x.device)  # [nW, K]
        if self.variant == "attention":
            if ctx.received_attention is None:
                raise ValueError(
                    "idm (variant='attention') needs ctx.received_attention [B, N]; pass it, or use "
                    "variant='streak'"
                )
            key = ctx.received_attention.float().expand(B, N)  # [B, N]
        elif ctx.streak is not None:
            key = ctx.streak.float().expand(B, N)  # [B, N]
        else:
            key = torch.zeros(B, N, device=x.device)  # [B, N]: every tie goes to the top-left token
        best = key[:, windows].argmax(dim=-1)  # [B, nW], first maximum on ties
        return windows[torch.arange(windows.shape[0], device=x.device), best]  # [B, nW]

    def merge_matrix(self, x: Tensor, dst: Tensor, ctx: MergeContext) -> MergePlan:
        """Merges the ``r`` highest-priority sources into their most similar destination.

        Args:
            x: ``[B, N, C]`` token features (similarities in fp32).
            dst: ``[B, nW]`` destinations, one per full window in window order (as returned by
                :meth:`select_destinations`).
            ctx: the merge context.

        Returns:
            A hard :class:`MergePlan` removing ``min(r, #sources)`` tokens (identity when none).
        """
        B, N, C = x.shape
        K = self.window * self.window
        D = dst.shape[1]
        r = ctx.tokens_to_remove(N)
        n_src = self.num_sources(N, D)
        if r > n_src:
            where = "inside full windows " if self.local else ""
            warnings.warn(
                f"idm: ratio {ctx.ratio} asks to remove {r} of {N} tokens, but the grid {ctx.grid} with "
                f"{self.window}x{self.window} windows has only {n_src} sources {where}(at most 1 - 1/{K} of the "
                f"tokens); capping r at {n_src}",
                stacklevel=4,  # the caller of MergeStrategy.plan
            )
            r = n_src
        if r == 0:
            return MergePlan.identity(B, N, device=x.device)

        windows = window_tokens(ctx.grid, self.window, x.device)  # [nW, K]
        window_of = torch.full((N,), -1, dtype=torch.long, device=x.device)  # [N], -1 outside windows
        window_of[windows] = torch.arange(D, device=x.device).view(D, 1).expand(D, K)
        is_dst = torch.zeros(B, N, dtype=torch.bool, device=x.device).scatter_(1, dst, True)  # [B, N]
        eligible = ~is_dst  # [B, N]
        if self.local:
            eligible = eligible & (window_of >= 0)

        # Rank by priority (stable: ties in raster order), then move non-eligible tokens to the back.
        order = torch.sort(self.priority(ctx, B, N, x.device), dim=1, descending=True, stable=True).indices  # [B, N]
        blocked = (~eligible.gather(1, order)).to(torch.int8)  # [B, N], in priority order
        order = order.gather(1, torch.sort(blocked, dim=1, stable=True).indices)  # [B, N]
        merged = order[:, :r]  # [B, r]

        if self.local:
            merged_into = window_of[merged]  # [B, r], own window = index into dst
        else:
            src_feat, dst_feat = unit_rows(x, merged, dst, eps=EPS)  # [B, r, C], [B, D, C] unit rows
            merged_into = (src_feat @ dst_feat.transpose(1, 2)).argmax(dim=-1)  # [B, r], first max on ties

        taken = is_dst.to(torch.int8).scatter_(1, merged, 1)  # [B, N], 1 = destination or merged
        unmerged = torch.sort(taken, dim=1, stable=True).indices[:, : N - D - r]  # [B, U], raster order
        return MergePlan.from_matching(dst, unmerged, merged, merged_into, N)
