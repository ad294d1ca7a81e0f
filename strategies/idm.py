"""``idm``: inattentive-prioritized detail merging, the late (detail) phase of SDTM (CVPR 2025).

"Attend to not attended": late in denoising the model refines detail where it looks, so tokens that receive little
attention merge into a similar, attended window destination. Variants ``"attention"`` (the paper) and ``"streak"``
(the authors' release); the algorithm and where it follows or leaves the authors' code: docs/strategies.md, "idm".
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import ClassVar

import torch
from torch import Tensor

from tomerge.context import Grid, MergeContext
from tomerge.options import check_bool, check_choice, check_int, check_number
from tomerge.plan import MergePlan, unit_rows
from tomerge.strategy import MergeStrategy

from .ssm import EPS, SpaceTimeWindows, normalized_stat, window_tokens

VARIANTS = ("attention", "streak")
PLAN_FROM = ("sublayer", "block_input")
RELEASE_ROUND_TOKENS = 16  # the authors' release: reduce_num // 16 * 16 (TR_SDTM.py, FIDM)


@dataclasses.dataclass(frozen=True, kw_only=True)
class IDM(SpaceTimeWindows, MergeStrategy):
    """Inattentive-prioritized detail merging (SDTM, CVPR 2025; docs/strategies.md, "idm").

    Args:
        window: window side ``k``; one destination per full ``k x k`` window; at least 2.
        temporal_window: window depth ``kt`` in frames on a ``(T, H, W)`` grid (``kt x k x k`` windows); 1
            (default): windows per frame. A 2-D grid is one frame: with ``kt > 1`` it has no full window.
        alpha_d: weight of the streak term of the priority (attention variant); ``>= 0``.
        variant: ``"attention"`` (paper: destination = most attended token of the window, sources by
            inattentiveness; needs ``ctx.received_attention``) or ``"streak"`` (released code: destination
            = longest merge streak, sources by similarity to their best destination).
        local: restrict every source to its own window's destination instead of global matching.
        round_tokens: round the number of removed tokens down to a multiple of this (never a positive
            count to 0); ``None``: the variant's default (16 for ``"streak"`` as the release, 1 = off for
            ``"attention"``).
        plan_from: the tensor attached hooks plan from (:attr:`plan_input`): ``"block_input"`` (default: the
            block's input hidden states, before its norm; the closest the hooks reach to the authors' ``norm1``
            output when attention is not merged) or ``"sublayer"`` (the input of the first merged sublayer:
            the MLP input when only the MLP is merged).
        ratio: default ratio when applied alone (planning uses ``ctx.ratio``).
    """

    name: ClassVar[str] = "idm"

    window: int = 2
    temporal_window: int = 1
    alpha_d: float = 0.05
    variant: str = "attention"
    local: bool = False
    round_tokens: int | None = None
    plan_from: str = "block_input"

    def __post_init__(self) -> None:
        super().__post_init__()
        what = "idm"
        check_int(self.window, "window", what, low=2, note="k x k windows")
        check_int(self.temporal_window, "temporal_window", what, low=1, note="frames per window")
        check_number(self.alpha_d, "alpha_d", what, low=0, note="0 ignores streaks")
        check_choice(self.variant, "variant", what, VARIANTS,
                     note="'attention' = paper, 'streak' = authors' released code")
        check_bool(self.local, "local", what)
        check_int(self.round_tokens, "round_tokens", what, low=1, optional=True, note="1 disables rounding")
        if self.round_tokens is None:  # the variant's default
            object.__setattr__(self, "round_tokens", RELEASE_ROUND_TOKENS if self.variant == "streak" else 1)
        check_choice(self.plan_from, "plan_from", what, PLAN_FROM)

    @property
    def default_sublayers(self) -> frozenset[str]:
        return frozenset({"mlp"})

    @property
    def uses_streak(self) -> bool:
        return True

    @property
    def needs(self) -> frozenset[str]:
        """``{"received_attention"}`` for the attention variant, nothing for the streak variant."""
        return frozenset({"received_attention"}) if self.variant == "attention" else frozenset()

    @property
    def plan_input(self) -> str:
        """The tensor attached hooks plan from (:attr:`MergeStrategy.plan_input`): ``plan_from``."""
        return self.plan_from

    # ------------------------------------------------------------------ pure helpers
    def priority(self, ctx: MergeContext, batch: int, num_tokens: int, device: torch.device) -> Tensor:
        """Inattentiveness priority ``P = -a / mean(a) + alpha_d * streak / mean(streak)`` (attention variant).

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
            return num_windows * (self.window_size - 1)
        return num_tokens - num_windows

    def num_removed(self, ctx: MergeContext, num_tokens: int, num_windows: int) -> int:
        """``r = int(N * ratio)``, capped at the number of sources (with a warning), then rounded down to a
        multiple of ``round_tokens`` unless that gives 0.

        Example:
            >>> IDM(variant="streak").num_removed(MergeContext(grid=(16, 16), ratio=0.3), 256, 64)  # 76 -> 64
            64
        """
        K = self.window_size
        r = ctx.tokens_to_remove(num_tokens)
        n_src = self.num_sources(num_tokens, num_windows)
        if r > n_src:
            where = "inside full windows " if self.local else ""
            warnings.warn(
                f"idm: ratio {ctx.ratio} asks to remove {r} of {num_tokens} tokens, but the grid {ctx.grid} with "
                f"{self.window_label} windows has only {n_src} sources {where}(at most 1 - 1/{K} of the "
                f"tokens); capping r at {n_src}",
                stacklevel=4,  # the caller of MergeStrategy.plan
            )
            r = n_src
        rounded = r - r % self.round_tokens
        return rounded if rounded > 0 else r

    def merged_tokens(self, plan: MergePlan, ctx: MergeContext) -> Tensor:
        """``[B, N]`` bool: the tokens this plan counts as merged (merge streaks, feature cache).

        As the authors' ``FIDM`` (its counter ``last_independent`` and its cache blend both take these):
        every destination of a full window, whether or not a source merged into it, and every merged
        source; unmerged sources are not.
        """
        D = self.windows(ctx.grid, plan.dst.device).shape[0]
        if plan.is_identity or D == 0:
            return torch.zeros(plan.dst.shape, dtype=torch.bool, device=plan.dst.device)
        return plan.slot_of_token < D  # slots 0..D-1 are the destinations' (from_matching order)

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
        windows = self.windows(ctx.grid, x.device)  # [nW, K]
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
        """Merges ``r`` sources into their most similar destination: the highest-priority ones (attention
        variant) or the most similar ones (streak variant).

        Args:
            x: ``[B, N, C]`` token features (similarities in fp32).
            dst: ``[B, nW]`` destinations, one per full window in window order (as returned by
                :meth:`select_destinations`).
            ctx: the merge context.

        Returns:
            A hard :class:`MergePlan` removing :meth:`num_removed` tokens (identity when none).
        """
        B, N, C = x.shape
        K = self.window_size
        D = dst.shape[1]
        r = self.num_removed(ctx, N, D)
        if r == 0:
            return MergePlan.identity(B, N, device=x.device)

        windows = self.windows(ctx.grid, x.device)  # [nW, K]
        window_of = torch.full((N,), -1, dtype=torch.long, device=x.device)  # [N], -1 outside windows
        window_of[windows] = torch.arange(D, device=x.device).view(D, 1).expand(D, K)
        is_dst = torch.zeros(B, N, dtype=torch.bool, device=x.device).scatter_(1, dst, True)  # [B, N]
        eligible = ~is_dst  # [B, N]
        if self.local:
            eligible = eligible & (window_of >= 0)

        if self.variant == "streak":
            # ToMe-style: every token's similarity to its best (or, local, its own window's) destination.
            every = torch.arange(N, device=x.device)
            feat, dst_feat = unit_rows(x, every, dst, eps=EPS)  # [B, N, C], [B, D, C] unit rows
            sim = feat @ dst_feat.transpose(1, 2)  # [B, N, D]
            if self.local:
                best_into = window_of.clamp_min(0).expand(B, N)  # [B, N], leftovers are not eligible
                best_sim = sim.gather(2, best_into.unsqueeze(-1)).squeeze(-1)  # [B, N]
            else:
                best_sim, best_into = sim.max(dim=-1)  # [B, N] each, first maximum on ties
            key = best_sim.masked_fill(~eligible, -torch.inf)  # [B, N]
            order = torch.sort(key, dim=1, descending=True, stable=True).indices  # [B, N], ties: raster order
            merged = order[:, :r]  # [B, r]
            merged_into = best_into.gather(1, merged)  # [B, r]
        else:
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

