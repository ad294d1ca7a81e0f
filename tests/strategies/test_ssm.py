"""Tests of the ``ssm`` strategy (SDTM structure phase) on hand-made inputs with known answers."""

from __future__ import annotations

import warnings

import pytest
import torch

import tomerge
from tomerge import MergeContext, MergePlan
from tomerge.strategies.ssm import SSM, window_tokens
from helpers.ties import assert_clear, kth_gap


def groups(plan: MergePlan, b: int = 0) -> set[frozenset[int]]:
    """The merge groups (sets of token positions sharing a slot) of batch element ``b``."""
    assign = plan.assign[b].tolist()
    out: dict[int, set[int]] = {}
    for token, slot in enumerate(assign):
        out.setdefault(slot, set()).add(token)
    return {frozenset(g) for g in out.values()}


def merged_groups(plan: MergePlan, b: int = 0) -> set[frozenset[int]]:
    return {g for g in groups(plan, b) if len(g) > 1}


def window_members(H: int, W: int, k: int, wy: int, wx: int) -> frozenset[int]:
    """Token positions of the window at window-row ``wy``, window-column ``wx`` (reference, by hand)."""
    return frozenset((wy * k + dy) * W + wx * k + dx for dy in range(k) for dx in range(k))


def textured_grid(H: int, W: int, k: int, flat: list[tuple[int, int]], C: int = 16, seed: int = 0) -> torch.Tensor:
    """``[N, C]`` features: windows in ``flat`` hold one repeated vector, all other tokens are random."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(H * W, C, generator=g)
    for wy, wx in flat:
        v = torch.randn(C, generator=g)
        for t in window_members(H, W, k, wy, wx):
            x[t] = v
    return x


# ---------------------------------------------------------------------------------------- selection
def test_selects_flat_windows_per_sample() -> None:
    H = W = 4  # four 2x2 windows: (0,0) (0,1) (1,0) (1,1)
    x0 = textured_grid(H, W, 2, flat=[(0, 1), (1, 0)], seed=1)
    x1 = textured_grid(H, W, 2, flat=[(0, 0), (1, 1)], seed=2)
    x = torch.stack([x0, x1])  # [2, 16, 16]
    ctx = MergeContext(grid=(H, W), ratio=6 / 16)  # r = 6 -> n_win = 2
    assert_clear(kth_gap(SSM().window_scores(x, ctx), 2), "the two flat windows")  # 1 vs random: no near tie
    plan = SSM(round_windows=1).plan(x, ctx)
    assert plan.num_removed == 6
    assert merged_groups(plan, 0) == {window_members(H, W, 2, 0, 1), window_members(H, W, 2, 1, 0)}
    assert merged_groups(plan, 1) == {window_members(H, W, 2, 0, 0), window_members(H, W, 2, 1, 1)}
    # dst of a window slot is its top-left token, and every dst belongs to its own slot.
    assert plan.dst[0, :2].tolist() == [2, 8]
    assert plan.dst[1, :2].tolist() == [0, 10]
    slots = torch.arange(plan.num_slots).expand(2, -1)
    assert torch.equal(plan.assign.gather(1, plan.dst), slots)


def test_window_slot_is_mean_of_its_tokens() -> None:
    x = torch.randn(1, 36, 8, generator=torch.Generator().manual_seed(3))
    plan = SSM(round_windows=1).plan(x, MergeContext(grid=(6, 6), ratio=0.5))
    y = plan.merge(x)  # [1, M, 8]
    for g in groups(plan):
        slot = int(plan.assign[0, min(g)])
        torch.testing.assert_close(y[0, slot], x[0, sorted(g)].mean(0))


def test_window_score_is_off_diagonal_mean() -> None:
    e = torch.eye(4)
    # window (0,0) = tokens 0,1,4,5 holds e0, e0, e1, e1: 4 of 12 ordered off-diagonal pairs are 1.
    # window (0,1) = tokens 2,3,6,7 holds v, v, v, 0 (an all-zero token): 6 of 12 pairs are 1.
    x = torch.zeros(1, 8, 4)
    x[0, [0, 1]], x[0, [4, 5]] = e[0], e[1]
    x[0, [2, 3, 6]] = torch.tensor([1.0, 2.0, 3.0, 4.0])
    score = SSM().window_scores(x, MergeContext(grid=(2, 4), ratio=0.5))
    torch.testing.assert_close(score, torch.tensor([[1 / 3, 1 / 2]]))
    # include_self: all 16 pairs; the diagonal adds 4 (window (0,0)) and 3 (the zero token's own is 0).
    score = SSM(include_self=True).window_scores(x, MergeContext(grid=(2, 4), ratio=0.5))
    torch.testing.assert_close(score, torch.tensor([[8 / 16, 9 / 16]]))


def authors_window_scores(x: torch.Tensor, streak: torch.Tensor, H: int, W: int, a_s: float) -> list[float]:
    """The released code's window score (TR_SDTM.py, SSM), written out in float64 for a ``[N, C]`` grid of
    2x2 windows: the mean of the cosine similarities of all 16 ordered pairs of a window, its 4 diagonal
    entries (a token with itself) included, plus ``a_s`` times the window mean of ``streak / mean(streak)``."""
    x, streak = x.double(), streak.double()
    priority = streak / streak.mean()
    scores = []
    for wy in range(H // 2):
        for wx in range(W // 2):
            members = sorted(window_members(H, W, 2, wy, wx))
            sims = [float(x[i] @ x[j] / (x[i].norm() * x[j].norm())) for i in members for j in members]
            scores.append(sum(sims) / 16 + a_s * sum(float(priority[i]) for i in members) / 4)
    return scores


def test_sdtm_release_ranks_windows_as_the_authors_score_them() -> None:
    # Four 2x2 windows on a 4x4 grid (e_k: unit vectors):
    #   w0 = (0,0): e0 e0 e0 e0   pairs: all 16 equal                 -> off-diagonal mean 1
    #   w1 = (0,1): e1 e1 e1 e2   6 of 12 off-diagonal pairs equal    -> 1/2
    #   w2 = (1,0): e3 e3 e4 e4   4 of 12                             -> 1/3
    #   w3 = (1,1): e5 e6 e7 e0   none                                -> 0
    # Streaks: 2 on w2's tokens, 1 on w3's, 0 elsewhere: mean 12/16, priorities 8/3 (w2) and 4/3 (w3).
    # With a_s = 0.05 the authors' score (diagonal included) is 1/4 + 3/4 * P_off + a_s * prior:
    #   w0 1, w1 0.625, w2 0.25 + 0.25 + 0.1333 = 0.6333, w3 0.25 + 0.0667 = 0.3167 -> top two {w0, w2};
    # the off-diagonal score P_off + a_s * prior: w0 1, w1 0.5, w2 0.4667, w3 0.0667 -> {w0, w1}.
    H = W = 4
    e = torch.eye(8, dtype=torch.float64)
    rows = {0: [0, 0, 0, 0], 1: [1, 1, 1, 2], 2: [3, 3, 4, 4], 3: [5, 6, 7, 0]}
    windows = [(0, 0), (0, 1), (1, 0), (1, 1)]
    x = torch.zeros(H * W, 8, dtype=torch.float64)
    streak = torch.zeros(H * W, dtype=torch.float64)
    for w, (wy, wx) in enumerate(windows):
        for token, k in zip(sorted(window_members(H, W, 2, wy, wx)), rows[w]):
            x[token] = e[k]
            streak[token] = {2: 2.0, 3: 1.0}.get(w, 0.0)
    expected = authors_window_scores(x, streak, H, W, a_s=0.05)
    assert expected == pytest.approx([1.0, 0.625, 0.25 + 0.25 + 0.4 / 3, 0.25 + 0.2 / 3], abs=1e-12)
    order = sorted(range(4), key=lambda w: -expected[w])
    assert order == [0, 2, 1, 3]
    assert min(expected[a] - expected[b] for a, b in zip(order, order[1:])) > 5e-3  # no near tie
    ctx = MergeContext(grid=(H, W), ratio=6 / 16, streak=streak[None].float())  # r = 6: two windows
    release = tomerge.get_strategy("sdtm_release").ssm
    assert release.include_self and release.alpha_s == 0.05
    torch.testing.assert_close(release.window_scores(x[None], ctx).double(), torch.tensor([expected], dtype=torch.float64))
    plan = release.plan(x[None], ctx)
    assert merged_groups(plan) == {window_members(H, W, 2, *windows[w]) for w in order[:2]}  # w0, w2
    # The paper's off-diagonal score (plain ssm and sdtm) picks w1 over w2 on the same input.
    for plain in (SSM(), tomerge.get_strategy("sdtm").ssm, tomerge.get_strategy("sdtm_paper").ssm):
        assert not plain.include_self
        assert merged_groups(plain.plan(x[None], ctx)) == {window_members(H, W, 2, *windows[w]) for w in (0, 1)}


def test_persistence_prior_breaks_tie() -> None:
    H = W = 4
    # Every window equally flat: a tie, exact in any rounding (unit rows of 0.25, cosines 16 * 0.0625 = 1).
    x = torch.ones(2, 16, 16)
    assert (SSM().window_scores(x, MergeContext(grid=(H, W), ratio=0.2)) == 1).all()
    streak = torch.zeros(2, 16)
    streak[0, list(window_members(H, W, 2, 1, 1))] = 5  # long streaks in window (1,1) for sample 0
    streak[1, list(window_members(H, W, 2, 1, 0))] = 5  # and in window (1,0) for sample 1
    ctx = MergeContext(grid=(H, W), ratio=3 / 16, streak=streak)  # r = 3 -> one window
    plan = SSM(round_windows=1).plan(x, ctx)
    assert merged_groups(plan, 0) == {window_members(H, W, 2, 1, 1)}
    assert merged_groups(plan, 1) == {window_members(H, W, 2, 1, 0)}
    # Without the prior (alpha_s=0 or no streak) the tie goes to the first window in raster order.
    for strategy, c in [(SSM(round_windows=1, alpha_s=0.0), ctx),
                        (SSM(round_windows=1), MergeContext(grid=(H, W), ratio=3 / 16))]:
        p = strategy.plan(x, c)
        assert merged_groups(p, 0) == merged_groups(p, 1) == {window_members(H, W, 2, 0, 0)}


def test_prior_broadcasts_a_single_streak_row() -> None:
    x = torch.ones(3, 16, 8)
    streak = torch.zeros(1, 16)
    streak[0, list(window_members(4, 4, 2, 0, 1))] = 2
    plan = SSM(round_windows=1).plan(x, MergeContext(grid=(4, 4), ratio=3 / 16, streak=streak))
    for b in range(3):
        assert merged_groups(plan, b) == {window_members(4, 4, 2, 0, 1)}


@pytest.mark.parametrize("round_windows, expected_windows", [(1, 10), (4, 8), (3, 9), (16, 10)])
def test_round_windows(round_windows: int, expected_windows: int) -> None:
    x = torch.randn(1, 64, 8, generator=torch.Generator().manual_seed(4))
    ctx = MergeContext(grid=(8, 8), ratio=30 / 64)  # r = 30 -> n_win = 10 of 16 windows
    # round_windows=16 would give 0 windows: the count is kept unrounded (documented choice).
    plan = SSM(round_windows=round_windows).plan(x, ctx)
    assert len(merged_groups(plan)) == expected_windows
    assert plan.num_removed == 3 * expected_windows


def test_default_rounding_on_a_larger_grid() -> None:
    x = torch.randn(1, 256, 4, generator=torch.Generator().manual_seed(5))
    plan = SSM().plan(x, MergeContext(grid=(16, 16), ratio=0.5))  # r = 128 -> 42 windows -> 32
    assert len(merged_groups(plan)) == 32 and plan.num_removed == 96


def test_larger_window() -> None:
    x = textured_grid(6, 6, 3, flat=[(1, 0)], seed=6)[None]  # four 3x3 windows, one flat
    assert_clear(kth_gap(SSM(window=3).window_scores(x, MergeContext(grid=(6, 6), ratio=0.25)), 1), "the flat window")
    plan = SSM(window=3, round_windows=1).plan(x, MergeContext(grid=(6, 6), ratio=0.25))  # r = 9 -> 1 window
    assert merged_groups(plan) == {window_members(6, 6, 3, 1, 0)}
    assert plan.num_removed == 8 and plan.dst[0, 0].item() == 18


# ---------------------------------------------------------------------------------------- grids
def test_non_square_grid_leftovers_stay_single() -> None:
    H, W = 5, 7  # full windows: rows 0-3, columns 0-5 (6 windows); row 4 and column 6 are leftovers
    x = torch.ones(2, H * W, 8)  # all windows tie, so only the structure decides
    plan = SSM(round_windows=1).plan(x, MergeContext(grid=(H, W), ratio=0.55))  # r = 19 -> 6 windows
    expected = {window_members(H, W, 2, wy, wx) for wy in range(2) for wx in range(3)}
    for b in range(2):
        assert merged_groups(plan, b) == expected
    leftovers = [4 * W + c for c in range(W)] + [row * W + 6 for row in range(H)]
    assert (plan.sizes.gather(1, plan.assign[:, leftovers]) == 1).all()
    assert window_tokens((H, W), 2).shape == (6, 4)


def test_cap_warns_when_grid_has_too_few_windows() -> None:
    x = torch.randn(1, 35, 8)
    with pytest.warns(UserWarning, match="capping at 6 windows"):
        plan = SSM(round_windows=1).plan(x, MergeContext(grid=(5, 7), ratio=0.7))  # 24 -> 8 windows > 6
    assert plan.num_removed == 18
    with pytest.warns(UserWarning, match="only 0 full"):
        tiny = SSM().plan(torch.randn(1, 9, 8), MergeContext(grid=(1, 9), ratio=0.9))  # r = 8
    assert tiny.is_identity


def test_too_small_ratio_gives_identity_plan_without_warning() -> None:
    x = torch.randn(2, 16, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert SSM().plan(x, MergeContext(grid=(4, 4), ratio=0.0)).is_identity
        assert SSM().plan(x, MergeContext(grid=(4, 4), ratio=2 / 16)).is_identity  # r = 2 < K - 1


# ---------------------------------------------------------------------------------------- invariants
def test_unmerge_merge_is_exact_for_identical_groups() -> None:
    x = torch.randn(2, 35, 8, generator=torch.Generator().manual_seed(7))
    plan = SSM(round_windows=1).plan(x, MergeContext(grid=(5, 7), ratio=0.5))
    assert plan.num_removed > 0
    # Small integers, equal inside each group of 4: the mean (weights 1/4) is exact in every backend.
    values = torch.randint(-8, 8, (2, plan.num_slots, 8)).float()
    y = plan.unmerge(values)  # [2, 35, 8], identical within groups
    for backend in ("index", "dense"):
        p = plan.with_backend(backend)
        assert torch.equal(p.unmerge(p.merge(y)), y)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_low_precision_and_zero_tokens_are_finite(dtype: torch.dtype) -> None:
    x = torch.randn(2, 35, 8, generator=torch.Generator().manual_seed(9))
    x[0, [0, 1, 7, 8]] = 0  # an all-zero window
    x[1, 3] = 0  # a single zero token
    x = x.to(dtype)
    ctx = MergeContext(grid=(5, 7), ratio=0.5, streak=torch.zeros(2, 35))  # all-zero streaks too
    strategy = SSM(round_windows=1)
    assert torch.isfinite(strategy.window_scores(x, ctx)).all()
    plan = strategy.plan(x, ctx)
    out = plan.unmerge(plan.merge(x))
    assert out.dtype == dtype and torch.isfinite(out).all()
    zeros = strategy.plan(torch.zeros(1, 35, 8, dtype=dtype), MergeContext(grid=(5, 7), ratio=0.5))
    assert torch.isfinite(zeros.merge(torch.zeros(1, 35, 8, dtype=dtype))).all()


@pytest.mark.tie_sensitive
def test_batch_equals_per_sample() -> None:
    g = torch.Generator().manual_seed(10)
    x = torch.randn(3, 48, 8, generator=g)
    streak = torch.randint(0, 4, (3, 48), generator=g)
    strategy = SSM(round_windows=1)
    ctx = MergeContext(grid=(6, 8), ratio=0.5, streak=streak)
    # The 8 best of 12 windows: no window may be within rounding of the 8th score, or another batch size's
    # float32 rounding could swap it in.
    assert_clear(kth_gap(strategy.window_scores(x, ctx), strategy.num_windows(48, 12, ctx)), "window selection")
    batch = strategy.plan(x, ctx)
    for b in range(3):
        single = strategy.plan(x[b:b + 1], MergeContext(grid=(6, 8), ratio=0.5, streak=streak[b:b + 1]))
        assert torch.equal(batch.assign[b], single.assign[0])
        assert torch.equal(batch.dst[b], single.dst[0])
        torch.testing.assert_close(batch.merge(x)[b], single.merge(x[b:b + 1])[0])


# ---------------------------------------------------------------------------------------- options
@pytest.mark.parametrize("options", [
    {"window": 1}, {"window": True}, {"window": 2.0}, {"alpha_s": -0.1}, {"alpha_s": float("nan")},
    {"round_windows": 0}, {"ratio": 1.0},
])
def test_invalid_options_raise(options: dict) -> None:
    with pytest.raises(ValueError):
        SSM(**options)


def test_registry_and_class_attributes() -> None:
    s = tomerge.get_strategy("ssm", window=3, alpha_s=0.1, round_windows=4)
    assert isinstance(s, SSM) and (s.window, s.alpha_s, s.round_windows) == (3, 0.1, 4)
    assert SSM.name == "ssm" and SSM().uses_streak and SSM().default_sublayers == {"attn", "mlp"}
    assert s.needs == frozenset()
