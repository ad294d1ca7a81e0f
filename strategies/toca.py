"""``toca``: token-wise feature caching (ToCa), and ``fresh_tokens``, the strategy that picks the tokens it recomputes.

ToCa caches every sublayer's output at full length on its **fresh steps** and, on the steps in between, recomputes
only a scored fraction of the tokens of each block's feed-forward, taking the cached output for the others; the
attention is not computed there at all (its module factor is 0 in the authors' final DiT scheduler). In tomerge's
terms, on a cached step of block ``l``:

* the attention's merge points return what their module returned on the last fresh step (``Decision.reuse_outputs``;
  a joint attention's text tokens included);
* the feed-forward runs on the ``k`` **fresh** tokens :class:`FreshTokens` selects (an exact selection,
  :meth:`~tomerge.MergePlan.selection`: row gathers, so every fresh token is computed from its own input), the other tokens take their
  cached output (``Decision.cache_weight = 0``), and the combined output becomes the cache
  (``Decision.cache_outputs``), as the authors' ``update_cache`` writes the fresh tokens into it.

The fresh fraction of block ``l`` (of ``L``) at denoising step ``t`` (of ``S``), from the authors' ``"ToCa"`` ratio
scheduler with their counting of steps (``s = S - 1 - t``, from the last step down):
``fresh_ratio * (1 + 0.8 - 1.6 l / (L - 1)) * (1 + 0.4 - 0.8 s / S) * (1 + 0.6 * 2.5)``; more tokens early in
depth and late in the trajectory, the attention's share moved to the feed-forward. Fresh steps are the first step
and those with ``s % interval == 0``.

:class:`FreshTokens` scores token ``i`` by the attention it received on the last fresh step (``ctx.received_attention``,
L2-normalised over the tokens: ToCa's ``s1``), plus ``staleness_weight * streak_i / interval`` (``s3``: the steps
since the token was last fresh, ``ctx.streak`` counted per block), then gives the highest-scored token of every
``window x window`` cell of the grid a bonus of ``window_bonus`` times its score (``s4``, spread over the image),
and keeps the ``k`` best. Used alone it is token skipping: the tokens it does not select skip the sublayer
(output 0).

Reference: C. Zou, X. Liu, T. Liu, S. Huang, L. Zhang, "Accelerating Diffusion Transformers with Token-wise Feature
Caching", ICLR 2025, arXiv:2410.05317 (code: https://github.com/Shenyi-Z/ToCa, ``DiT-ToCa``). The defaults are its
DiT settings (``fresh_ratio=0.07``, ``fresh_threshold=4``, ``soft_fresh_weight=0.25``, ``ratio_scheduler="ToCa"``,
bonus 0.6 on 2 x 2 cells). Deviations (docs/schedules.md): the attention's received attention is tomerge's probe
(averaged over heads and up to 64 strided queries, where ToCa sums the full map over queries: the same ranking up to
the probe's sampling); the cache holds the sublayer outputs before the block's gates, so the current step's gates
apply, as in ToCa; ``k = N - int(N * (1 - fraction))`` rounds the fresh count up where ToCa rounds it down.

Example:
    >>> from tomerge.schedule import Where
    >>> s = ToCa()
    >>> [s.is_fresh(t, 20) for t in range(8)]
    [True, False, False, True, False, False, False, True]
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from tomerge.context import MergeContext, grid_frames
from tomerge.options import check_int, check_number
from tomerge.plan import MergePlan
from tomerge.schedule import Decision, Schedule, Where
from tomerge.strategy import MergeStrategy

FRESH, CACHED = "fresh", "toca"  # labels: a fresh step's block calls, a cached step's


@dataclasses.dataclass(frozen=True, kw_only=True)
class FreshTokens(MergeStrategy):
    """Selects the tokens a sublayer recomputes by ToCa's score; the others skip it (see the module docstring).

    Args:
        staleness_weight: weight of the steps since a token was last selected (ToCa's ``soft_fresh_weight``).
        staleness_scale: those steps are divided by it (ToCa's ``fresh_threshold``, the fresh-step interval).
        window: the side of the grid cells whose best token gets the bonus (per frame on a 3-D grid).
        window_bonus: the bonus, a fraction of that token's score (0: none).
    """

    name: ClassVar[str] = "fresh_tokens"

    staleness_weight: float = 0.25
    staleness_scale: float = 4.0
    window: int = 2
    window_bonus: float = 0.6

    def __post_init__(self) -> None:
        super().__post_init__()
        check_number(self.staleness_weight, "staleness_weight", self.name, low=0)
        check_number(self.staleness_scale, "staleness_scale", self.name, low=0, low_open=True)
        check_int(self.window, "window", self.name, low=1)
        check_number(self.window_bonus, "window_bonus", self.name, low=0)

    @property
    def default_sublayers(self) -> frozenset[str]:
        return frozenset({"mlp"})

    @property
    def needs(self) -> frozenset[str]:
        return frozenset({"received_attention"})

    @property
    def uses_streak(self) -> bool:
        return True

    def score(self, ctx: MergeContext, num_tokens: int) -> Tensor:
        """``[B, N]`` ToCa's score of every token (higher: recomputed first)."""
        score = F.normalize(ctx.received_attention.float(), p=2, dim=1)  # [B, N] s1
        if ctx.streak is not None and self.staleness_weight:
            score = score + self.staleness_weight * ctx.streak.float() / self.staleness_scale  # + s3
        if self.window_bonus and self.window > 1:
            score = score + self.window_bonus * window_best(score, ctx.grid, self.window)  # + s4
        return score

    def select_destinations(self, x: Tensor, ctx: MergeContext) -> Tensor:
        """The ``k = N - r`` best-scored tokens, ``[B, k]`` in descending score."""
        B, N, _ = x.shape
        keep = N - ctx.tokens_to_remove(N)
        return self.score(ctx, N).topk(keep, dim=1).indices  # [B, k]

    def merge_matrix(self, x: Tensor, dst: Tensor, ctx: MergeContext) -> MergePlan:
        """The selection (:meth:`MergePlan.selection`): merging takes the rows ``dst``, unmerging puts each output
        back at its token and 0 at the others; its merged tokens are those not selected (they take the cached
        output, and their streak grows)."""
        return MergePlan.selection(dst, num_tokens=x.shape[1])


def window_best(score: Tensor, grid: tuple[int, ...], window: int) -> Tensor:
    """``[B, N]``: each token's score where it is the best of its ``window x window`` grid cell (per frame; cells
    at an odd edge are smaller), else 0."""
    B, N = score.shape
    T, H, W = grid_frames(grid)
    rows, cols = -(-H // window), -(-W // window)
    padded = F.pad(score.view(B * T, H, W), (0, cols * window - W, 0, rows * window - H), value=float("-inf"))
    cells = padded.view(B * T, rows, window, cols, window).permute(0, 1, 3, 2, 4)  # [B*T, rows, cols, w, w]
    cells = cells.reshape(B * T, rows, cols, window * window)  # [B*T, rows, cols, w*w]
    best, where = cells.max(dim=-1, keepdim=True)  # [B*T, rows, cols, 1]
    is_best = where == torch.arange(window * window, device=score.device)  # [B*T, rows, cols, w*w]
    kept = torch.where(is_best, best, torch.zeros_like(best))  # [B*T, rows, cols, w*w]
    kept = kept.view(B * T, rows, cols, window, window).permute(0, 1, 3, 2, 4)  # [B*T, rows, w, cols, w]
    return kept.reshape(B * T, rows * window, cols * window)[:, :H, :W].reshape(B, N)  # [B, N]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ToCa(Schedule):
    """``toca``: token-wise feature caching with the authors' DiT defaults (see the module docstring).

    Args:
        interval: steps from one fresh step to the next (ToCa's ``fresh_threshold``).
        fresh_ratio: the base fraction of tokens recomputed on a cached step (before the factors).
        layer_weight, step_weight: the spread of the layer and step factors (``1 + w - 2 w x`` over depth and steps).
        mlp_factor: the feed-forward's module factor (ToCa: ``1 + 0.6 * 2.5``: the attention's share moved to it).
        staleness_weight, window, window_bonus: :class:`FreshTokens`'s score.
        ratio: ``None`` or 0 (the fresh fraction sets how many tokens run).
    """

    name: ClassVar[str] = "toca"

    interval: int = 4
    fresh_ratio: float = 0.07
    layer_weight: float = 0.8
    step_weight: float = 0.4
    mlp_factor: float = 2.5
    staleness_weight: float = 0.25
    window: int = 2
    window_bonus: float = 0.6
    ratio: float | None = None

    _select: FreshTokens = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        what = self.name
        check_int(self.interval, "interval", what, low=1)
        check_number(self.fresh_ratio, "fresh_ratio", what, low=0, high=1, low_open=True)
        check_number(self.layer_weight, "layer_weight", what, low=0, high=1)
        check_number(self.step_weight, "step_weight", what, low=0, high=1)
        check_number(self.mlp_factor, "mlp_factor", what, low=0)
        if self.ratio not in (None, 0, 0.0):
            raise ValueError(f"{what}: ratio={self.ratio!r}: toca takes no merging ratio (fresh_ratio sets how many "
                             "tokens a cached step recomputes); leave it out or pass 0")
        object.__setattr__(self, "_select", FreshTokens(
            staleness_weight=self.staleness_weight, staleness_scale=float(self.interval), window=self.window,
            window_bonus=self.window_bonus))

    @property
    def reused_sublayers(self) -> frozenset[str]:
        return frozenset({"attn"})

    def is_fresh(self, step: int, num_steps: int | None) -> bool:
        """Whether ``step`` (0: the first denoising step) computes every token and refreshes the cache: the first
        step and those whose count from the last step down is a multiple of ``interval`` (ToCa's
        ``global_force_fresh``); without a step count, every ``interval``-th step from the first."""
        if step == 0:
            return True
        countdown = (num_steps - 1 - step) if num_steps else step
        return countdown % self.interval == 0

    def fresh_fraction(self, where: Where) -> float:
        """The fraction of the feed-forward's tokens recomputed in this block call (at most 1)."""
        num_steps = where.num_steps or 1
        countdown = num_steps - 1 - where.step if where.num_steps else 0
        depth = where.layer / (where.num_layers - 1) if where.num_layers > 1 else 0.0
        layer_factor = 1 + self.layer_weight - 2 * self.layer_weight * depth
        step_factor = 1 + self.step_weight - 2 * self.step_weight * countdown / num_steps
        return min(1.0, self.fresh_ratio * layer_factor * step_factor * (1 + 0.6 * self.mlp_factor))

    def decide(self, where: Where) -> Decision:
        """A fresh step: every sublayer at full length, stored, the staleness reset; a cached step: the attention
        reused, the feed-forward on the fresh tokens, the rest from the cache."""
        key = (self.name, where.layer)
        if self.is_fresh(where.step, where.num_steps):
            # strategy at ratio 0: the block runs unmerged and its received attention is recorded
            return Decision(self._select, 0.0, frozenset({"mlp"}), label=FRESH, reset_streaks=True,
                            cache_outputs=frozenset({"attn", "mlp"}), streak_key=key)
        ratio = 1.0 - self.fresh_fraction(where)
        return Decision(self._select, ratio, frozenset({"mlp"}), label=CACHED, cache_outputs=frozenset({"mlp"}),
                        cache_weight=0.0, reuse_outputs=frozenset({"attn"}), streak_key=key)

    def strategies(self) -> tuple[MergeStrategy, ...]:
        return (self._select,)

    def to_dict(self) -> dict[str, Any]:
        """The schedule's name and options (the built strategy is derived, not logged)."""
        return {k: v for k, v in super().to_dict().items() if not k.startswith("_")}
