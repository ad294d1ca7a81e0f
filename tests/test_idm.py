"""Tests of the ``idm`` strategy (SDTM detail phase) on hand-made inputs with known answers."""

from __future__ import annotations

import pytest
import torch

import tomerge
from tomerge import MergeContext, MergePlan
from tomerge.strategies.idm import IDM
from tomerge.strategies.ssm import EPS
from ties import assert_clear, kth_gap

# 4x4 grid, 2x2 windows: w0 = {0,1,4,5}, w1 = {2,3,6,7}, w2 = {8,9,12,13}, w3 = {10,11,14,15}.
WINDOWS_4x4 = [{0, 1, 4, 5}, {2, 3, 6, 7}, {8, 9, 12, 13}, {10, 11, 14, 15}]


def groups(plan: MergePlan, b: int = 0) -> set[frozenset[int]]:
    """The merge groups (sets of token positions sharing a slot) of batch element ``b``."""
    out: dict[int, set[int]] = {}
    for token, slot in enumerate(plan.assign[b].tolist()):
        out.setdefault(slot, set()).add(token)
    return {frozenset(g) for g in out.values()}


def merged_groups(plan: MergePlan, b: int = 0) -> set[frozenset[int]]:
    return {g for g in groups(plan, b) if len(g) > 1}


def merged_tokens(plan: MergePlan, b: int = 0) -> set[int]:
    """Every token in a merge group (destinations included)."""
    return {t for g in merged_groups(plan, b) for t in g}


def hand_made_case() -> tuple[torch.Tensor, torch.Tensor]:
    """Features ``[1, 16, 8]`` and received attention ``[1, 16]`` with a known IDM answer.

    Destinations (attention 1.0): 5 (w0), 2 (w1), 12 (w2), 15 (w3), with features e0..e3.
    The four least attended tokens are 0, 7, 9, 14; each is built closest to a destination in
    *another* window: 0 -> 15, 7 -> 12, 9 -> 5, 14 -> 2. Other sources get attention 0.5.
    """
    e = torch.eye(8)
    x = torch.zeros(1, 16, 8)
    a = torch.full((1, 16), 0.5)
    for dst, j in [(5, 0), (2, 1), (12, 2), (15, 3)]:
        x[0, dst], a[0, dst] = e[j], 1.0
    for src, j, att in [(0, 3, 0.01), (7, 2, 0.02), (9, 0, 0.03), (14, 1, 0.04)]:
        x[0, src], a[0, src] = e[j] + 0.3 * e[4 + j], att
    for t in (1, 3, 4, 6, 8, 10, 11, 13):
        x[0, t] = e[4 + t % 4] + 0.1 * e[t % 4]
    return x, a


# ---------------------------------------------------------------------------------------- algorithm
def test_merges_least_attended_into_most_similar_destination() -> None:
    x, a = hand_made_case()
    plan = IDM().plan(x, MergeContext(grid=(4, 4), ratio=0.25, received_attention=a))  # r = 4
    assert plan.num_removed == 4
    assert plan.dst[0, :4].tolist() == [5, 2, 12, 15]
    assert merged_groups(plan) == {frozenset(p) for p in [(0, 15), (7, 12), (9, 5), (14, 2)]}


def test_local_keeps_merges_inside_windows() -> None:
    x, a = hand_made_case()
    plan = IDM(local=True).plan(x, MergeContext(grid=(4, 4), ratio=0.25, received_attention=a))
    assert merged_groups(plan) == {frozenset(p) for p in [(0, 5), (7, 2), (9, 12), (14, 15)]}
    # Larger ratio, random inputs: every merge group lies inside one window.
    g = torch.Generator().manual_seed(1)
    x, a = torch.randn(2, 16, 8, generator=g), torch.rand(2, 16, generator=g)
    plan = IDM(local=True).plan(x, MergeContext(grid=(4, 4), ratio=0.6, received_attention=a))
    for b in range(2):
        assert len(merged_groups(plan, b)) > 0
        for group in merged_groups(plan, b):
            assert any(group <= w for w in WINDOWS_4x4)


def test_destinations_are_window_attention_maxima() -> None:
    g = torch.Generator().manual_seed(2)
    a = torch.rand(3, 16, generator=g)
    a[2] = 0.5  # ties everywhere -> the first token of every window
    a[2, 3] = a[2, 6] = 0.9  # a tie inside w1 between tokens 3 and 6 -> 3
    x = torch.randn(3, 16, 4, generator=g)
    dst = IDM().select_destinations(x, MergeContext(grid=(4, 4), ratio=0.5, received_attention=a))
    for b in range(2):
        expected = [max(sorted(w), key=lambda t: a[b, t].item()) for w in WINDOWS_4x4]
        assert dst[b].tolist() == expected
    assert dst[2].tolist() == [0, 3, 8, 10]


def test_streak_variant_picks_longest_streak() -> None:
    streak = torch.zeros(1, 16, dtype=torch.long)
    streak[0, [4, 7, 6, 13, 11]] = torch.tensor([3, 2, 2, 1, 6])  # w1: tie 6/7 -> 6
    x = torch.randn(1, 16, 4)
    strategy = IDM(variant="streak")
    assert strategy.needs == frozenset() and IDM().needs == frozenset({"received_attention"})
    ctx = MergeContext(grid=(4, 4), ratio=0.5, streak=streak)  # no received attention needed
    assert strategy.select_destinations(x, ctx).tolist() == [[4, 6, 13, 11]]
    plan = strategy.plan(x, ctx)
    assert plan.num_removed == 8 and plan.dst[0, :4].tolist() == [4, 6, 13, 11]
    no_streak = strategy.select_destinations(x, MergeContext(grid=(4, 4), ratio=0.5))
    assert no_streak.tolist() == [[0, 2, 8, 10]]  # all tied: top-left tokens


def test_streak_term_of_the_priority() -> None:
    # Sources 1 and 3 have the same low attention; only the streak separates them.
    a = torch.ones(1, 16)
    a[0, [1, 3]] = 0.1
    streak = torch.ones(1, 16)
    streak[0, 3] = 2  # streak / mean(streak): 32/17 for token 3, 16/17 for the others
    ctx = MergeContext(grid=(4, 4), ratio=1 / 16, received_attention=a, streak=streak)  # r = 1
    x = torch.randn(1, 16, 4)
    tokens = merged_tokens(IDM().plan(x, ctx))
    assert 3 in tokens and 1 not in tokens
    tokens = merged_tokens(IDM(alpha_d=0.0).plan(x, ctx))  # no streak term: tie, raster order
    assert 1 in tokens and 3 not in tokens
    # P = -a/mean(a) + alpha_d * s/mean(s): raising a[3] by 0.2 costs 0.2/mean(a) = 0.222 of priority,
    # the streak gives alpha_d * 16/17 = 0.047 (default) or 0.941 (alpha_d = 1).
    a[0, 3] = 0.3
    assert 1 in merged_tokens(IDM().plan(x, ctx)) - {0, 2, 8, 10}
    assert 3 in merged_tokens(IDM(alpha_d=1.0).plan(x, ctx)) - {0, 2, 8, 10}


def test_leftover_tokens_are_sources() -> None:
    H, W = 5, 7  # leftovers: row 4 and column 6
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, H * W, 8, generator=g)
    a = 0.5 + torch.rand(1, H * W, generator=g)
    a[0, [34, 20]] = 0.0  # two leftover tokens (row 4, column 6) are the least attended
    plan = IDM().plan(x, MergeContext(grid=(H, W), ratio=2 / 35, received_attention=a))  # r = 2
    assert {34, 20} <= merged_tokens(plan) and plan.num_removed == 2
    assert not set(plan.dst[0, :6].tolist()) & {34, 20, 27, 28, 29, 30, 31, 32, 33, 6, 13}
    # With local=True leftovers have no window and never merge.
    local = IDM(local=True).plan(x, MergeContext(grid=(H, W), ratio=0.4, received_attention=a))
    leftovers = [28, 29, 30, 31, 32, 33, 34, 6, 13, 20, 27]
    assert local.num_removed == 14
    assert (local.sizes.gather(1, local.assign[:, leftovers]) == 1).all()


def test_cap_warns() -> None:
    x, a = torch.randn(1, 16, 4), torch.rand(1, 16)
    with pytest.warns(UserWarning, match="capping r at 12"):
        plan = IDM().plan(x, MergeContext(grid=(4, 4), ratio=0.9, received_attention=a))  # r = 14
    assert plan.num_removed == 12
    x, a = torch.randn(1, 35, 4), torch.rand(1, 35)
    with pytest.warns(UserWarning, match="capping r at 18"):  # local: 6 windows x 3 sources
        plan = IDM(local=True).plan(x, MergeContext(grid=(5, 7), ratio=0.6, received_attention=a))  # r = 21
    assert plan.num_removed == 18


def test_missing_received_attention_raises() -> None:
    x = torch.randn(1, 16, 4)
    with pytest.raises(ValueError, match="received_attention"):
        IDM().plan(x, MergeContext(grid=(4, 4), ratio=0.5))
    with pytest.raises(ValueError, match="received_attention"):
        IDM().select_destinations(x, MergeContext(grid=(4, 4), ratio=0.5))


# ---------------------------------------------------------------------------------------- invariants
def random_case(B: int, H: int, W: int, seed: int) -> tuple[torch.Tensor, MergeContext]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, H * W, 8, generator=g)
    ctx = MergeContext(grid=(H, W), ratio=0.5, received_attention=torch.rand(B, H * W, generator=g),
                       streak=torch.randint(0, 4, (B, H * W), generator=g))
    return x, ctx


@pytest.mark.parametrize("options", [{}, {"local": True}, {"variant": "streak"}])
def test_unmerge_merge_is_exact_for_identical_groups(options: dict) -> None:
    x, ctx = random_case(2, 5, 7, seed=4)
    plan = IDM(**options).plan(x, ctx)
    assert plan.num_removed == 17
    values = torch.randint(-8, 8, (2, plan.num_slots, 8)).float()
    y = plan.unmerge(values)  # [2, 35, 8], identical within groups; weights 1/3 are inexact: compare to rounding
    for backend in ("index", "dense"):
        p = plan.with_backend(backend)
        torch.testing.assert_close(p.unmerge(p.merge(y)), y, rtol=0, atol=1e-5)


def test_dense_and_index_backends_agree() -> None:
    x, ctx = random_case(3, 6, 8, seed=5)
    plan = IDM().plan(x, ctx)
    idx, dense = plan.with_backend("index"), plan.with_backend("dense")
    torch.testing.assert_close(idx.merge(x), dense.merge(x))
    y = torch.randn(3, plan.num_slots, 5)
    torch.testing.assert_close(idx.unmerge(y), dense.unmerge(y))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_low_precision_and_zero_tokens_are_finite(dtype: torch.dtype) -> None:
    x, _ = random_case(2, 5, 7, seed=6)
    x[0, :10] = 0  # zero destinations and sources
    x = x.to(dtype)
    ctx = MergeContext(grid=(5, 7), ratio=0.5, received_attention=torch.zeros(2, 35), streak=torch.zeros(2, 35))
    for strategy in (IDM(), IDM(local=True), IDM(variant="streak")):
        plan = strategy.plan(x, ctx)
        out = plan.unmerge(plan.merge(x))
        assert plan.num_removed == 17 and out.dtype == dtype and torch.isfinite(out).all()
        assert torch.isfinite(strategy.priority(ctx, 2, 35, x.device)).all()


def choice_gaps(strategy: IDM, x: torch.Tensor, ctx: MergeContext) -> tuple[torch.Tensor, torch.Tensor]:
    """Margins of IDM's two float32 choices (global matching, every sample): the gap between the ``r``-th and
    ``(r + 1)``-th priority among the sources ``[B]``, and, for each of the ``r`` merged sources, between its
    most and second most similar destination ``[B, r]`` (cosines computed plainly in float64). The
    destinations themselves are argmaxes of the raw received attention (no arithmetic, no rounding)."""
    B, N, _ = x.shape
    dst = strategy.select_destinations(x, ctx)  # [B, D]
    r = ctx.tokens_to_remove(N)
    P = strategy.priority(ctx, B, N, x.device).double()  # [B, N]
    P = P.scatter(1, dst, -torch.inf)  # destinations are no sources
    merged = P.topk(r, dim=1).indices  # [B, r]
    X = torch.nn.functional.normalize(x.double(), dim=-1, eps=EPS)  # [B, N, C]
    sim = torch.stack([X[b, merged[b]] @ X[b, dst[b]].T for b in range(B)])  # [B, r, D]
    return kth_gap(P, r), kth_gap(sim, 1)


@pytest.mark.tie_sensitive
def test_batch_equals_per_sample() -> None:
    x, ctx = random_case(3, 6, 8, seed=7)
    strategy = IDM()
    # No source may be within rounding of the r-th priority or of a second destination, or another batch
    # size's float32 rounding could choose differently.
    priority_gap, similarity_gap = choice_gaps(strategy, x, ctx)
    assert_clear(priority_gap, "sources by priority")
    assert_clear(similarity_gap, "destination of a merged source")
    batch = strategy.plan(x, ctx)
    for b in range(3):
        single_ctx = MergeContext(grid=(6, 8), ratio=0.5, received_attention=ctx.received_attention[b:b + 1],
                                  streak=ctx.streak[b:b + 1])
        single = strategy.plan(x[b:b + 1], single_ctx)
        assert torch.equal(batch.assign[b], single.assign[0])
        assert torch.equal(batch.dst[b], single.dst[0])
        torch.testing.assert_close(batch.merge(x)[b], single.merge(x[b:b + 1])[0])


def test_ratio_zero_is_identity() -> None:
    x, a = torch.randn(2, 16, 4), torch.rand(2, 16)
    assert IDM().plan(x, MergeContext(grid=(4, 4), ratio=0.0, received_attention=a)).is_identity


# ---------------------------------------------------------------------------------------- options
@pytest.mark.parametrize("options", [
    {"window": 1}, {"window": False}, {"alpha_d": -1.0}, {"alpha_d": float("inf")},
    {"variant": "attn"}, {"local": "yes"}, {"ratio": -0.1},
])
def test_invalid_options_raise(options: dict) -> None:
    with pytest.raises(ValueError):
        IDM(**options)


def test_registry_and_class_attributes() -> None:
    s = tomerge.get_strategy("idm", variant="streak", local=True, alpha_d=0.1, window=3)
    assert isinstance(s, IDM) and (s.variant, s.local, s.alpha_d, s.window) == ("streak", True, 0.1, 3)
    assert IDM.name == "idm" and IDM.uses_streak and IDM.default_sublayers == {"mlp"}
