"""Tests of the ``idm`` strategy (SDTM detail phase) on hand-made inputs with known answers."""

from __future__ import annotations

import re

import pytest
import torch

import tomerge
from tomerge import MergeContext, MergePlan
from tomerge.strategies.idm import IDM
from tomerge.strategies.ssm import EPS
from helpers.ties import assert_clear, kth_gap

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


def cosine_case(targets: dict[int, tuple[int, float]], destinations: list[int], N: int = 16) -> torch.Tensor:
    """Features ``[1, N, D + N]`` (float64) whose cosine similarities are set by hand.

    Destination ``destinations[j]`` is the unit vector ``e_j``; a source ``t`` with ``targets[t] = (j, c)`` is
    ``c e_j + sqrt(1 - c^2) u_t`` with its own unit direction ``u_t`` orthogonal to everything else, so its
    cosine similarity is ``c`` to destination ``j`` and 0 to every other destination. Sources not in
    ``targets`` are ``u_t`` (similarity 0 to every destination)."""
    D = len(destinations)
    x = torch.zeros(1, N, D + N, dtype=torch.float64)
    for j, t in enumerate(destinations):
        x[0, t, j] = 1.0
    for t in range(N):
        if t in destinations:
            continue
        j, c = targets.get(t, (0, 0.0))
        x[0, t, j] = c
        x[0, t, D + t] = (1 - c * c) ** 0.5
    return x


def similarity_gaps(x: torch.Tensor, dst: list[int], r: int) -> tuple[float, float]:
    """float64 margins of the streak variant's choices: the gap between the ``r``-th and ``(r + 1)``-th best
    source similarity, and the smallest gap between a merged source's best and second-best destination."""
    X = torch.nn.functional.normalize(x[0].double(), dim=-1)  # [N, C]
    sources = [t for t in range(x.shape[1]) if t not in dst]
    sim = X[sources] @ X[dst].T  # [S, D]
    best = sim.max(dim=-1).values  # [S]
    merged = best.topk(r).indices
    return float(kth_gap(best, r)), float(kth_gap(sim[merged], 1).min())


def test_streak_variant_merges_the_sources_most_similar_to_a_destination() -> None:
    # The authors' FIDM (TR_SDTM.py, lines 371-386): the streak only picks each window's destination
    # (lines 319-327); sources are ranked ToMe-style by the cosine similarity to their most similar
    # destination and the r best merge into it. alpha_d, received attention and the sources' own streaks
    # play no part.
    streak = torch.zeros(1, 16)
    streak[0, [5, 2, 12, 15]] = 5.0  # destinations: the longest streak of w0, w1, w2, w3
    streak[0, [0, 1, 3]] = 4.0  # long-streak sources (the old priority merged these first) ...
    # ... built dissimilar to every destination, while four zero-streak sources late in raster order are
    # built close to a destination of another window: 14 -> 2, 13 -> 5, 11 -> 12, 9 -> 15.
    targets = {14: (1, 0.995), 13: (0, 0.98), 11: (2, 0.96), 9: (3, 0.93),
               0: (0, 0.3), 1: (1, 0.2), 3: (2, 0.1), 4: (3, 0.5), 6: (0, 0.45), 7: (1, 0.4), 8: (2, 0.35),
               10: (3, 0.25)}
    dst = [5, 2, 12, 15]
    x = cosine_case(targets, dst)
    rank_gap, dst_gap = similarity_gaps(x, dst, 4)
    assert rank_gap > 0.4 and dst_gap > 0.9  # no near ties: the 4th best similarity is 0.93, the 5th 0.5
    expected = {frozenset(p) for p in [(14, 2), (13, 5), (11, 12), (9, 15)]}
    a = torch.rand(1, 16, generator=torch.Generator().manual_seed(0))
    for strategy in (IDM(variant="streak"), IDM(variant="streak", alpha_d=1.0), IDM(variant="streak", alpha_d=0.0)):
        for ctx in (MergeContext(grid=(4, 4), ratio=0.25, streak=streak),  # r = 4
                    MergeContext(grid=(4, 4), ratio=0.25, streak=streak, received_attention=a)):
            plan = strategy.plan(x, ctx)
            assert plan.num_removed == 4 and plan.dst[0, :4].tolist() == dst
            assert merged_groups(plan) == expected
            plan32 = strategy.plan(x.float(), ctx)  # float32 features: the same choices
            assert torch.equal(plan32.assign, plan.assign)


def test_streak_variant_local_ranks_by_the_own_windows_destination() -> None:
    streak = torch.zeros(1, 16)
    streak[0, [5, 2, 12, 15]] = 5.0
    dst = [5, 2, 12, 15]
    # 14 is the most similar to a destination (2, in another window) but dissimilar to its own (15):
    # globally it merges first, locally it does not merge at all.
    targets = {14: (1, 0.99), 4: (0, 0.9), 7: (1, 0.8), 13: (2, 0.7), 10: (3, 0.6), 0: (0, 0.3)}
    x = cosine_case(targets, dst)
    ctx = MergeContext(grid=(4, 4), ratio=0.25, streak=streak)  # r = 4
    local = IDM(variant="streak", local=True).plan(x, ctx)
    assert merged_groups(local) == {frozenset(p) for p in [(4, 5), (7, 2), (13, 12), (10, 15)]}
    glob = IDM(variant="streak").plan(x, ctx)
    assert merged_groups(glob) == {frozenset(p) for p in [(14, 7, 2), (4, 5), (13, 12)]}


@pytest.mark.parametrize("ratio, expected", [(0.3, 64), (0.5, 128), (0.2, 48), (0.05, 12)])
def test_streak_variant_rounds_like_the_release(ratio: float, expected: int) -> None:
    # The release removes min(#sources, r) // 16 * 16 tokens (TR_SDTM.py, FIDM lines 376-378): with 2x2
    # windows min(3N/4, r) // 16 * 16. N = 256: r = 76 -> 64, 128 -> 128, 51 -> 48; r = 12 would round to 0
    # (the release then merges nothing): kept unrounded, as ssm.round_windows does.
    g = torch.Generator().manual_seed(0)
    x, streak = torch.randn(2, 256, 8, generator=g), torch.randint(0, 4, (2, 256), generator=g)
    ctx = MergeContext(grid=(16, 16), ratio=ratio, streak=streak)
    assert IDM(variant="streak").plan(x, ctx).num_removed == expected
    assert IDM(variant="streak").round_tokens == 16 and IDM().round_tokens == 1


def test_round_tokens_option_and_cap() -> None:
    g = torch.Generator().manual_seed(1)
    x, a = torch.randn(1, 256, 8, generator=g), torch.rand(1, 256, generator=g)
    ctx = MergeContext(grid=(16, 16), ratio=0.3, received_attention=a)  # r = 76
    assert IDM().plan(x, ctx).num_removed == 76  # the paper variant: r exactly (no rounding stated)
    assert IDM(round_tokens=16).plan(x, ctx).num_removed == 64
    assert IDM(variant="streak", round_tokens=1).plan(x, ctx).num_removed == 76
    assert IDM(variant="streak", round_tokens=5).plan(x, ctx).num_removed == 75
    # Capped first at the 192 sources (3N/4), then rounded: min(3N/4, r) // 16 * 16.
    with pytest.warns(UserWarning, match="capping r at 192"):
        assert IDM(variant="streak").plan(x, MergeContext(grid=(16, 16), ratio=0.9)).num_removed == 192
    x35 = torch.randn(1, 35, 8, generator=g)  # 5x7: 6 windows, 29 sources
    with pytest.warns(UserWarning, match="capping r at 29"):
        assert IDM(variant="streak").plan(x35, MergeContext(grid=(5, 7), ratio=0.9)).num_removed == 16


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


def tiny_dit():
    from tomerge.backbones.timm_dit import DiT, DiTConfig
    model = DiT(DiTConfig(input_size=16, patch_size=2, in_channels=1, hidden_size=32, depth=2, num_heads=2,
                          num_classes=10, learn_sigma=False))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # non-zero adaLN: the MLP input is not a plain norm of the block input
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return model.eval()


@pytest.mark.parametrize("schedule", [
    dict(strategy="idm", variant="streak", ratio=0.5),
    dict(strategy="idm", ratio=0.5),
    dict(strategy="sdtm", ratio=0.3, switch=0.0, idm_variant="streak"),
    dict(strategy="sdtm", ratio=0.3, switch=0.0),
])
def test_detail_plans_come_from_the_block_input_when_only_the_mlp_merges(monkeypatch, schedule) -> None:
    # The authors plan the detail phase from the attention input (norm1 output, TR_SDTM.py line 745) while
    # merging only the MLP input (line 777). Attention being unmerged, tomerge's hooks cannot see that tensor
    # and plan from the closest one they can reach, the block's input (before norm1), not the MLP input.
    model = tiny_dit()
    block_inputs, attn_inputs, mlp_inputs, planned = {}, {}, {}, []
    hooks = []
    for i, block in enumerate(model.blocks):
        hooks.append(block.register_forward_pre_hook(lambda m, a, i=i: block_inputs.__setitem__(i, a[0])))
        hooks.append(block.attn.register_forward_pre_hook(lambda m, a, i=i: attn_inputs.__setitem__(i, a[0])))
        hooks.append(block.mlp.register_forward_pre_hook(lambda m, a, i=i: mlp_inputs.__setitem__(i, a[0])))
    original = IDM.plan
    monkeypatch.setattr(IDM, "plan", lambda self, x, ctx: planned.append((ctx.layer, x)) or original(self, x, ctx))
    schedule = dict(schedule)
    name = schedule.pop("strategy")
    x, t, y = torch.randn(2, 1, 16, 16), torch.tensor([0.3, 0.3]), torch.tensor([1, 2])
    with tomerge.merging(model, name, num_steps=2, **schedule) as handle, torch.no_grad():
        model(x, t, y)
        model(x, t - 0.2, y)  # step 1: the detail phase of sdtm (p = 1 > switch = 0)
        detail = [r for r in handle.state.records if r.label in ("idm", "detail")]
    for hook in hooks:
        hook.remove()
    assert detail and all(r.num_removed > 0 and r.sublayers == ("mlp",) for r in detail)
    assert len(planned) == len(detail)
    for layer, metric in planned[-2:]:  # the last call's plans (its block inputs were captured last)
        assert metric is block_inputs[layer]
        assert not torch.allclose(metric, mlp_inputs[layer]) and not torch.allclose(metric, attn_inputs[layer])
    assert IDM().plan_input == "block_input" and IDM(plan_from="sublayer").plan_input == "sublayer"


@pytest.mark.parametrize("strategy, options, refused", [
    ("idm", dict(merge_attn=True), "strategy 'idm' needs received attention and merges the attention sublayer"),
    ("sdtm", dict(detail_sublayers=("attn", "mlp")),
     "strategy 'idm' (the detail phase of sdtm, detail_sublayers=('attn', 'mlp')) needs received attention"),
])
def test_merging_the_attention_it_has_not_recorded_yet_is_refused_by_apply(strategy, options, refused) -> None:
    # The attention's merge is planned before the block's attention runs and is probed: refused before any call.
    from tomerge.attach import check_options

    with pytest.raises(ValueError, match=re.escape(refused)):
        check_options(strategy, ratio=0.3, **options)
    model = tiny_dit()
    with pytest.raises(ValueError, match=re.escape(refused)):
        tomerge.apply(model, strategy, ratio=0.3, **options)
    assert "_tomerge_handle" not in model.__dict__
    streak = {"idm": dict(variant="streak"), "sdtm": dict(idm_variant="streak")}[strategy]  # needs no attention
    assert not check_options(strategy, ratio=0.3, **options, **streak).needs


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
    assert plan.num_removed == (16 if options.get("variant") == "streak" else 17)  # streak: r rounded to 16
    values = torch.randint(-8, 8, (2, plan.num_slots, 8)).float()
    y = plan.unmerge(values)  # [2, 35, 8], identical within groups; weights 1/3 are inexact: compare to rounding
    for backend in ("index", "dense"):
        p = plan.with_backend(backend)
        torch.testing.assert_close(p.unmerge(p.merge(y)), y, rtol=0, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_low_precision_and_zero_tokens_are_finite(dtype: torch.dtype) -> None:
    x, _ = random_case(2, 5, 7, seed=6)
    x[0, :10] = 0  # zero destinations and sources
    x = x.to(dtype)
    ctx = MergeContext(grid=(5, 7), ratio=0.5, received_attention=torch.zeros(2, 35), streak=torch.zeros(2, 35))
    for strategy, removed in ((IDM(), 17), (IDM(local=True), 17), (IDM(variant="streak"), 16)):
        plan = strategy.plan(x, ctx)
        out = plan.unmerge(plan.merge(x))
        assert plan.num_removed == removed and out.dtype == dtype and torch.isfinite(out).all()
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


# ---------------------------------------------------------------------------------------- options
@pytest.mark.parametrize("options", [
    {"window": 1}, {"window": False}, {"alpha_d": -1.0}, {"alpha_d": float("inf")},
    {"variant": "attn"}, {"local": "yes"}, {"ratio": -0.1}, {"round_tokens": 0}, {"round_tokens": True},
    {"plan_from": "norm1"},
])
def test_invalid_options_raise(options: dict) -> None:
    with pytest.raises(ValueError):
        IDM(**options)


def test_registry_and_class_attributes() -> None:
    s = tomerge.get_strategy("idm", variant="streak", local=True, alpha_d=0.1, window=3)
    assert isinstance(s, IDM) and (s.variant, s.local, s.alpha_d, s.window) == ("streak", True, 0.1, 3)
    assert IDM.name == "idm" and IDM().uses_streak and IDM().default_sublayers == {"mlp"}
