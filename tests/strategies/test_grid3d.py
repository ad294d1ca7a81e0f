"""Video token grids ``(T, H, W)`` (docs/strategies.md, "3-D (video) token grids"): the context, what every built-in
strategy's windows, cells and tiles mean in 3-D (hand-made cases), the contract with the 3-D options, leftovers of
grids not divisible in time, and ``T = 1`` planning exactly as the 2-D grid."""

from __future__ import annotations

import pytest
import torch

from tomerge import MergeContext, MergePlan
from tomerge.contract import check_strategy
from tomerge.strategies.facility_location import FacilityLocation
from tomerge.strategies.idm import IDM
from tomerge.strategies.sdtm import SDTM
from tomerge.strategies.ssm import SSM, window_tokens
from tomerge.strategies.toma import ToMA
from tomerge.strategies.tomesd import ToMeSD
from helpers.ties import assert_clear, kth_gap

E = torch.eye(16, dtype=torch.float64)  # orthogonal directions: similarities far from any tie


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def pos(t: int, h: int, w: int, grid: tuple[int, int, int]) -> int:
    """Raster index of token ``(t, h, w)`` of a ``(T, H, W)`` grid, written out."""
    _, H, W = grid
    return (t * H + h) * W + w


def groups(plan: MergePlan, b: int = 0) -> set[frozenset[int]]:
    """Merge groups of a hard plan: the token sets sharing a slot."""
    out: dict[int, set[int]] = {}
    for token, slot in enumerate(plan.slot_of_token[b].tolist()):
        out.setdefault(slot, set()).add(token)
    return {frozenset(g) for g in out.values()}


def frames_of(tokens, frame_tokens: int) -> set[int]:
    return {t // frame_tokens for t in tokens}


# ---------------------------------------------------------------------------------------- the context
def test_context_takes_a_video_grid() -> None:
    ctx = MergeContext(grid=[2, 3, 4], ratio=0.5)
    assert ctx.grid == (2, 3, 4)
    assert (ctx.num_tokens, ctx.frames, ctx.height, ctx.width, ctx.frame_tokens) == (24, 2, 3, 4, 12)
    image = MergeContext(grid=(3, 4), ratio=0.5)
    assert (image.num_tokens, image.frames, image.height, image.width, image.frame_tokens) == (12, 1, 3, 4, 12)
    assert ctx.check_tokens(torch.zeros(1, 24, 5)) == (1, 24, 5)
    with pytest.raises(ValueError, match=r"do not fill the grid \(2, 3, 4\)"):
        ctx.check_tokens(torch.zeros(1, 12, 5))


@pytest.mark.parametrize("grid", [(2, 3, 4, 5), (4,), (0, 4), (2, 0, 4), (True, 4), (2.0, 4), "16x16", None])
def test_context_rejects_bad_grids(grid) -> None:
    with pytest.raises(ValueError, match=r"grid must be \(H, W\) or \(T, H, W\) with positive ints"):
        MergeContext(grid=grid, ratio=0.5)


# ---------------------------------------------------------------------------------------- tomesd
def test_tomesd_st1_gives_every_frame_frame_zeros_destinations() -> None:
    grid = (3, 4, 6)
    x = torch.randn(2, 72, 8, generator=_gen(0))
    ctx = MergeContext(grid=grid, ratio=0.5, generator=_gen(7))
    dst = ToMeSD(use_rand=True).select_destinations(x, ctx)[0].tolist()  # [D]
    assert len(dst) == 3 * 2 * 3  # 2 x 3 cells per frame
    frame0 = dst[:6]
    for t in (1, 2):  # frame t's destinations are frame 0's shifted by t * H * W
        assert dst[6 * t:6 * (t + 1)] == [d + 24 * t for d in frame0]
    for cy in range(2):  # frame 0: one destination in every 2x2 cell
        for cx in range(3):
            cell = {pos(0, cy * 2 + dy, cx * 2 + dx, grid) for dy in range(2) for dx in range(2)}
            assert len(cell & set(frame0)) == 1
    plan = ToMeSD(use_rand=True).plan(x, MergeContext(grid=grid, ratio=0.5, generator=_gen(7)))
    assert plan.num_removed == 36


def test_tomesd_st2_puts_one_destination_in_every_box() -> None:
    grid = (4, 4, 4)
    corners = [pos(t, y, x, grid) for t in (0, 2) for y in (0, 2) for x in (0, 2)]
    x = torch.randn(2, 64, 8, generator=_gen(1))
    fixed = ToMeSD(st=2, use_rand=False).select_destinations(x, MergeContext(grid=grid, ratio=0.5))
    assert fixed[0].tolist() == corners  # the first token of every 2x2x2 box
    boxes = [{pos(t + a, y + b, x_ + c, grid) for a in range(2) for b in range(2) for c in range(2)}
             for t in (0, 2) for y in (0, 2) for x_ in (0, 2)]
    later_frame = 0
    for seed in range(10):
        dst = ToMeSD(st=2).select_destinations(x, MergeContext(grid=grid, ratio=0.5, generator=_gen(seed)))[0]
        assert [len(box & set(dst.tolist())) for box in boxes] == [1] * 8
        later_frame += int((dst // 16 % 2 == 1).sum())  # destinations in the second frame of their box
    assert later_frame > 0  # the draw covers the box's frames, not only its first one


def test_tomesd_temporal_only_cells_and_leftover_frames() -> None:
    x = torch.randn(1, 20, 8, generator=_gen(2))
    plan = ToMeSD(sx=1, sy=1, st=2, use_rand=False).plan(x, MergeContext(grid=(5, 2, 2), ratio=0.5))
    assert plan.dst[0, :8].tolist() == [0, 1, 2, 3, 8, 9, 10, 11]  # frames 0 and 2; frame 4 is left over
    assert plan.num_removed == 10
    with pytest.warns(UserWarning, match="only 12 are sources"):  # frame 4's tokens are sources, like rows
        capped = ToMeSD(sx=1, sy=1, st=2, use_rand=False).plan(x, MergeContext(grid=(5, 2, 2), ratio=0.9))
    assert capped.num_removed == 12


def test_tomesd_matches_across_frames() -> None:
    """Matching is global over the clip: a source merges into its most similar destination in any frame."""
    grid = (2, 2, 2)  # one 2x2 cell per frame; use_rand=False: destinations 0 (frame 0) and 4 (frame 1)
    x = torch.zeros(1, 8, 16, dtype=torch.float64)
    x[0, 0], x[0, 4] = E[0], E[1]
    for token, axis in [(1, 1), (2, 1), (3, 1), (5, 0), (6, 0), (7, 0)]:  # frame 0 is like frame 1's dst, and back
        x[0, token] = E[axis] + 0.1 * E[2 + token]
    plan = ToMeSD(use_rand=False).plan(x, MergeContext(grid=grid, ratio=0.75))  # r = 6: every source
    assert groups(plan) == {frozenset({4, 1, 2, 3}), frozenset({0, 5, 6, 7})}


def test_tomesd_rejects_too_few_frames_and_bad_st() -> None:
    x = torch.randn(2, 16, 4)
    for grid in [(4, 4), (1, 4, 4)]:  # a 2-D grid is one frame
        with pytest.raises(ValueError, match="fewer than one cell of st=2 frames"):
            ToMeSD(st=2).plan(x, MergeContext(grid=grid, ratio=0.5, generator=_gen(0)))
    with pytest.raises(ValueError, match="^tomesd: st must be an int >= 1"):
        ToMeSD(st=0)
    with pytest.raises(ValueError, match="^tomesd: sx and sy"):
        ToMeSD(sx=1, sy=1, st=1)


# ---------------------------------------------------------------------------------------- ssm
def test_window_tokens_in_3d() -> None:
    grid = (5, 4, 6)
    expected = [[pos(t + a, y + b, x + c, grid) for a in range(2) for b in range(2) for c in range(2)]
                for t in (0, 2) for y in (0, 2) for x in (0, 2, 4)]  # frame 4 is left over
    assert window_tokens(grid, 2, temporal_window=2).tolist() == expected
    per_frame = [[pos(t, y + b, x + c, grid) for b in range(2) for c in range(2)]
                 for t in range(5) for y in (0, 2) for x in (0, 2, 4)]
    assert window_tokens(grid, 2).tolist() == per_frame


def test_ssm_windows_never_mix_frames_by_default() -> None:
    grid = (3, 4, 4)
    x = torch.randn(2, 48, 8, generator=_gen(3))
    plan = SSM(round_windows=1).plan(x, MergeContext(grid=grid, ratio=0.5))  # r = 24 -> 8 windows
    assert plan.num_removed == 24
    for b in range(2):
        merged = [g for g in groups(plan, b) if len(g) > 1]
        assert len(merged) == 8
        for g in merged:  # a 2x2 window of one frame
            first = min(g)
            t, y, x_ = first // 16, first // 4 % 4, first % 4
            assert y % 2 == 0 and x_ % 2 == 0
            assert g == {pos(t, y + dy, x_ + dx, grid) for dy in range(2) for dx in range(2)}


def test_ssm_temporal_window_merges_the_flat_space_time_box() -> None:
    grid = (2, 2, 4)  # two 2x2x2 boxes: {0,1,4,5,8,9,12,13} and {2,3,6,7,10,11,14,15}
    box = [pos(t, y, x, grid) for t in range(2) for y in range(2) for x in range(2)]
    x = torch.randn(1, 16, 16, generator=_gen(4), dtype=torch.float64)
    x[0, box] = E[0] + 0.01 * torch.randn(8, 16, generator=_gen(5), dtype=torch.float64)
    unit = torch.nn.functional.normalize(x[0], dim=-1)
    scores = []
    for members in (box, [p for p in range(16) if p not in box]):  # mean off-diagonal cosine, by hand
        gram = unit[members] @ unit[members].T
        scores.append(float((gram.sum() - gram.trace()) / (8 * 7)))
    assert_clear(kth_gap(torch.tensor([scores]), 1), "the flat box")
    plan = SSM(temporal_window=2, round_windows=1).plan(x, MergeContext(grid=grid, ratio=7 / 16))  # r = 7 -> 1 box
    assert plan.num_removed == 7
    assert groups(plan) == {frozenset(box)} | {frozenset({p}) for p in range(16) if p not in box}


def test_ssm_leftover_frames_stay_single_and_cap_warns() -> None:
    x = torch.randn(1, 48, 8, generator=_gen(6))
    with pytest.warns(UserWarning, match="only 4 full 2x2x2 windows"):
        plan = SSM(temporal_window=2, round_windows=1).plan(x, MergeContext(grid=(3, 4, 4), ratio=0.9))
    assert plan.num_removed == 4 * 7
    assert all(len(g) == 1 for g in groups(plan) if min(g) >= 32)  # frame 2 has no window
    with pytest.warns(UserWarning, match="only 0 full 2x2x2 windows"):  # a 2-D grid is one frame
        assert SSM(temporal_window=2).plan(torch.randn(1, 16, 8), MergeContext(grid=(4, 4), ratio=0.5)).is_identity
    with pytest.raises(ValueError, match="^ssm: temporal_window must be an int >= 1"):
        SSM(temporal_window=0)


# ---------------------------------------------------------------------------------------- idm
def _two_frame_case() -> tuple[torch.Tensor, torch.Tensor]:
    """Grid (2, 2, 2), 2x2 windows: frame 0 = {0..3}, frame 1 = {4..7}. Destinations (most attended): 0 and 4,
    features e0 and e1; frame 0's sources are like frame 1's destination and the other way round."""
    x = torch.zeros(1, 8, 16, dtype=torch.float64)
    a = torch.tensor([[1.0, 0.1, 0.2, 0.3, 0.9, 0.4, 0.5, 0.6]], dtype=torch.float64)
    x[0, 0], x[0, 4] = E[0], E[1]
    for token, axis in [(1, 1), (2, 1), (3, 1), (5, 0), (6, 0), (7, 0)]:
        x[0, token] = E[axis] + 0.1 * E[2 + token]
    return x, a


def test_idm_global_matching_crosses_frames_local_does_not() -> None:
    x, a = _two_frame_case()
    ctx = MergeContext(grid=(2, 2, 2), ratio=0.75, received_attention=a)  # r = 6
    plan = IDM().plan(x, ctx)
    assert plan.dst[0, :2].tolist() == [0, 4]
    assert groups(plan) == {frozenset({4, 1, 2, 3}), frozenset({0, 5, 6, 7})}
    local = IDM(local=True).plan(x, ctx)
    assert groups(local) == {frozenset({0, 1, 2, 3}), frozenset({4, 5, 6, 7})}


def test_idm_per_frame_windows_and_temporal_window() -> None:
    grid = (2, 4, 4)
    x = torch.randn(2, 32, 8, generator=_gen(8))
    a = torch.randperm(32, generator=_gen(9)).float().expand(2, 32)  # distinct: no ties
    dst = IDM().select_destinations(x, MergeContext(grid=grid, ratio=0.5, received_attention=a))[0].tolist()
    windows = [{pos(t, y + b, x_ + c, grid) for b in range(2) for c in range(2)}
               for t in range(2) for y in (0, 2) for x_ in (0, 2)]
    assert dst == [max(w, key=lambda p: a[0, p].item()) for w in windows]  # most attended of every frame's window
    boxes = [{pos(t, y + b, x_ + c, grid) for t in range(2) for b in range(2) for c in range(2)}
             for y in (0, 2) for x_ in (0, 2)]
    deep = IDM(temporal_window=2).select_destinations(x, MergeContext(grid=grid, ratio=0.5, received_attention=a))
    assert deep[0].tolist() == [max(w, key=lambda p: a[0, p].item()) for w in boxes]
    plan = IDM(local=True).plan(x, MergeContext(grid=grid, ratio=0.5, received_attention=a))
    assert plan.num_removed == 16
    assert all(len(frames_of(g, 16)) == 1 for g in groups(plan))  # local, per frame: no group spans frames


def test_idm_leftover_frames_never_merge_locally() -> None:
    x = torch.randn(1, 12, 8, generator=_gen(10))
    a = torch.rand(1, 12, generator=_gen(11))
    with pytest.warns(UserWarning, match="2x2x2 windows has only 7 sources inside full windows"):
        plan = IDM(temporal_window=2, local=True).plan(
            x, MergeContext(grid=(3, 2, 2), ratio=0.9, received_attention=a))  # r = 10 > 7
    assert plan.num_removed == 7
    assert all(len(g) == 1 for g in groups(plan) if min(g) >= 8)  # frame 2 is outside every window
    with pytest.raises(ValueError, match="^idm: temporal_window must be an int >= 1"):
        IDM(temporal_window=0)


# ---------------------------------------------------------------------------------------- facility_location
def _box_tiles(grid: tuple[int, int, int], side: int, depth: int) -> list[set[int]]:
    """Token sets of ``depth x side x side`` tiles, tiles in raster order (frame group, row, column), by loops."""
    T, H, W = grid
    tiles = []
    for t0 in range(0, T, depth):
        for y0 in range(0, H, side):
            for x0 in range(0, W, side):
                tiles.append({pos(t, y, x, grid) for t in range(t0, min(t0 + depth, T))
                              for y in range(y0, min(y0 + side, H)) for x in range(x0, min(x0 + side, W))})
    return tiles


def _frame_stripes(grid: tuple[int, int, int], length: int, depth: int) -> list[set[int]]:
    """Runs of ``length`` consecutive tokens inside every group of ``depth`` frames, by loops."""
    T, H, W = grid
    stripes = []
    for t0 in range(0, T, depth):
        start, end = t0 * H * W, min(t0 + depth, T) * H * W
        stripes += [set(range(s, min(s + length, end))) for s in range(start, end, length)]
    return stripes


@pytest.mark.parametrize("options,grid,expected", [
    ({"num_tiles": 4}, (3, 4, 4), _box_tiles((3, 4, 4), 2, 1)),  # side round(sqrt(16 / 4)) = 2, per frame
    ({"tile_size": 3}, (2, 4, 5), _box_tiles((2, 4, 5), 3, 1)),
    ({"tile_size": 2, "tile_frames": 2}, (3, 4, 4), _box_tiles((3, 4, 4), 2, 2)),  # last group: frame 2 alone
    ({"locality": "stripes", "num_tiles": 4}, (2, 3, 5), _frame_stripes((2, 3, 5), 4, 1)),  # ceil(15 / 4) = 4
    ({"locality": "stripes", "num_tiles": 2, "tile_frames": 2}, (3, 2, 3), _frame_stripes((3, 2, 3), 6, 2)),
    ({"locality": "stripes", "num_tiles": 3, "tile_frames": 2}, (3, 2, 4), _frame_stripes((3, 2, 4), 6, 2)),
])
def test_facility_location_tiles_in_3d(options: dict, grid: tuple[int, int, int], expected: list[set[int]]) -> None:
    fl = FacilityLocation(**options)
    T, H, W = grid
    N = T * H * W
    layout = fl.tile_layout(grid)  # [tiles, s]
    assert [set(row[row < N].tolist()) for row in layout] == expected
    assert fl._fewest_members(grid) == min(len(tile) for tile in expected)
    if options.get("tile_frames", 1) == 1:
        assert all(len(frames_of(tile, H * W)) == 1 for tile in expected)  # no tile crosses frames
    x = torch.randn(2, N, 6, generator=_gen(12))
    plan = fl.plan(x, MergeContext(grid=grid, ratio=0.5))
    d = plan.num_slots // len(expected)
    W_, U = plan.dense()  # [B, M, N], [B, N, M]
    for b in range(2):
        for m in range(plan.num_slots):  # every slot draws only on the tokens of its own tile
            tile = expected[m // d]
            outside = [n for n in range(N) if n not in tile]
            assert plan.dst[b, m].item() in tile
            assert W_[b, m, outside].abs().max() == 0 and U[b, outside, m].abs().max() == 0


def test_facility_location_destinations_per_frame_or_per_box() -> None:
    """Grid (2, 2, 2), one 2x2 tile per frame; 7 tokens near e0, token 3 (frame 0) near e1, ratio 0.75."""
    x = E[0].repeat(1, 8, 1) + 0.05 * torch.randn(1, 8, 16, generator=_gen(13), dtype=torch.float64)
    x[0, 3] = E[1] + 0.05 * E[2]
    per_frame = FacilityLocation(tile_size=2).plan(x, MergeContext(grid=(2, 2, 2), ratio=0.75))  # d = 1 per tile
    assert sorted(frames_of(per_frame.dst[0].tolist(), 4)) == [0, 1]  # one destination in each frame
    box = FacilityLocation(tile_size=2, tile_frames=2).plan(x, MergeContext(grid=(2, 2, 2), ratio=0.75))  # d = 2
    first, second = box.dst[0].tolist()
    assert first != 3 and second == 3  # the e0 cluster spans both frames; the second pick covers token 3
    unit = torch.nn.functional.normalize(x[0], dim=-1)
    gain = (unit @ unit.T).sum(-1)  # [8] first-pick gains, by hand in float64
    assert_clear(kth_gap(gain[None], 1), "the first pick")
    assert first == int(gain.argmax())


def test_facility_location_removes_the_right_count_in_3d() -> None:
    x = torch.randn(2, 128, 8, generator=_gen(14))
    for fl, tiles in [(FacilityLocation(tile_size=4), 8), (FacilityLocation(tile_size=4, tile_frames=2), 4)]:
        plan = fl.plan(x, MergeContext(grid=(2, 8, 8), ratio=0.5))  # r = 64, d = 64 // tiles
        assert plan.tile_tokens.shape[0] == tiles and plan.num_removed == 64
    with pytest.raises(ValueError, match="^facility_location: tile_frames must be an int >= 1"):
        FacilityLocation(tile_frames=0)


# ---------------------------------------------------------------------------------------- counts and the contract
@pytest.mark.parametrize("strategy,grid,removed", [
    (ToMeSD(use_rand=False), (3, 8, 8), 96),  # int(192 * 0.5)
    (ToMeSD(st=2, use_rand=False), (3, 8, 8), 96),
    (SSM(round_windows=1), (2, 8, 8), 63),  # 64 // 3 = 21 windows of 4
    (SSM(round_windows=1, temporal_window=2), (2, 8, 8), 63),  # 64 // 7 = 9 boxes of 8
    (IDM(), (2, 8, 8), 64),
    (IDM(temporal_window=2, variant="streak", round_tokens=1), (2, 8, 8), 64),
])
def test_removed_counts_in_3d(strategy, grid, removed: int) -> None:
    N = grid[0] * grid[1] * grid[2]
    x = torch.randn(2, N, 8, generator=_gen(15))
    ctx = MergeContext(grid=grid, ratio=0.5, received_attention=torch.rand(2, N, generator=_gen(16)),
                       generator=_gen(17))
    plan = strategy.plan(x, ctx)
    assert plan.num_removed == removed and plan.merge(x).shape == (2, N - removed, 8)


THREE_D_VARIANTS = {
    "tomesd_st2": lambda: ToMeSD(st=2),
    "tomesd_st2_fixed": lambda: ToMeSD(st=2, use_rand=False),
    "tomesd_st2_sx1_sy1": lambda: ToMeSD(st=2, sx=1, sy=1, use_rand=False),
    "ssm_tw2": lambda: SSM(temporal_window=2),
    "idm_tw2": lambda: IDM(temporal_window=2),
    "idm_tw2_local_streak": lambda: IDM(temporal_window=2, local=True, variant="streak"),
    "facility_location_tf2": lambda: FacilityLocation(tile_frames=2),
    "facility_location_stripes_tf2": lambda: FacilityLocation(locality="stripes", num_tiles=16, tile_frames=2),
}


@pytest.mark.parametrize("grid", [(2, 16, 16), (4, 8, 8)])
@pytest.mark.parametrize("variant", sorted(THREE_D_VARIANTS))
def test_contract_with_the_3d_options(variant: str, grid) -> None:
    check_strategy(THREE_D_VARIANTS[variant], grid=grid)  # robustness on (3, 13, 15): leftover frames too


def test_schedules_forward_the_3d_options() -> None:
    sdtm = SDTM(temporal_window=2, round_windows=1)
    assert sdtm.ssm.temporal_window == 2 and sdtm.idm.temporal_window == 2
    x = torch.randn(2, 128, 8, generator=_gen(18))
    ctx = MergeContext(grid=(2, 8, 8), ratio=0.5, received_attention=torch.rand(2, 128, generator=_gen(19)))
    structure = sdtm.ssm.plan(x, ctx)
    assert structure.num_removed == 63 and all(len(g) in (1, 8) for g in groups(structure))  # 2x2x2 boxes
    toma = ToMA(tile_size=4, tile_frames=2)
    assert toma.facility.tile_frames == 2 and toma.to_dict()["tile_frames"] == 2
    assert toma.facility.plan(x, ctx).tile_tokens.shape == (4, 32)
    with pytest.raises(ValueError, match="^ssm: temporal_window"):
        SDTM(temporal_window=0)
    with pytest.raises(ValueError, match="^facility_location: tile_frames"):
        ToMA(tile_frames=0)


# ---------------------------------------------------------------------------------------- T = 1 is the 2-D grid
ONE_FRAME_STRATEGIES = {
    "tomesd": lambda: ToMeSD(),
    "tomesd_fixed_3x1": lambda: ToMeSD(sx=3, sy=1, use_rand=False),
    "ssm": lambda: SSM(),
    "ssm_k3": lambda: SSM(window=3, round_windows=1),
    "idm": lambda: IDM(),
    "idm_local_streak": lambda: IDM(local=True, variant="streak"),
    "facility_location": lambda: FacilityLocation(num_tiles=16),
    "facility_location_stripes": lambda: FacilityLocation(locality="stripes", num_tiles=7, shared_destinations=True),
}


@pytest.mark.parametrize("hw", [(16, 16), (7, 10), (9, 5)])
@pytest.mark.parametrize("name", sorted(ONE_FRAME_STRATEGIES))
def test_one_frame_plans_exactly_as_the_2d_grid(name: str, hw: tuple[int, int]) -> None:
    H, W = hw
    N = H * W
    x = torch.randn(2, N, 8, generator=_gen(20))
    stats = dict(received_attention=torch.rand(2, N, generator=_gen(21)),
                 streak=torch.randint(0, 4, (2, N), generator=_gen(22)).float())
    plans = [ONE_FRAME_STRATEGIES[name]().plan(x, MergeContext(grid=grid, ratio=0.5, generator=_gen(23), **stats))
             for grid in [(H, W), (1, H, W)]]
    image, video = plans
    assert image.num_removed > 0
    assert torch.equal(image.dst, video.dst) and torch.equal(image.slot_of_token, video.slot_of_token)
    assert torch.equal(image.merge(x), video.merge(x))
