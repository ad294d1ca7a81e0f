"""Tests of the `facility_location` strategy (ToMA) on inputs whose right answer is known by construction."""

from __future__ import annotations

import math

import pytest
import torch

import tomerge
from tomerge import MergeContext
from tomerge.strategies.facility_location import FacilityLocation
from helpers.ties import MARGIN, assert_clear, greedy_facility_location


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _clustered(labels: torch.Tensor, C: int = 8, noise: float = 0.05, seed: int = 0) -> torch.Tensor:
    """``[B, N, C]`` tokens: token n of sample b lies near axis ``labels[b, n]`` (orthogonal clusters),
    with a random length in (0.5, 2) and small noise, so cluster members differ but stay alike."""
    g = _gen(seed)
    B, N = labels.shape
    centers = torch.eye(C)[labels]  # [B, N, C]
    length = 0.5 + 1.5 * torch.rand(B, N, 1, generator=g)
    return centers * length + noise * torch.randn(B, N, C, generator=g)


def _four_clusters(B: int = 2) -> torch.Tensor:
    """Labels ``[B, 16]``: 4 clusters of 4 tokens, scattered differently in every sample."""
    g = _gen(1)
    return torch.stack([torch.arange(16)[torch.randperm(16, generator=g)] % 4 for _ in range(B)])


def _expected_tiles(grid: tuple[int, int], t: int) -> list[set[int]]:
    """Token sets of ``t x t`` tiles, tiles in raster order, built with plain loops."""
    H, W = grid
    tiles = []
    for ty in range(0, H, t):
        for tx in range(0, W, t):
            tiles.append({r * W + c for r in range(ty, min(ty + t, H)) for c in range(tx, min(tx + t, W))})
    return tiles


def _expected_stripes(N: int, length: int) -> list[set[int]]:
    return [set(range(start, min(start + length, N))) for start in range(0, N, length)]


def _greedy_gaps(x: torch.Tensor, dst: torch.Tensor, fl: FacilityLocation, ctx: MergeContext) -> torch.Tensor:
    """Checks that the destinations ``dst [B, T*d]`` are the greedy picks of the spec in every tile (tie-aware,
    float64, :func:`ties.greedy_facility_location`) and returns every step's gap between the best and the
    second-best gain, ``[B * T * d]``."""
    layout = fl.tile_layout(ctx.grid)  # [T, s]
    N = x.shape[1]
    T = layout.shape[0]
    X = torch.nn.functional.normalize(x.double(), dim=-1, eps=1e-6)  # [B, N, C]
    gaps = []
    for b in range(dst.shape[0]):
        for t, picks in enumerate(dst[b].view(T, -1).tolist()):
            tile = [p for p in layout[t].tolist() if p < N]
            gaps += greedy_facility_location(X[b, tile], [tile.index(p) for p in picks])
    return torch.tensor(gaps, dtype=torch.float64)


# ---------------------------------------------------------------------------------------- selection
def test_one_destination_per_cluster() -> None:
    labels = _four_clusters(B=3)
    x = _clustered(labels)
    ctx = MergeContext(grid=(4, 4), ratio=0.75)  # r = 12, one 4x4 tile, d = 4
    dst = FacilityLocation(tile_size=4).select_destinations(x, ctx)
    assert dst.shape == (3, 4)
    for b in range(3):
        assert sorted(labels[b, dst[b]].tolist()) == [0, 1, 2, 3]


def test_greedy_first_pick_maximises_row_sum() -> None:
    a, b = torch.tensor([1.0, 0.0, 0.0]), torch.tensor([0.0, 1.0, 0.0])
    middle = (a + b) / math.sqrt(2)  # the only token similar to all others
    x = torch.stack([a, a, b, b, middle, -a])[None]  # [1, 6, 3]
    dst = FacilityLocation(tile_size=3).select_destinations(x, MergeContext(grid=(2, 3), ratio=0.9))
    assert dst.tolist() == [[4]]


def test_greedy_later_picks_maximise_coverage_gain() -> None:
    labels = torch.tensor([[1, 0, 2, 0, 1, 0]])  # cluster 0: 3 tokens, cluster 1: 2, cluster 2: 1
    x = _clustered(labels, noise=0.01)
    fl = FacilityLocation(tile_size=3)  # one padded 3x3 tile over the 2x3 grid
    dst2 = fl.select_destinations(x, MergeContext(grid=(2, 3), ratio=0.7))  # d = 2
    dst3 = fl.select_destinations(x, MergeContext(grid=(2, 3), ratio=0.5))  # d = 3
    assert labels[0, dst2[0]].tolist() == [0, 1]
    assert labels[0, dst3[0]].tolist() == [0, 1, 2]


def test_mask_selected_prevents_duplicates_on_flat_tile() -> None:
    x = torch.ones(2, 16, 8)  # a flat tile: every gain after the first pick is 0
    ctx = MergeContext(grid=(4, 4), ratio=0.75)
    masked = FacilityLocation(tile_size=4).select_destinations(x, ctx)
    unmasked = FacilityLocation(tile_size=4, mask_selected=False).select_destinations(x, ctx)
    for b in range(2):
        assert len(set(masked[b].tolist())) == 4
        assert len(set(unmasked[b].tolist())) < 4


@pytest.mark.tie_sensitive
def test_shared_destinations() -> None:
    x = torch.randn(3, 64, 8, generator=_gen(2))
    ctx = MergeContext(grid=(8, 8), ratio=0.75)  # 4x4 tiles, d = 4
    own = FacilityLocation(num_tiles=4).select_destinations(x, ctx)
    # Sample 0's picks are computed in a batch of one (shared) and of three (own): no near tie may decide them.
    assert_clear(_greedy_gaps(x[:1], own[:1], FacilityLocation(num_tiles=4), ctx), "sample 0's greedy picks")
    shared = FacilityLocation(num_tiles=4, shared_destinations=True).select_destinations(x, ctx)
    assert not torch.equal(own[0], own[1])  # the inputs really ask for different destinations
    assert torch.equal(shared, own[:1].expand(3, -1))
    plan = FacilityLocation(num_tiles=4, shared_destinations=True).plan(x, ctx)
    assert plan.merge(x).shape == (3, 16, 8) and torch.equal(plan.dst, shared)


# ---------------------------------------------------------------------------------------- locality
def test_tile_side_rule() -> None:
    assert FacilityLocation(num_tiles=256).tile_side((64, 64)) == 4  # the authors' Flux setting
    assert FacilityLocation().tile_side((32, 32)) == 4
    assert FacilityLocation(num_tiles=4).tile_side((6, 10)) == 4  # round(sqrt(15))
    assert FacilityLocation().tile_side((6, 10)) == 1
    assert FacilityLocation(tile_size=3).tile_side((64, 64)) == 3


@pytest.mark.parametrize("locality,options,grid,expected", [
    ("tiles", {"tile_size": 2}, (4, 6), _expected_tiles((4, 6), 2)),
    ("tiles", {"tile_size": 3}, (7, 9), _expected_tiles((7, 9), 3)),
    ("tiles", {"tile_size": 4}, (6, 10), _expected_tiles((6, 10), 4)),
    ("stripes", {"num_tiles": 5}, (4, 6), _expected_stripes(24, 5)),
    ("stripes", {"num_tiles": 10}, (4, 6), _expected_stripes(24, 3)),  # 8 stripes of 3, none empty
    ("stripes", {"num_tiles": 8}, (7, 9), _expected_stripes(63, 8)),
])
def test_layout_and_plan_respect_tiles(locality: str, options: dict, grid: tuple[int, int],
                                       expected: list[set[int]]) -> None:
    fl = FacilityLocation(locality=locality, **options)
    N = grid[0] * grid[1]
    layout = fl.tile_layout(grid)
    assert [set(row[row < N].tolist()) for row in layout] == expected
    x = torch.randn(2, N, 6, generator=_gen(3))
    ctx = MergeContext(grid=grid, ratio=0.5)
    plan = fl.plan(x, ctx)
    d = plan.num_slots // len(expected)
    W, U = plan.dense()  # [B, M, N], [B, N, M]
    for b in range(2):
        for m in range(plan.num_slots):
            tile = expected[m // d]
            assert plan.dst[b, m].item() in tile
            outside = [n for n in range(N) if n not in tile]
            assert W[b, m, outside].abs().max() == 0 and U[b, outside, m].abs().max() == 0


def test_fewest_members_is_the_smallest_tile_of_the_layout() -> None:
    """The greedy loop's exhaustion check is skipped until this many picks, so it must not overstate."""
    for H in range(1, 14):
        for W in range(1, 14):
            for fl in (FacilityLocation(tile_size=3), FacilityLocation(tile_size=5), FacilityLocation(num_tiles=4),
                       FacilityLocation(locality="stripes", num_tiles=7)):
                layout = fl.tile_layout((H, W))
                assert fl._fewest_members((H, W)) == int((layout < H * W).sum(-1).min())


@pytest.mark.parametrize("grid", [(6, 10), (7, 9)])
@pytest.mark.parametrize("locality,options", [("tiles", {"tile_size": 3}), ("tiles", {"tile_size": 4}),
                                              ("stripes", {"num_tiles": 7})])
@pytest.mark.parametrize("ratio", [0.2, 0.6])
def test_non_square_and_padded_grids(grid: tuple[int, int], locality: str, options: dict, ratio: float) -> None:
    H, W = grid
    N = H * W
    fl = FacilityLocation(locality=locality, **options)
    if locality == "tiles":
        t = options["tile_size"]
        tiles = _expected_tiles(grid, t)
    else:
        tiles = _expected_stripes(N, math.ceil(N / options["num_tiles"]))
    T = len(tiles)
    r = int(N * ratio)
    d = max(1, (N - r) // T)
    x = torch.randn(2, N, 5, generator=_gen(4))
    plan = fl.plan(x, MergeContext(grid=grid, ratio=ratio))
    assert plan.num_slots == T * d and plan.num_removed >= r
    for b in range(2):  # every pick is a real token of its own tile (padding is never selected)
        assert all(plan.dst[b, m].item() in tiles[m // d] for m in range(T * d))
    pad = plan.tile_tokens == N  # [T, s]
    side = options.get("tile_size")
    slots = T * side * side if locality == "tiles" else T * math.ceil(N / options["num_tiles"])
    assert int(pad.sum()) == slots - N  # padding slots in the layout
    assert plan.merge_weights.permute(0, 2, 1, 3)[:, :, pad].abs().sum() == 0  # [B, d, P]: no weight on padding
    assert torch.allclose(plan.merge_weights.sum(-1), torch.ones(2, T, d))
    y = plan.merge(x)
    assert y.shape == (2, T * d, 5) and plan.unmerge(y).shape == (2, N, 5)


def test_small_edge_tiles_repeat_real_tokens_not_padding() -> None:
    # 5x5 with 4x4 tiles: edge tiles hold 4, 4 and 1 real tokens, but d = (25 - 5) // 4 = 5
    x = torch.randn(2, 25, 4, generator=_gen(5))
    plan = FacilityLocation(tile_size=4).plan(x, MergeContext(grid=(5, 5), ratio=0.2))
    tiles = _expected_tiles((5, 5), 4)
    assert plan.num_slots == 20
    for b in range(2):
        picks = plan.dst[b].view(4, 5)
        for t, tile in enumerate(tiles):
            assert set(picks[t].tolist()) <= tile
            assert len(set(picks[t].tolist())) == min(len(tile), 5)  # distinct while real tokens last
    W, U = plan.dense()
    assert torch.allclose(W.sum(-1), torch.ones(2, 20)) and torch.allclose(U.sum(-1), torch.ones(2, 25))


def test_too_many_tiles_warns() -> None:
    x = torch.randn(1, 60, 4, generator=_gen(6))
    with pytest.warns(UserWarning, match="fewer tiles"):
        plan = FacilityLocation().plan(x, MergeContext(grid=(6, 10), ratio=0.5))  # 60 tiles of 1 token
    assert plan.num_slots == 60


# ---------------------------------------------------------------------------------------- matrices
def test_merge_gives_cluster_means() -> None:
    labels = _four_clusters(B=2)
    x = _clustered(labels)
    plan = FacilityLocation(tile_size=4).plan(x, MergeContext(grid=(4, 4), ratio=0.75))
    y, back = plan.merge(x), plan.unmerge(plan.merge(x))
    for b in range(2):
        means = {k: x[b, labels[b] == k].mean(0) for k in range(4)}
        for m in range(4):
            assert torch.allclose(y[b, m], means[labels[b, plan.dst[b, m]].item()], atol=1e-5)
        for n in range(16):
            assert torch.allclose(back[b, n], means[labels[b, n].item()], atol=1e-5)


def test_identical_groups_round_trip() -> None:
    labels = _four_clusters(B=2)
    x = _clustered(labels, noise=0.0) / _clustered(labels, noise=0.0).norm(dim=-1, keepdim=True)
    plan = FacilityLocation(tile_size=4).plan(x, MergeContext(grid=(4, 4), ratio=0.75))
    assert torch.allclose(plan.unmerge(plan.merge(x)), x, atol=1e-6)


def test_pinv_unmerge() -> None:
    labels = _four_clusters(B=2)
    x = _clustered(labels)
    ctx = MergeContext(grid=(4, 4), ratio=0.75)
    hard_pinv = FacilityLocation(tile_size=4, unmerge_matrix="pinv").plan(x, ctx)
    hard_t = FacilityLocation(tile_size=4).plan(x, ctx)
    eye = torch.eye(4).expand(2, 1, 4, 4)
    assert torch.allclose(hard_pinv.merge_weights @ hard_pinv.unmerge_weights, eye, atol=1e-5)
    assert torch.allclose(hard_pinv.unmerge_weights, hard_t.unmerge_weights, atol=1e-5)  # pinv(W) = A^T if hard
    # soft assignment: pinv still inverts W on the slots, the raw transpose does not
    soft = torch.randn(2, 16, 8, generator=_gen(7))
    soft_pinv = FacilityLocation(tile_size=4, unmerge_matrix="pinv", temperature=0.5).plan(soft, ctx)
    soft_t = FacilityLocation(tile_size=4, temperature=0.5).plan(soft, ctx)
    assert torch.allclose(soft_pinv.merge_weights @ soft_pinv.unmerge_weights, eye, atol=1e-4)
    assert not torch.allclose(soft_t.merge_weights @ soft_t.unmerge_weights, eye, atol=1e-2)


@pytest.mark.parametrize("temperature", [1e-3, 0.1, 10.0])
def test_rows_sum_to_one_and_unmerge_is_raw_transpose(temperature: float) -> None:
    x = torch.randn(2, 63, 6, generator=_gen(8))
    plan = FacilityLocation(tile_size=4, temperature=temperature).plan(x, MergeContext(grid=(7, 9), ratio=0.5))
    W, U = plan.merge_weights, plan.unmerge_weights  # [B, T, d, s], [B, T, s, d]
    assert torch.allclose(W.sum(-1), torch.ones(W.shape[:-1]), atol=1e-5)
    real = plan.tile_tokens < 63  # [T, s]
    assert torch.allclose(U.sum(-1)[:, real], torch.ones(2, int(real.sum())), atol=1e-5)  # columns of A
    assert torch.allclose(W, U.transpose(-1, -2) / U.sum(-2).unsqueeze(-1), atol=1e-6)


def test_dense_agrees_with_merge_and_unmerge() -> None:
    x = torch.randn(2, 63, 6, generator=_gen(9))
    for fl in (FacilityLocation(tile_size=4, temperature=0.1), FacilityLocation(locality="stripes", num_tiles=5)):
        plan = fl.plan(x, MergeContext(grid=(7, 9), ratio=0.4))
        W, U = plan.dense()
        y = torch.randn(2, plan.num_slots, 3, generator=_gen(10))
        assert torch.allclose(W @ x, plan.merge(x), atol=1e-5)
        assert torch.allclose(U @ y, plan.unmerge(y), atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_low_precision_and_zero_tokens_are_finite(dtype: torch.dtype) -> None:
    x = torch.randn(2, 63, 8, generator=_gen(11)).to(dtype)
    x[0, :10] = 0  # zero tokens, among them a whole 3x3 tile of sample 0
    x[0, 9:12] = 0
    x[0, 18:21] = 0
    x[1] = 0  # an all-zero sample
    for fl in (FacilityLocation(tile_size=3), FacilityLocation(tile_size=4, unmerge_matrix="pinv"),
               FacilityLocation(locality="stripes", num_tiles=6, mask_selected=False)):
        plan = fl.plan(x, MergeContext(grid=(7, 9), ratio=0.5))
        assert plan.dst.max() < 63
        assert torch.isfinite(plan.merge_weights).all() and torch.isfinite(plan.unmerge_weights).all()
        y = plan.merge(x)
        out = plan.unmerge(y)
        assert y.dtype == dtype and torch.isfinite(y).all() and torch.isfinite(out).all()
        assert out[1].abs().max() == 0


@pytest.mark.tie_sensitive
def test_batch_equals_per_sample() -> None:
    # 3x3 tiles of a 7x9 grid (the bottom tiles are 1x3, padded), d = 3. Random tokens would give exact ties
    # (two candidates that only cover each other have equal gains), which float32 rounding of another batch
    # size may break the other way; here every tile row is a cluster of three (its axis drawn per sample),
    # so the picks cover one row each and every greedy step has a clear winner.
    rows = torch.arange(63) // 9 % 3  # [N] row of every token inside its tile
    labels = torch.stack([torch.randperm(6, generator=_gen(20 + b))[rows] for b in range(3)])  # [3, N]
    x = _clustered(labels, C=6, noise=0.1, seed=12)  # [3, 63, 6]
    ctx = MergeContext(grid=(7, 9), ratio=0.5)
    fl = FacilityLocation(tile_size=3, temperature=0.05)
    batch = fl.plan(x, ctx)
    assert_clear(_greedy_gaps(x, batch.dst, fl, ctx), "greedy picks")
    assert not torch.equal(batch.dst[0], batch.dst[1])  # the samples ask for different destinations
    for b in range(3):
        alone = fl.plan(x[b:b + 1], ctx)
        assert torch.equal(batch.dst[b:b + 1], alone.dst)
        assert torch.allclose(batch.merge_weights[b:b + 1], alone.merge_weights, atol=1e-6)
        assert torch.allclose(batch.merge(x)[b:b + 1], alone.merge(x[b:b + 1]), atol=1e-5)


# ---------------------------------------------------------------------------------------- options
def test_registry() -> None:
    assert "facility_location" in tomerge.list_strategies()
    s = tomerge.get_strategy("facility_location", num_tiles=16)
    assert isinstance(s, FacilityLocation) and s.num_tiles == 16


@pytest.mark.parametrize("options,match", [
    ({"locality": "rows"}, "locality"),
    ({"num_tiles": 0}, "num_tiles"),
    ({"num_tiles": 2.5}, "num_tiles"),
    ({"tile_size": 0}, "tile_size"),
    ({"locality": "stripes", "tile_size": 4}, "stripes"),
    ({"temperature": 0.0}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"mask_selected": 1}, "mask_selected"),
    ({"shared_destinations": "yes"}, "shared_destinations"),
    ({"unmerge_matrix": "inverse"}, "unmerge_matrix"),
    ({"ratio": 1.0}, "ratio"),
])
def test_invalid_options_raise(options: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        FacilityLocation(**options)


def test_bad_dst_shape_raises() -> None:
    x = torch.randn(1, 16, 4, generator=_gen(14))
    with pytest.raises(ValueError, match="select_destinations"):
        FacilityLocation(tile_size=2).merge_matrix(x, torch.zeros(1, 5, dtype=torch.long),
                                                   MergeContext(grid=(4, 4), ratio=0.5))


def test_dst_outside_its_tile_raises() -> None:
    x = torch.randn(1, 16, 4, generator=_gen(15))
    ctx = MergeContext(grid=(4, 4), ratio=0.75)  # 2x2 tiles, one destination each
    fl = FacilityLocation(tile_size=2)
    dst = fl.select_destinations(x, ctx)
    with pytest.raises(ValueError, match="tile"):
        fl.merge_matrix(x, dst.flip(-1), ctx)  # slot 0 now holds a token of the last tile
    with pytest.raises(ValueError, match="select_destinations"):
        fl.merge_matrix(x, torch.full_like(dst, 16), ctx)  # not a token position


# ---------------------------------------------------------------------------------------- the spec, literally
def _spec_merge_weights(X: torch.Tensor, chosen: list[int], tau: float) -> torch.Tensor:
    """``L = X_dst X_tile^T``, ``A = softmax(L / tau)`` over destinations, ``W = A / A.sum(-1)`` (float64),
    for one tile's unit features ``X [s, C]`` and its picks."""
    L = X[chosen] @ X.T  # [d, s]
    A = torch.softmax(L / tau, dim=0)  # [d, s]
    return A / A.sum(-1, keepdim=True)  # [d, s]


@pytest.mark.tie_sensitive
@pytest.mark.parametrize("tau", [1e-3, 0.05])
def test_matches_the_spec_computed_plainly(tau: float) -> None:
    """Destinations and merge matrix against the spec's formulas computed plainly in float64, one sample and
    tile at a time (:func:`ties.greedy_facility_location`).

    Clustered tokens have exact ties: a cluster of two tokens a, b gives them the same gain by symmetry,
    ``(1 - m_a) + (S_ab - m_b)``, and float32 rounding (vector width, threads) decides which one the plan
    takes. So the spec's greedy is tie-aware: every pick must be one of the best candidates in float64 and
    the spec continues from it; most steps must have a single clear winner, so the check is not vacuous."""
    g = _gen(16)
    labels = torch.randint(0, 6, (2, 64), generator=g)
    x = _clustered(labels, C=12, noise=0.2, seed=17)
    ctx = MergeContext(grid=(8, 8), ratio=0.75)  # 4x4 tiles, d = 4
    fl = FacilityLocation(tile_size=4, temperature=tau)
    plan = fl.plan(x, ctx)
    tiles = [sorted(t) for t in _expected_tiles((8, 8), 4)]
    X = torch.nn.functional.normalize(x.double(), dim=-1, eps=1e-6)  # [B, N, C] unit features
    gaps = []
    for b in range(2):
        picks = plan.dst[b].view(4, 4).tolist()  # [T, d] token positions
        for t, tile in enumerate(tiles):
            assert set(picks[t]) <= set(tile)
            chosen = [tile.index(p) for p in picks[t]]  # member indices, in pick order
            gaps += greedy_facility_location(X[b, tile], chosen)  # asserts every pick is a best candidate
            W = _spec_merge_weights(X[b, tile], chosen, tau)  # [d, s]
            assert torch.allclose(plan.merge_weights[b, t].double(), W, atol=1e-4)
    clear = sum(gap > MARGIN for gap in gaps)
    assert clear >= 0.9 * len(gaps), f"only {clear} of {len(gaps)} greedy steps have a clear winner"


def test_plan_computes_the_tile_similarities_once_and_shares_them(monkeypatch):
    """``plan`` computes the tile similarities once and passes them to both stages; the stages called on their
    own compute them themselves and give the same plan, bit for bit."""
    import tomerge.strategies.facility_location as module

    calls = []
    original = module._similarities
    monkeypatch.setattr(module, "_similarities", lambda x, layout: calls.append(x.shape) or original(x, layout))
    x = torch.randn(2, 64, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    for shared in (False, True):
        strategy = FacilityLocation(num_tiles=4, shared_destinations=shared)
        ctx = MergeContext(grid=(8, 8), ratio=0.5)
        calls.clear()
        plan = strategy.plan(x, ctx)
        assert len(calls) == 1
        calls.clear()
        alone = strategy.merge_matrix(x, strategy.select_destinations(x, ctx), ctx)
        assert len(calls) == 2  # each stage on its own
        assert torch.equal(plan.dst, alone.dst) and torch.equal(plan.merge_weights, alone.merge_weights)
        assert torch.equal(plan.unmerge_weights, alone.unmerge_weights)
