"""``toca``: token-wise feature caching (ToCa, Zou et al., ICLR 2025), and ``fresh_tokens``, the strategy that picks
the tokens it recomputes.

On fresh steps every sublayer's output is cached at full length; on the cached steps in between the attention
returns its cache and the feed-forward recomputes only a scored fraction of the tokens, the others taking their
cached output. The authors' DiT DDIM-50 recipe (the defaults), their code it follows and the deviations:
docs/schedules.md, "toca".

Example:
    >>> from tomerge.schedule import Where
    >>> s = ToCa()
    >>> [s.is_fresh(t, 20) for t in range(8)]
    [True, False, False, False, True, False, False, True]
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from tomerge.context import MergeContext, grid_frames
from tomerge.feature_cache import FeatureCaching
from tomerge.options import check_int, check_number
from tomerge.plan import MergePlan
from tomerge.schedule import Decision, Schedule, Where
from tomerge.strategy import MergeStrategy
from tomerge.streaks import Streaks

# labels: a fresh step's block calls, a cached step's, a cached step's with no fresh token
FRESH, CACHED, REUSED = "fresh", "toca", "toca_reuse"


@dataclasses.dataclass(frozen=True, kw_only=True)
class FreshTokens(MergeStrategy):
    """Selects the tokens a sublayer recomputes by ToCa's score; the others skip it (docs/schedules.md, "toca").

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
    """``toca``: token-wise feature caching with the authors' DiT DDIM-50 recipe (the rules: docs/schedules.md,
    "toca").

    Args:
        interval: the base interval between fresh steps (ToCa's ``fresh_threshold``; DDIM-50: 3).
        interval_weight: the spread of the interval over the steps (``force_scheduler``'s ``linear_step_weight``):
            longer early, shorter late; 0: every ``interval``-th step counted down.
        sensitive_from, sensitive_until: the steps ``s`` (fractions of ``S``, counted down) where the interval is
            ``sensitive_interval`` (``force_scheduler``: 0.2 to 0.4, 2).
        sensitive_interval: the interval there; ``None``: no such steps.
        fresh_ratio: the base fraction of tokens recomputed on a cached step (before the factors).
        layer_weight, step_weight: the spread of the layer and step factors (``1 + w - 2 w x`` over depth and the
            countdown; DDIM-50: -0.2 and 2.0; a negative fraction is 0, as ToCa clamps it).
        mlp_factor: the feed-forward's module factor (ToCa: ``1 + 0.6 * 2.5``: the attention's share moved to it).
        staleness_weight, window, window_bonus: :class:`FreshTokens`'s score (the staleness divided by ``interval``).
        ratio: ``None`` or 0 (the fresh fraction sets how many tokens run).
    """

    name: ClassVar[str] = "toca"

    interval: int = 3
    interval_weight: float = 0.4
    sensitive_from: float = 0.2
    sensitive_until: float = 0.4
    sensitive_interval: int | None = 2
    fresh_ratio: float = 0.07
    layer_weight: float = -0.2
    step_weight: float = 2.0
    mlp_factor: float = 2.5
    staleness_weight: float = 0.25
    window: int = 2
    window_bonus: float = 0.6
    ratio: float | None = None

    _select: FreshTokens = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        what = self.name
        check_int(self.interval, "interval", what, low=1)
        check_number(self.interval_weight, "interval_weight", what, low=0, high=0.99,
                     note="at 1 or more an interval can round to 0")
        check_number(self.sensitive_from, "sensitive_from", what, low=0, high=1, note="a fraction of the steps")
        check_number(self.sensitive_until, "sensitive_until", what, low=self.sensitive_from, high=1,
                     note="a fraction of the steps, not before sensitive_from")
        if self.sensitive_interval is not None:
            check_int(self.sensitive_interval, "sensitive_interval", what, low=1)
        check_number(self.fresh_ratio, "fresh_ratio", what, low=0, high=1, low_open=True)
        check_number(self.layer_weight, "layer_weight", what, low=-1, high=1)
        check_number(self.step_weight, "step_weight", what, low=0)
        check_number(self.mlp_factor, "mlp_factor", what, low=0)
        if self.ratio not in (None, 0, 0.0):
            raise ValueError(f"{what}: ratio={self.ratio!r}: toca takes no merging ratio (fresh_ratio sets how many "
                             "tokens a cached step recomputes); leave it out or pass 0")
        object.__setattr__(self, "_select", FreshTokens(
            staleness_weight=self.staleness_weight, staleness_scale=float(self.interval), window=self.window,
            window_bonus=self.window_bonus))

    @property
    def reused_sublayers(self) -> frozenset[str]:
        return frozenset({"attn", "mlp"})

    def fresh_interval(self, countdown: int, num_steps: int) -> int:
        """The interval ToCa's ``force_scheduler`` sets at the fresh step ``countdown`` (counted from the last
        step down) of ``num_steps``."""
        lo, hi = int(num_steps * self.sensitive_from), int(num_steps * self.sensitive_until)
        if self.sensitive_interval is not None and lo <= countdown < hi:
            return self.sensitive_interval
        w = self.interval_weight
        factor = torch.tensor(1 + w - 2 * w * countdown / num_steps)  # float32, as the authors' torch.tensor
        return max(1, int(torch.round(self.interval / factor)))

    def fresh_steps(self, num_steps: int) -> frozenset[int]:
        """The fresh steps ``t`` (0: the first denoising step) of a ``num_steps``-step trajectory."""
        return _fresh_steps(self, num_steps)

    def is_fresh(self, step: int, num_steps: int | None) -> bool:
        """Whether ``step`` (0: the first denoising step) computes every token and refreshes the cache. Past the
        first step it needs the step count (the rule counts from the last step)."""
        if step == 0:
            return True
        if not num_steps:
            raise ValueError(f"{self.name}: its fresh steps are counted from the last step, so it needs the step "
                             "count: on a bare model pass num_steps= to tomerge.apply")
        return step in self.fresh_steps(num_steps)

    def fresh_fraction(self, where: Where) -> float:
        """The fraction of the feed-forward's tokens recomputed in this block call, in [0, 1]."""
        num_steps = where.num_steps or 1
        countdown = num_steps - 1 - where.step if where.num_steps else 0
        depth = where.layer / (where.num_layers - 1) if where.num_layers > 1 else 0.0
        layer_factor = 1 + self.layer_weight - 2 * self.layer_weight * depth
        step_factor = 1 + self.step_weight - 2 * self.step_weight * countdown / num_steps
        return min(1.0, max(0.0, self.fresh_ratio * layer_factor * step_factor * (1 + 0.6 * self.mlp_factor)))

    def decide(self, where: Where) -> Decision:
        """A fresh step: every sublayer at full length, stored, the staleness reset; a cached step: the attention
        reused, the feed-forward on the fresh tokens, the rest from the cache; a cached step whose fraction is 0:
        both sublayers reused, every token's staleness grown by 1."""
        key = (self.name, where.layer)
        if self.is_fresh(where.step, where.num_steps):
            # strategy at ratio 0: the block runs unmerged and its received attention is recorded
            return Decision(self._select, 0.0, frozenset({"mlp"}), label=FRESH,
                            techniques=(FeatureCaching(store=frozenset({"attn", "mlp"})), Streaks(key, reset=True)))
        fraction = self.fresh_fraction(where)
        if fraction == 0.0:
            # No token is fresh: the feed-forward's cache is its output at the last fresh step (the fraction only
            # grows along the trajectory, so no cached step since then changed it).
            return Decision(None, label=REUSED,
                            techniques=(FeatureCaching(reuse=frozenset({"attn", "mlp"})), Streaks(key)))
        return Decision(self._select, 1.0 - fraction, frozenset({"mlp"}), label=CACHED,
                        techniques=(FeatureCaching(store=frozenset({"mlp"}), weight=0.0, reuse=frozenset({"attn"})),
                                    Streaks(key)))

    def strategies(self) -> tuple[MergeStrategy, ...]:
        return (self._select,)

    def to_dict(self) -> dict[str, Any]:
        """The schedule's name and options (the built strategy is derived, not logged)."""
        return {k: v for k, v in super().to_dict().items() if not k.startswith("_")}


@functools.lru_cache(maxsize=256)
def _fresh_steps(schedule: ToCa, num_steps: int) -> frozenset[int]:
    """ToCa's fresh steps (``cal_type`` with ``force_scheduler``), walked from the first step ``s = S - 1`` down."""
    fresh, interval = [], schedule.interval
    for countdown in range(num_steps - 1, -1, -1):
        if countdown == num_steps - 1 or countdown % interval == 0:
            fresh.append(num_steps - 1 - countdown)
            interval = schedule.fresh_interval(countdown, num_steps)
    return frozenset(fresh)
