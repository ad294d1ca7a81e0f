"""``toca`` and ``fresh_tokens`` (strategies/toca.py): token-wise feature caching.

The schedule's fresh steps and fresh fractions follow ToCa's DDIM-50 recipe (``force_scheduler`` and ``ToCa-ddim50``,
written out here by hand at 20 and 50 steps, the step counted from the last one down); a cached step with no fresh
token runs no sublayer and ages every token; the score ranks tokens by L2-normalised received attention, staleness and
the best-of-cell bonus (float64, gaps asserted); through the hooks on the tiny native DiT of ``helpers.compiled``:
``interval=1`` and ``remove()`` give the unpatched model bit for bit, a cached step of a timestep-blind model on the
fresh step's input returns the fresh step's output, a cached step reuses the attention (it never runs) and runs the
feed-forward on the fresh tokens only, a batch equals its samples, a compiled trajectory compiles nothing after its
first steps, the FLOP counter sees the saving; diffusers DiT, PixArt and SD3 (a joint attention: its whole output
reused, text tokens included) run it.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import tomerge
from tomerge.context import MergeContext
from tomerge.experiments.measure.flops import count_denoiser_flops
from tomerge.feature_cache import FeatureCaching
from tomerge.schedule import Where
from tomerge.strategies.toca import FreshTokens, ToCa, window_best
from tomerge.streaks import Streaks, StreakState
from helpers.compiled import build, call, inputs, times
from helpers.families import FAMILIES


def where(step: int, layer: int = 0, num_steps: int = 20, num_layers: int = 6) -> Where:
    return Where(step=step, num_steps=num_steps, progress=step / (num_steps - 1), layer=layer, num_layers=num_layers)


def test_fresh_steps_follow_tocas_force_scheduler_at_20_and_50_steps():
    # ToCa's DiT DDIM-50 recipe (README: --fresh-threshold 3 --ratio-scheduler ToCa-ddim50), as DiT-ToCa's
    # cal_type.py and force_scheduler.py (d0ef7e1) run it, written out by hand. Steps count down, s = S-1 ... 0;
    # s = S-1 is fresh; a fresh step s' sets n = round(3 / (1.4 - 0.8 s'/S)), or n = 2 where
    # int(0.2 S) <= s' < int(0.4 S); the next fresh step is the next s with s % n == 0.
    # S = 20 (window s in [4, 8)): s=19: 3/0.64 = 4.69 -> n=5; s=15: 3/0.80 = 3.75 -> 4; s=12: 3/0.92 = 3.26 -> 3;
    #   s=9: 3/1.04 = 2.88 -> 3; s=6: window -> 2; s=4: window -> 2; s=2: 3/1.32 = 2.27 -> 2; s=0.
    #   Fresh s = 19, 15, 12, 9, 6, 4, 2, 0, so t = 19 - s:
    s = ToCa()
    assert [t for t in range(20) if s.is_fresh(t, 20)] == [0, 4, 7, 10, 13, 15, 17, 19]
    # S = 50 (window s in [10, 20)): s=49: 3/0.616 = 4.87 -> 5; s=45: 3/0.68 = 4.41 -> 4; s=44 (44 % 4 = 0):
    #   3/0.696 = 4.31 -> 4; s=40: 3/0.76 = 3.95 -> 4; s=36: 3/0.824 = 3.64 -> 4; s=32: 3/0.888 = 3.38 -> 3;
    #   s=30: 3/0.92 = 3.26 -> 3; s=27: 3/0.968 = 3.10 -> 3; s=24: 3/1.016 = 2.95 -> 3; s=21: 3/1.064 = 2.82 -> 3;
    #   s=18, 16, 14, 12, 10: window -> 2; s=8: 3/1.272 = 2.36 -> 2; s=6, 4, 2: 2.30, 2.25, 2.19 -> 2; s=0.
    #   Fresh s = 49, 45, 44, 40, 36, 32, 30, 27, 24, 21, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0, so t = 49 - s:
    assert [t for t in range(50) if s.is_fresh(t, 50)] == [0, 4, 5, 9, 13, 17, 19, 22, 25, 28, 31, 33, 35, 37, 39,
                                                            41, 43, 45, 47, 49]
    # without the spread and the window (n = round(4 / 1) = 4 at every fresh step): s = 19, then 16, 12, 8, 4, 0
    flat = ToCa(interval=4, interval_weight=0.0, sensitive_interval=None)
    assert [t for t in range(20) if flat.is_fresh(t, 20)] == [0, 3, 7, 11, 15, 19]
    assert all(ToCa(interval=1, interval_weight=0.0, sensitive_interval=None).is_fresh(t, 5) for t in range(5))
    with pytest.raises(ValueError, match="needs the step count"):
        s.is_fresh(3, None)
    assert s.is_fresh(0, None)


@pytest.mark.parametrize("num_steps, step, layer", [(20, 1, 0), (20, 5, 5), (20, 11, 2), (20, 18, 3), (50, 3, 1),
                                                    (50, 30, 4), (50, 48, 5)])
def test_the_fresh_fraction_is_tocas_ddim50_layer_step_and_module_factors(num_steps, step, layer):
    # fresh_ratio_scheduler.py 'ToCa-ddim50': 0.07 * (0.8 + 0.4 l/(L-1)) * (3 - 4 s/S) * 2.5, clamped to [0, 1]
    s = ToCa()
    countdown = num_steps - 1 - step
    expected = max(0.0, 0.07 * (0.8 + 0.4 * layer / 5) * (3 - 4 * countdown / num_steps) * 2.5)
    w = where(step, layer, num_steps=num_steps)
    assert s.fresh_fraction(w) == pytest.approx(expected, rel=1e-12, abs=1e-15)
    decision = s.decide(w)
    assert decision.technique(Streaks).key == ("toca", layer) and decision.label == ("toca" if expected > 0 else "toca_reuse")
    if expected > 0:
        assert decision.ratio == pytest.approx(1 - expected, rel=1e-12)
        assert decision.sublayers == frozenset({"mlp"}) and decision.technique(FeatureCaching).reuse == frozenset({"attn"})
        assert decision.technique(FeatureCaching).weight == 0.0 and decision.technique(FeatureCaching).store == frozenset({"mlp"})
    else:  # no fresh token: both sublayers return their cache
        assert decision.strategy is None and decision.technique(FeatureCaching).reuse == frozenset({"attn", "mlp"})
    fresh = s.decide(where(4, layer, num_steps=20))
    assert fresh.ratio == 0.0 and fresh.technique(Streaks).reset and fresh.technique(FeatureCaching).store == frozenset({"attn", "mlp"})
    assert not fresh.technique(FeatureCaching).reuse


def test_the_first_quarter_of_cached_steps_recomputes_no_token_at_20_and_50_steps():
    # 'ToCa-ddim50': the step factor 3 - 4 s/S is <= 0 for s >= 0.75 S, so a cached step there refreshes nothing:
    # S = 20: s >= 15, cached t = 1, 2, 3; S = 50: s >= 37.5, cached t = 1, 2, 3, 6, 7, 8, 10, 11
    s = ToCa()
    for num_steps, expected in ((20, [1, 2, 3]), (50, [1, 2, 3, 6, 7, 8, 10, 11])):
        none = [t for t in range(num_steps) if not s.is_fresh(t, num_steps)
                and s.fresh_fraction(where(t, 5, num_steps=num_steps)) == 0.0]
        assert none == expected


@pytest.mark.parametrize("bad, message", [
    (dict(interval=0), "interval"), (dict(fresh_ratio=0.0), "fresh_ratio"), (dict(fresh_ratio=1.5), "fresh_ratio"),
    (dict(layer_weight=2.0), "layer_weight"), (dict(ratio=0.5), "no merging ratio"), (dict(window=0), "window"),
    (dict(interval_weight=1.0), "interval_weight"), (dict(sensitive_from=0.5), "sensitive_until"),
    (dict(sensitive_interval=0), "sensitive_interval"), (dict(step_weight=-0.1), "step_weight"),
])
def test_bad_options_are_refused_with_their_name(bad, message):
    with pytest.raises(ValueError, match=message):
        ToCa(**bad)


def test_the_cell_bonus_goes_to_the_best_token_of_each_cell_also_at_odd_edges():
    score = torch.tensor([[0.1, 0.9, 0.3,
                           0.4, 0.2, 0.8,
                           0.7, 0.5, 0.6]], dtype=torch.float64)  # a 3 x 3 grid: cells 2x2, 2x1, 1x2, 1x1
    best = window_best(score, (3, 3), 2)
    assert best.tolist() == [[0.0, 0.9, 0.0, 0.0, 0.0, 0.8, 0.7, 0.0, 0.6]]
    frames = window_best(torch.cat([score, score.flip(1)], 1), (2, 3, 3), 2)  # per frame on a 3-D grid
    assert frames[0, :9].tolist() == best[0].tolist()


def test_fresh_tokens_are_the_best_by_attention_staleness_and_bonus():
    g = torch.Generator().manual_seed(3)
    N, grid = 16, (4, 4)
    attention = torch.rand(1, N, generator=g, dtype=torch.float64)
    streak = torch.randint(0, 4, (1, N), generator=g).double()
    strategy = FreshTokens()
    ctx = MergeContext(grid=grid, ratio=0.75, received_attention=attention, streak=streak)
    s1 = attention / attention.norm()
    s3 = s1 + 0.25 * streak / 4
    cells = s3.view(2, 2, 2, 2).permute(0, 2, 1, 3).reshape(4, 4)  # [cell, member]
    bonus = torch.zeros(4, 4, dtype=torch.float64)
    bonus[torch.arange(4), cells.argmax(1)] = 0.6 * cells.max(1).values
    expected = (cells + bonus).view(2, 2, 2, 2).permute(0, 2, 1, 3).reshape(1, N)
    order = expected[0].sort(descending=True).values
    assert (order[3] - order[4]) > 1e-6  # no tie at the cut
    plan = strategy.plan(torch.randn(1, N, 3, generator=g, dtype=torch.float64), ctx)
    assert sorted(plan.dst[0].tolist()) == sorted(expected[0].topk(4).indices.tolist())
    x = torch.randn(1, N, 5, generator=g, dtype=torch.float64)
    assert torch.equal(plan.merge(x), x[:, plan.dst[0]])  # an exact selection
    y = plan.unmerge(plan.merge(x))
    stale = strategy.merged_tokens(plan, ctx)
    assert stale.sum() == N - 4 and torch.equal(y[~stale], x[~stale]) and torch.all(y[stale] == 0)


@pytest.fixture(scope="module")
def dit() -> nn.Module:
    return build("native_dit", depth=3)


def trajectory(model: nn.Module, options: dict | None, calls: list[dict]) -> list[torch.Tensor]:
    if options is None:
        return [call(model, kwargs) for kwargs in calls]
    with tomerge.merging(model, **options, num_steps=len(calls)):
        return [call(model, kwargs) for kwargs in calls]


def test_interval_one_and_remove_are_the_unpatched_model_and_fresh_steps_are_unmerged(dit):
    calls = [inputs("native_dit", t) for t in times(8)]
    before = trajectory(dit, None, calls)
    every_step = dict(strategy="toca", interval=1, interval_weight=0.0, sensitive_interval=None)
    assert all(torch.equal(a, b) for a, b in zip(trajectory(dit, every_step, calls), before))
    cached = trajectory(dit, dict(strategy="toca"), calls)
    # S = 8 counted s = 7..0: s=7 fresh, n = round(3 / 0.7) = 4; s=4 fresh, n = round(3 / 1.0) = 3; s=3 fresh
    # (outside the window [1, 3)), n = round(3 / 1.1) = 3; s=0 fresh: t = 0, 3, 4, 7
    assert all(torch.equal(cached[t], before[t]) for t in (0, 3, 4, 7))
    assert all(not torch.equal(cached[t], before[t]) for t in (1, 2, 5, 6))
    assert all(torch.equal(a, b) for a, b in zip(trajectory(dit, None, calls), before))
    assert all("forward" not in block.attn.__dict__ for block in dit.blocks)  # the reuse patch is gone


def test_a_cached_step_on_the_fresh_steps_input_is_the_fresh_step():
    """Timestep-blind model, one input at two timesteps: the reused attention and the cached feed-forward outputs
    are what the step would compute, and the fresh tokens are computed from their own inputs, so the cached step
    returns the fresh step's output (to float64 rounding of the smaller products)."""
    model = build("native_dit", depth=3)
    with torch.no_grad():
        model.t_embedder.mlp[2].weight.zero_()
    same = [inputs("native_dit", t) for t in (0.9, 0.8, 0.7)]
    full = trajectory(model, None, same[:1])[0]
    # S = 3: s=2 fresh, n = round(4 / (1.4 - 0.8 * 2/3)) = 5, so s=1 is cached, with 0.07 * ... * (3 - 4/3) * 2.5
    out = trajectory(model, dict(strategy="toca", interval=4), same)
    torch.testing.assert_close(out[1], full, rtol=0, atol=1e-13)
    # S = 8: t = 1 (s = 6) is a cached step with no fresh token (3 - 4 * 6/8 = 0): both sublayers reused
    reused = trajectory(model, dict(strategy="toca"), [inputs("native_dit", 0.9 - 0.05 * t) for t in range(8)])
    torch.testing.assert_close(reused[1], full, rtol=0, atol=1e-13)
    changed = trajectory(model, dict(strategy="tomesd", ratio=0.5, merge_mlp=True, use_rand=False,
                                     merge_from=0.5), same)
    assert (changed[1] - full).abs().max() > 1e-4


def test_a_step_with_no_fresh_token_runs_no_sublayer_and_ages_every_token(dit):
    """ToCa's counter (cache_cutfresh.py: ``cache_index += 1`` before the fresh tokens are zeroed) grows for every
    token on a cached step that selects none: S = 8, t = 1 and t = 1, 2 with the fresh step t = 0 before them."""
    runs = {"attn": 0, "mlp": 0}
    hooks = [module.register_forward_pre_hook(lambda m, args, name=name: runs.__setitem__(name, runs[name] + 1))
             for block in dit.blocks for name, module in (("attn", block.attn.qkv), ("mlp", block.mlp.fc1))]
    try:
        with tomerge.merging(dit, "toca", num_steps=8) as handle:
            for kwargs in [inputs("native_dit", t) for t in times(8)][:2]:
                call(dit, kwargs)
            records, streaks = handle.state.records, dict(handle.state.technique(StreakState).streaks)
    finally:
        for h in hooks:
            h.remove()
    assert runs == {"attn": 3, "mlp": 3}  # the fresh step's three blocks only
    assert [r.label for r in records] == ["fresh"] * 3 + ["toca_reuse"] * 3
    assert sorted(key[1] for key in streaks) == [("toca", layer) for layer in range(3)]
    assert all(torch.equal(streak, torch.ones_like(streak)) for streak in streaks.values())


def test_a_cached_step_never_runs_the_attention_and_runs_the_feed_forward_on_the_fresh_tokens(dit):
    lengths: dict[str, list[int]] = {"attn": [], "mlp": []}
    # the sublayers' first projections: they run only when the sublayer does (the sublayer's own hooks always fire)
    hooks = [module.register_forward_pre_hook(lambda m, args, name=name: lengths[name].append(args[0].shape[1]))
             for block in dit.blocks for name, module in (("attn", block.attn.qkv), ("mlp", block.mlp.fc1))]
    try:
        calls = [inputs("native_dit", t) for t in times(4)]  # fresh: steps 0 and 3
        with tomerge.merging(dit, "toca", num_steps=4) as handle:
            for kwargs in calls:
                call(dit, kwargs)
            records = handle.state.records
    finally:
        for h in hooks:
            h.remove()
    assert lengths["attn"] == [64] * 6  # steps 0 and 3, three blocks each
    kept = [r.num_tokens - r.num_removed for r in records if r.label == "toca"]
    assert lengths["mlp"] == [64] * 3 + kept + [64] * 3 and all(0 < k < 64 for k in kept)


def test_a_batch_equals_its_samples(dit):
    pair = [inputs("native_dit", t) for t in times(5)]
    pair = [{**kw, "x": kw["x"] + torch.linspace(0, 1, 2, dtype=torch.float64).view(2, 1, 1, 1)} for kw in pair]
    batched = trajectory(dit, dict(strategy="toca"), pair)
    for sample in range(2):
        alone = [{k: v[sample:sample + 1] for k, v in kwargs.items()} for kwargs in pair]
        for a, b in zip(trajectory(dit, dict(strategy="toca"), alone), batched):
            torch.testing.assert_close(a[0], b[sample], rtol=1e-12, atol=1e-12)


def test_a_compiled_trajectory_matches_eager_and_compiles_nothing_after_its_first_steps(dit):
    steps = 12
    calls = [inputs("native_dit", t) for t in times(steps)]
    eager = trajectory(dit, dict(strategy="toca", interval=3), calls)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    backend = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    frames, compiled = [], []
    with tomerge.merging(dit, "toca", interval=3, num_steps=steps):
        runner = torch.compile(dit, backend=backend)
        for kwargs in calls:
            compiled.append(call(runner, kwargs))
            frames.append(backend.frame_count)
    breaks = dict(torch._dynamo.utils.counters["graph_break"])
    torch._dynamo.reset()
    assert not breaks, f"graph breaks: {breaks}"
    for a, b in zip(compiled, eager):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)
    assert frames[-1] == frames[len(frames) // 2], frames


def test_the_flop_counter_sees_the_reused_attention_and_the_fresh_tokens(dit):
    calls = [inputs("native_dit", t) for t in times(4)]

    def per_step(**options) -> list[float]:
        with tomerge.merging(dit, "toca", num_steps=4, **options):
            return [count_denoiser_flops(dit, lambda: call(dit, kwargs))[0] for kwargs in calls]

    unmerged = count_denoiser_flops(dit, lambda: call(dit, calls[0]))[0]
    few, many = per_step(fresh_ratio=0.05), per_step(fresh_ratio=0.3)
    # a fresh step is the unmerged model plus the received-attention probe the next steps' scores read
    assert few[0] == few[3] == many[0] > unmerged
    assert few[1] < many[1] < unmerged and few[2] < many[2] < unmerged


@pytest.mark.parametrize("name", ["dit", "pixart", "sd3"])
def test_diffusers_families_run_it_and_remove_leaves_no_trace(name):
    """DiT, PixArt and SD3, whose joint attention returns the text tokens too (a tuple): a cached step reuses
    the attention's whole output, text included."""
    from helpers.models import make_inputs, tiny_dit, tiny_pixart, tiny_sd3

    model = {"dit": tiny_dit, "pixart": tiny_pixart, "sd3": tiny_sd3}[name]()
    kwargs = make_inputs(name)
    steps = [{**kwargs, "timestep": (kwargs["timestep"] * (1 - 0.2 * s)).to(kwargs["timestep"].dtype)}
             for s in range(3)]
    with torch.no_grad():
        before = [model(**kw).sample for kw in steps]
        with tomerge.merging(model, "toca", num_steps=3, interval=2) as handle:
            out = [model(**kw).sample for kw in steps]
            labels = {r.label for r in handle.state.records}
        after = [model(**kw).sample for kw in steps]
    assert labels == {"fresh", "toca"}
    assert torch.equal(out[0], before[0]) and not torch.equal(out[1], before[1])
    assert all(torch.isfinite(o).all() and o.shape == b.shape for o, b in zip(out, before))
    assert all(torch.equal(a, b) for a, b in zip(after, before))
    assert not any("forward" in m.__dict__ for m in model.modules())


@pytest.mark.parametrize("name", ["lumina2", "chroma", "flux2", "qwenimage", "cogview4", "wan", "hunyuan_video"])
def test_declared_families_run_it_joint_and_single_stream_alike(name):
    """Declared families (joint text-image attention, double and single streams, video grids): the fresh steps are
    the unmerged model, the cached step differs and is finite, ``remove()`` leaves no trace."""
    family = FAMILIES[name]
    model = family.build()
    kwargs = family.inputs(model)
    t = kwargs["timestep"]
    direction = 1 if name == "lumina2" else -1  # Lumina 2's timestep grows from noise (0) to image (1)
    steps = [{**kwargs, "timestep": (t * (1 + direction * 0.2 * s)).to(t.dtype)} for s in range(3)]

    def run():
        with torch.no_grad():
            return [model(**kw)[0] for kw in steps]

    before = run()
    with tomerge.merging(model, "toca", num_steps=3) as handle:
        out = run()
        labels = [r.label for r in handle.state.records]
    assert set(labels) == {"fresh", "toca"}
    assert torch.equal(out[0], before[0]) and torch.equal(out[2], before[2])  # steps 0 and 2 are fresh
    assert torch.isfinite(out[1]).all() and not torch.equal(out[1], before[1])
    assert all(torch.equal(a, b) for a, b in zip(run(), before))
    assert not any("forward" in m.__dict__ for m in model.modules())
