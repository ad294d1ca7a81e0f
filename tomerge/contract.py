"""The invariants every strategy must pass, as reusable checks (docs/writing-a-strategy.md, "Rules the contract
enforces").

The project's contract test runs :func:`check_strategy` over every registered strategy, so a newly
registered one is tested automatically; a researcher can call it in their own tests too:

    >>> from tomerge.contract import check_strategy
    >>> check_strategy("ssm")          # raises AssertionError naming the broken invariant
    >>> check_strategy("ssm", grid=(2, 16, 16))   # on a video grid (frames x height x width)

The checks run on a 2-D grid by default; ``grid=(T, H, W)`` runs them on a video grid, with a non-divisible
``(T, H, W)`` grid for the robustness check (:data:`ODD_GRIDS`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from .context import Grid, MergeContext, check_grid
from .registry import get_strategy
from .strategy import MergeStrategy

CHECKS: tuple[str, ...] = ("ratio_zero", "shapes", "idempotent", "backends", "deterministic", "per_sample",
                           "robust")

GRIDS: tuple[Grid, ...] = ((16, 16), (2, 16, 16))
"""The grids the project's contract test runs every strategy on: an image and a two-frame video."""

ODD_GRIDS: dict[int, Grid] = {2: (13, 15), 3: (3, 13, 15)}
"""The robustness check's grid, by the number of grid dimensions: sides not divisible by 2, 3 or 4."""


def make_context(x: Tensor, grid: Grid, ratio: float, seed: int = 0) -> MergeContext:
    """A context with every statistic a strategy may need (random received attention and streaks)."""
    B, N, _ = x.shape
    g = torch.Generator().manual_seed(seed + 1)
    attention = torch.rand(B, N, generator=g).softmax(-1).to(x.device)
    streak = torch.randint(0, 4, (B, N), generator=g).float().to(x.device)
    return MergeContext(grid=grid, ratio=ratio, received_attention=attention, streak=streak,
                        generator=torch.Generator(device=x.device).manual_seed(seed))


def _tokens(batch: int, grid: Grid, channels: int = 16, seed: int = 0,
            dtype: torch.dtype = torch.float32) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    # Smooth-ish features: a low-frequency field plus noise, so neighbours are alike as in real models.
    if len(grid) == 2:
        H, W = grid
        base = torch.randn(batch, channels, (H + 1) // 2, (W + 1) // 2, generator=g)
        field = torch.nn.functional.interpolate(base, size=(H, W), mode="bilinear", align_corners=False)  # [B, C, H, W]
    else:  # neighbouring frames are alike too
        T, H, W = grid
        base = torch.randn(batch, channels, (T + 1) // 2, (H + 1) // 2, (W + 1) // 2, generator=g)
        field = torch.nn.functional.interpolate(base, size=(T, H, W), mode="trilinear",
                                                align_corners=False)  # [B, C, T, H, W]
    N = field[0, 0].numel()
    x = field.flatten(2).transpose(1, 2) + 0.3 * torch.randn(batch, N, channels, generator=g)  # [B, N, C]
    return x.to(dtype)


def _near_tie_tokens(plan, share: float = 1e-3) -> tuple[Tensor, Tensor]:
    """The tokens a soft plan splits between distinct destinations, and the tokens of the slots they blur.

    A token is split when two destination tokens or more get more than ``share`` of its merge weight each (slots
    with the same destination token, as an exhausted tile's repeats, count as one: they hold the same value). Returns ``[B, N]``
    bool masks ``(split, exempt)``; ``exempt`` holds the split tokens and every token with weight in a slot where
    a split token has weight above ``share``.
    """
    W, _ = plan.dense()  # [B, M, N]
    B, M, N = W.shape
    weight = W.float() / W.float().sum(1, keepdim=True).clamp_min(1e-30)  # [B, M, N] each token's weight shares
    by_destination = torch.zeros(B, N, N, device=W.device).index_put_(  # [B, destination token, N]
        (torch.arange(B, device=W.device).view(B, 1).expand(B, M), plan.dst), weight, accumulate=True)
    split = (by_destination > share).sum(1) >= 2  # [B, N]: two destination tokens or more
    blurred = ((weight > share) & split.unsqueeze(1)).any(-1)  # [B, M] slots a split token has weight in
    exempt = split | ((weight > share) & blurred.unsqueeze(-1)).any(1)  # [B, N]
    return split, exempt


def _close(a: Tensor, b: Tensor, tol: float = 1e-4) -> bool:
    return torch.allclose(a.float(), b.float(), atol=tol, rtol=tol)


def check_strategy(strategy: str | Callable[[], MergeStrategy], checks: tuple[str, ...] = CHECKS,
                   grid: Grid = (16, 16)) -> None:
    """Runs the contract invariants; raises ``AssertionError`` naming the first one broken.

    Args:
        strategy: a registered name, or a zero-argument factory returning a fresh instance.
        checks: which invariants to run (default all of :data:`CHECKS`).
        grid: ``(H, W)`` or ``(T, H, W)`` grid of the checks; the robustness check uses the odd grid
            of the same dimension (:data:`ODD_GRIDS`).
    """
    grid = check_grid(grid)
    make = (lambda: get_strategy(strategy)) if isinstance(strategy, str) else strategy
    s = make()
    label = getattr(s, "name", "") or type(s).__name__
    ratio = 0.5
    x = _tokens(2, grid)
    N = x.shape[1]

    if "ratio_zero" in checks:
        plan = s.plan(x, make_context(x, grid, 0.0))
        assert plan.is_identity and plan.merge(x) is x, f"{label}: ratio 0 must give the identity plan"

    plan = s.plan(x, make_context(x, grid, ratio))
    if "shapes" in checks:
        y = plan.merge(x)
        assert plan.num_removed > 0, f"{label}: ratio {ratio} on {grid} removed no token"
        assert y.shape == (2, N - plan.num_removed, 16), f"{label}: merge gave {tuple(y.shape)}"
        assert plan.unmerge(y).shape == x.shape, f"{label}: unmerge must restore [B, N, C]"
        assert plan.sizes.shape == (2, plan.num_slots), f"{label}: sizes must be [B, M]"

    if "idempotent" in checks:  # tokens identical within each merge group survive merge + unmerge
        grouped = plan.unmerge(plan.merge(x))
        error = (plan.unmerge(plan.merge(grouped)) - grouped).abs().amax(-1)  # [B, N]
        inexact = error > 1e-3  # [B, N]
        if plan.is_soft:
            # A soft plan splits a token whose best destinations nearly tie between them, and that blurs every
            # slot it has weight in: the tokens of those slots are exempt, the split tokens at most 5% of all.
            split, exempt = _near_tie_tokens(plan)  # [B, N] each
            assert split.float().mean().item() <= 0.05, \
                f"{label}: {split.float().mean().item():.1%} of the tokens are split between destinations (> 5%)"
            inexact = inexact & ~exempt
        assert not inexact.any(), (f"{label}: unmerge(merge(x)) != x for tokens identical within their groups "
                                   f"({1 - inexact.float().mean().item():.1%} exact)")

    if "backends" in checks:
        index, dense = plan.with_backend("index"), plan.with_backend("dense")
        assert _close(index.merge(x), dense.merge(x)), f"{label}: index and dense merge disagree"
        y = index.merge(x)
        assert _close(index.unmerge(y), dense.unmerge(y)), f"{label}: index and dense unmerge disagree"
        W, U = plan.dense()
        assert _close(W @ x, plan.merge(x)), f"{label}: dense() W does not reproduce merge"
        assert _close(U @ y, plan.unmerge(y)), f"{label}: dense() U does not reproduce unmerge"

    if "deterministic" in checks:
        again = make().plan(x, make_context(x, grid, ratio))
        assert torch.equal(again.slot_of_token, plan.slot_of_token), f"{label}: not deterministic"

    if "per_sample" in checks and not s.uses_generator:  # a strategy that draws draws once for the batch
        ctx = make_context(x, grid, ratio)
        batched = plan.merge(x)
        for b in range(x.shape[0]):
            one = MergeContext(grid=grid, ratio=ratio, received_attention=ctx.received_attention[b:b + 1],
                               streak=ctx.streak[b:b + 1], generator=torch.Generator().manual_seed(0))
            alone = make().plan(x[b:b + 1], one)
            assert _close(alone.merge(x[b:b + 1]), batched[b:b + 1]), \
                f"{label}: sample {b} merged alone differs from the batch"

    if "robust" in checks:
        odd = ODD_GRIDS[len(grid)]
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            xo = _tokens(2, odd, dtype=dtype)
            xo[:, :5] = 0  # all-zero tokens must not produce NaN
            p = make().plan(xo, make_context(xo, odd, ratio))
            y = p.merge(xo)
            assert y.dtype == dtype, f"{label}: merge changed dtype {dtype} to {y.dtype}"
            assert torch.isfinite(y).all() and torch.isfinite(p.unmerge(y)).all(), \
                f"{label}: NaN/inf with zero tokens, {dtype}, grid {odd}"
