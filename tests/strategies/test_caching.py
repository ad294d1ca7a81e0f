"""The caching schedules (``strategies/caching.py``, docs/schedules.md "Caching") through the real hooks.

The step rules, written out by hand from the authors' code: FORA's full steps at 20 and 50 steps (counted down),
TeaCache's last step run in full. On the tiny native DiT of ``helpers.compiled`` (float64, 2 blocks, a guidance pair per
call) and on diffusers families: interval 1 and threshold 0 are the unpatched model bit for bit and ``remove()``
restores it; a reused block returns its input plus the residual its block returned at the last full step, exactly,
for every token stream; the forecast is TaylorSeer's formula, rebuilt here from the captured residuals; the adaptive
criterion follows the relative L1 changes of the first block's residual, replayed here by hand; a reused
block costs no FLOP and the criterion's first block costs a whole block (``experiments/measure/flops.py``); a batch
equals its samples; caching composes with a merging strategy and a merging schedule; compiled trajectories
compile once more at most and match eager; a block whose output the adapter does not describe is refused.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch._dynamo.testing
import torch._dynamo.utils
from torch import Tensor, nn

import tomerge
from tomerge.experiments.measure.flops import FlopCounter, count_denoiser_flops
from tomerge.block_cache import BlockCaching
from tomerge.feature_cache import FeatureCaching
from tomerge.schedule import Decision, Where
from tomerge.strategies.caching import FORA, BlockCache, FirstBlockCache, TaylorSeer
from tomerge.experiments.sources.coverage import caches_blocks
from helpers import no_hooks_left
from helpers.cases import CASES, run, trajectory
from helpers.compiled import FailOnHostRead, build, call, inputs, times
from helpers.families import FAMILIES
from helpers.video_families import build_wan_vace

STEPS = 7


def where(step: int, layer: int = 1, change: float | None = None, num_steps: int = 20) -> Where:
    return Where(step=step, num_steps=num_steps, progress=step / (num_steps - 1), layer=layer, num_layers=4,
                 change=change)


# ====================================================================== the rules, as pure functions
def test_block_cache_runs_every_block_on_the_warmup_steps_then_every_interval_steps():
    full = {(interval, warmup): [t for t in range(14) if BlockCache(interval=interval, warmup=warmup).is_full(t, 14)]
            for interval, warmup in ((1, 1), (3, 1), (4, 2), (5, 3))}
    assert full[(1, 1)] == list(range(14))
    assert full[(3, 1)] == [0, 3, 6, 9, 12]  # counted up: t % N == 0
    assert full[(4, 2)] == [0, 1, 5, 9, 13]  # TaylorSeer-DiT: first_enhance 2, then a full step every 4th
    assert full[(5, 3)] == [0, 1, 2, 7, 12]
    down = [t for t in range(14) if BlockCache(interval=5, warmup=2, count="down").is_full(t, 14)]
    assert down == [0, 1, 3, 8, 13]  # the warm-up steps, then 13 - t = 10, 5, 0
    s = BlockCache(interval=3, forecast_order=2)
    stored, reused = s.decide(where(3)), s.decide(where(4))
    assert (stored.technique(BlockCaching).mode, stored.strategy, stored.technique(BlockCaching).forecast_order, stored.label) == (
        "store", None, 2, "compute")
    assert (reused.technique(BlockCaching).mode, reused.strategy, reused.technique(BlockCaching).forecast_order, reused.label) == (
        "reuse", None, 2, "forecast")
    assert BlockCache(interval=3).decide(where(4)).label == "reuse"


def test_fora_computes_the_steps_fora_computes_at_20_and_50_steps():
    # FORA's src/models.py lines 139-143: a block computes when step == numstep - 1 or step % N == 0, where
    # gaussian_diffusion.py passes step = numstep - 1, ..., 0 (counting down). So t = numstep - 1 - step computes
    # at t = 0 and wherever numstep - 1 - t is a multiple of N, the last step always.
    # 20 steps, N = 3 (the preset): step = 19 (t=0), then step = 18, 15, 12, 9, 6, 3, 0 -> t = 1, 4, ..., 19
    assert [t for t in range(20) if FORA().is_full(t, 20)] == [0, 1, 4, 7, 10, 13, 16, 19]  # 8 of 20
    # 50 steps, N = 3: step = 49 (t=0), then step = 48, 45, ..., 3, 0 -> t = 1, 4, ..., 49
    assert [t for t in range(50) if FORA().is_full(t, 50)] == [0, 1, 4, 7, 10, 13, 16, 19, 22, 25, 28, 31, 34, 37,
                                                               40, 43, 46, 49]  # 18 of 50
    # 20 steps, N = 4: step = 19 (t=0), then step = 16, 12, 8, 4, 0 -> t = 3, 7, 11, 15, 19
    assert [t for t in range(20) if FORA(interval=4).is_full(t, 20)] == [0, 3, 7, 11, 15, 19]
    # 50 steps, N = 4: step = 49 (t=0), then step = 48, 44, ..., 4, 0 -> t = 1, 5, ..., 49
    assert [t for t in range(50) if FORA(interval=4).is_full(t, 50)] == [0] + list(range(1, 50, 4))
    decisions = [FORA().decide(where(t)).technique(BlockCaching).mode for t in range(20)]
    assert decisions[-1] == "store" and decisions.count("store") == 8
    assert FORA().is_full(0, None)  # the first step needs no step count; a later one does
    with pytest.raises(ValueError, match="count='down'.*needs the step count"):
        FORA().is_full(1, None)


def test_presets_hold_the_authors_settings():
    assert (FORA().interval, FORA().warmup, FORA().forecast_order, FORA().count) == (3, 1, 0, "down")
    assert TaylorSeer().count == "up"
    assert (TaylorSeer().interval, TaylorSeer().warmup, TaylorSeer().forecast_order) == (4, 2, 4)
    assert (FirstBlockCache().threshold, FirstBlockCache().accumulate) == (0.08, False)
    assert tomerge.get_strategy("fora", interval=5).to_dict() == {
        "schedule": "fora", "merge": None, "merge_options": {}, "ratio": None, "warmup": 1, "forecast_order": 0,
        "interval": 5, "count": "down"}


def test_first_block_cache_measures_in_the_first_block_and_reuses_below_the_threshold():
    s = FirstBlockCache(threshold=0.1, warmup=2)
    first = s.decide(where(5, layer=0))
    assert (first.technique(BlockCaching).mode, first.technique(BlockCaching).measure_change) == ("store", "since_full")
    assert FirstBlockCache(accumulate=True).decide(where(5, layer=0)).technique(BlockCaching).measure_change == "accumulated"
    assert s.decide(where(5, change=0.0999)).technique(BlockCaching).mode == "reuse"
    for w in (where(5, change=0.1), where(5, change=math.inf), where(5, change=None), where(1, change=0.0)):
        assert s.decide(w).technique(BlockCaching).mode == "store", w  # at the threshold, unmeasured, in the warm-up: it runs
    assert FirstBlockCache(threshold=0.0).decide(where(5, change=0.0)).technique(BlockCaching).mode == "store"


def test_teacache_mode_computes_the_last_step_whatever_the_change():
    # TeaCache (TeaCache4FLUX/teacache_flux.py lines 109-111): should_calc = True when cnt == 0 or cnt ==
    # num_steps - 1, so the last step runs every block; ParaAttention's get_can_use_cache (first_block_cache/utils.py
    # lines 270-286) forces no step: its last step reuses when the change is small.
    tea, para = FirstBlockCache(threshold=0.1, accumulate=True), FirstBlockCache(threshold=0.1)
    for n in (20, 50):
        assert tea.decide(where(n - 1, change=0.0, num_steps=n)).technique(BlockCaching).mode == "store"  # step 19 of 20, 49 of 50
        assert tea.decide(where(n - 2, change=0.0, num_steps=n)).technique(BlockCaching).mode == "reuse"
        assert para.decide(where(n - 1, change=0.0, num_steps=n)).technique(BlockCaching).mode == "reuse"
    with pytest.raises(ValueError, match="accumulate=True runs the last step in full.*needs the step count"):
        tea.decide(Where(step=3, num_steps=None, progress=0.5, layer=1, num_layers=4, change=0.0))


@pytest.mark.parametrize("accumulate", [False, True])
def test_below_the_threshold_only_teacache_mode_runs_the_last_step_through_the_hooks(dit, accumulate):
    steps = 12  # a threshold no change reaches: every later step reuses, except TeaCache's last one
    _, _, _, records = run_trajectory(dit, "first_block_cache", steps=steps, threshold=1e6, accumulate=accumulate)
    assert [r.reused for r in records if r.layer == 1] == [False] + [True] * 10 + [not accumulate]


def test_the_block_calls_that_run_take_the_inner_schedules_decisions():
    s = FORA(merge="toma", ratio=0.4, merge_options={"num_tiles": 4, "skip_first": 1})
    # 20 steps: step 4 is full (19 - 4 = 15 = 5 * 3), step 5 is not
    merged, skipped, reused = s.decide(where(4, layer=2)), s.decide(where(4, layer=0)), s.decide(where(5, layer=2))
    assert (merged.label, merged.ratio, merged.technique(BlockCaching).mode, merged.cache_key) == ("merge", 0.4, "store",
                                                                                       (("toma", "block", 0), 4))
    assert (skipped.label, skipped.strategy, skipped.technique(BlockCaching).mode) == ("skip_block", None, "store")
    assert (reused.label, reused.strategy) == ("reuse", None)
    assert s.strategies() == s.inner.strategies() and FORA().strategies() == ()
    constant = FORA(merge="tomesd", ratio=0.5, merge_options={"use_rand": False, "merge_mlp": True})
    assert constant.decide(where(0)).sublayers == frozenset({"attn", "mlp"})


@pytest.mark.parametrize("schedule, options, match", [
    ("fora", dict(interval=0), "interval must be an int >= 1"),
    ("fora", dict(warmup=0), "warmup must be an int >= 1"),
    ("taylorseer", dict(forecast_order=-1), "forecast_order must be an int >= 0"),
    ("fora", dict(ratio=0.5), "ratio set the merging strategy, but merge is None"),
    ("fora", dict(merge_options={"use_rand": False}), "merge_options set the merging strategy"),
    ("fora", dict(merge="taylorseer"), "is itself a caching schedule"),
    ("fora", dict(merge="tomesd", ratio=0.5, merge_options={"use_rnd": False}), "fora: merge='tomesd': unknown opt"),
    ("fora", dict(merge="tomesd", ratio=1.5), "fora: merge='tomesd': ratio must be"),
    ("fora", dict(merge="nope"), "^fora: merge='nope': unknown strategy 'nope'; registered: "),
    ("first_block_cache", dict(threshold=-0.1), "threshold must be a finite number >= 0"),
    ("first_block_cache", dict(accumulate=1), "accumulate must be True or False"),
])
def test_invalid_options_are_refused_before_any_model(schedule, options, match):
    with pytest.raises(ValueError, match=match):
        tomerge.attach.check_options(schedule, **options)


def test_decisions_refuse_a_reuse_that_merges_and_a_measure_without_a_store():
    with pytest.raises(ValueError, match="strategy must be None"):
        Decision(strategy=tomerge.get_strategy("tomesd"), ratio=0.5, techniques=(BlockCaching("reuse"),))
    with pytest.raises(ValueError, match="takes no other technique"):
        Decision(strategy=None, techniques=(BlockCaching("reuse"), FeatureCaching(store=frozenset({"mlp"}))))
    with pytest.raises(ValueError, match=r"measure_change needs BlockCaching\('store'\)"):
        Decision(strategy=None, techniques=(BlockCaching("reuse", measure_change="since_full"),))
    with pytest.raises(ValueError, match="BlockCaching.mode must be one of"):
        Decision(strategy=None, techniques=(BlockCaching("skip"),))
    with pytest.raises(ValueError, match="at most one TechniqueOptions per class"):
        Decision(strategy=None, techniques=(BlockCaching("store"), BlockCaching("store", 1)))
    with pytest.raises(ValueError, match=r"sublayers \['attn'\] do not run"):
        Decision(strategy=tomerge.get_strategy("tomesd"), ratio=0.5, sublayers=frozenset({"attn", "mlp"}),
                 techniques=(FeatureCaching(reuse=frozenset({"attn"})),))
    stored = Decision(strategy=None, techniques=(FeatureCaching(store=frozenset({"mlp"})), BlockCaching("store")))
    replaced = stored.using(BlockCaching("store", 2))
    assert replaced.technique(BlockCaching).forecast_order == 2 and len(replaced.techniques) == 2
    assert replaced.technique(FeatureCaching) is stored.technique(FeatureCaching)


# ====================================================================== the native DiT through the hooks
@pytest.fixture(scope="module")
def dit() -> nn.Module:
    return build("native_dit")


def block_flops(counter: FlopCounter, model: nn.Module) -> list[int]:
    counts = counter.get_flop_counts()
    return [sum(counts.get(f"{type(model).__name__}.blocks.{i}", {}).values()) for i in range(len(model.blocks))]


def run_trajectory(model: nn.Module, schedule: str | None = None, steps: int = STEPS, batch: slice = slice(None),
                   **options):
    """Outputs, per-step FLOPs (total, per block), each block's ``(input, output)`` per step, the records."""
    io: list[list[tuple[Tensor, Tensor]]] = []

    def capture(module, args, output):
        io[-1].append((args[0], output))
    hooks = [b.register_forward_hook(capture) for b in model.blocks]  # before apply: sees every call
    handle = tomerge.apply(model, schedule, num_steps=steps, **options) if schedule else None
    outs, flops = [], []
    try:
        for t in times(steps):
            io.append([])
            kwargs = {k: v[batch] for k, v in inputs("native_dit", t).items()}
            counter = FlopCounter()
            with counter:
                outs.append(call(model, kwargs))
            flops.append((counter.get_total_flops(), block_flops(counter, model)))
    finally:
        records = handle.state.records if handle else []
        if handle:
            handle.remove()
        for h in hooks:
            h.remove()
    return outs, flops, io, records


@pytest.fixture(scope="module")
def baseline(dit):
    return run_trajectory(dit)


@pytest.mark.parametrize("schedule, options", [("block_cache", dict(interval=1)), ("taylorseer", dict(interval=1)),
                                               ("first_block_cache", dict(threshold=0.0))])
def test_interval_one_and_threshold_zero_are_the_model_bit_for_bit_and_remove_restores_it(dit, baseline, schedule,
                                                                                          options):
    outs, flops, _, records = run_trajectory(dit, schedule, **options)
    assert all(torch.equal(a, b) for a, b in zip(outs, baseline[0]))
    assert [f for f, _ in flops] == [f for f, _ in baseline[1]] and not any(r.reused for r in records)
    assert all("forward" not in b.__dict__ and not b._forward_hooks and not b._forward_pre_hooks for b in dit.blocks)
    assert all(torch.equal(a, b) for a, b in zip(run_trajectory(dit)[0], baseline[0]))


def test_fora_returns_each_blocks_input_plus_its_residual_of_the_last_full_step(dit, baseline):
    outs, _, io, records = run_trajectory(dit, "fora")
    for step in range(STEPS):
        full = step - step % 3
        for layer, (x, y) in enumerate(io[step]):
            x_full, y_full = io[full][layer]
            if step == full:
                assert not records[step * 2 + layer].reused
            else:
                assert torch.equal(y, x + (y_full - x_full)), (step, layer)
                assert records[step * 2 + layer].reused and records[step * 2 + layer].label == "reuse"
    assert all(torch.equal(outs[s], baseline[0][s]) for s in (0, 3, 6))  # full steps: the model's output
    assert not torch.equal(outs[1], baseline[0][1])


def test_a_reused_block_costs_no_flop_and_the_criterions_first_block_costs_one_block(dit, baseline):
    base_total, base_blocks = baseline[1][0]
    assert all(b > 0 for b in base_blocks)
    _, flops, _, _ = run_trajectory(dit, "fora")
    for step, (total, blocks) in enumerate(flops):
        if step % 3 == 0:
            assert (total, blocks) == (base_total, base_blocks)
        else:
            assert blocks == [0, 0] and total == base_total - sum(base_blocks)
    _, flops, _, records = run_trajectory(dit, "first_block_cache", threshold=1e9)  # every later block reuses
    assert [r.reused for r in records] == [False, False] + [False, True] * (STEPS - 1)
    for total, blocks in flops[1:]:
        assert blocks == [base_blocks[0], 0] and total == base_total - base_blocks[1]
    # The denoiser counter of tomerge ablate sums the same per call.
    with tomerge.merging(dit, "fora", num_steps=STEPS):
        counted, calls, _ = count_denoiser_flops(dit, lambda: [call(dit, inputs("native_dit", t)) for t in times(STEPS)])
    assert calls == STEPS and counted == 3 * base_total + 4 * (base_total - sum(base_blocks))


@pytest.mark.parametrize("order", [1, 2])
def test_the_forecast_is_taylorseers_expansion_of_the_last_full_steps_residuals(dit, order):
    """Full steps 0, 3, 6, 9 (interval 3). TaylorSeer's derivative approximation: d0 = the residual, d(i+1) =
    (d(i) - the d(i) of the last full step) / 3; the forecast k steps after a full step is sum d(i) k^i / i!,
    with as many terms as the full steps so far allow (up to ``order``)."""
    steps, full = 10, (0, 3, 6, 9)
    _, _, io, records = run_trajectory(dit, "block_cache", steps=steps, interval=3, forecast_order=order)
    for layer in range(2):
        terms: dict[int, list[Tensor]] = {}
        for s in full:
            previous = terms.get(s - 3, [])
            terms[s] = [io[s][layer][1] - io[s][layer][0]]
            for i in range(min(order, len(previous))):
                terms[s].append((terms[s][i] - previous[i]) / 3)
        for step in set(range(steps)) - set(full):
            last = step - step % 3
            x, y = io[step][layer]
            expected = x + sum(d * ((step - last) ** i / math.factorial(i)) for i, d in enumerate(terms[last]))
            torch.testing.assert_close(y, expected, rtol=1e-12, atol=1e-12)
        assert len(terms[6]) == 1 + order  # the forecasts after step 6 used every order asked for
    assert {r.label for r in records if r.reused} == {"forecast"}


@pytest.mark.parametrize("accumulate", [False, True])
def test_first_block_cache_follows_the_relative_l1_change_of_the_first_blocks_residual(dit, accumulate):
    """The rule replayed from the captured first-block residuals: FirstBlockCache's change from the residual of
    the last full step, or TeaCache's sum of step-to-step changes since it; the later block reuses while the
    change is below the threshold. The threshold sits between the changes (no near tie), so both happen."""
    steps = 12
    _, _, io, _ = run_trajectory(dit, "block_cache", interval=1, steps=steps)
    first = [io[s][0][1] - io[s][0][0] for s in range(steps)]  # [B, N, C] the first block's residual per step

    def change(r: Tensor, ref: Tensor) -> float:
        return ((r - ref).abs().mean() / ref.abs().mean()).item()

    def replay(threshold: float) -> tuple[list[bool], list[float]]:
        reused, changes, reference, accumulated = [False], [], first[0], 0.0
        for s in range(1, steps):
            if accumulate:
                accumulated = (0.0 if not reused[-1] else accumulated) + change(first[s], first[s - 1])
                c = accumulated
            else:
                reference = first[s - 1] if not reused[-1] else reference
                c = change(first[s], reference)
            changes.append(c)
            reused.append(c < threshold and not (accumulate and s == steps - 1))  # TeaCache computes the last step
        return reused, changes

    step_changes = sorted(replay(0.0)[1])
    threshold = (step_changes[len(step_changes) // 2] + step_changes[len(step_changes) // 2 + 1]) / 2
    expected, changes = replay(threshold)
    assert 2 <= sum(expected) <= steps - 3, expected  # reuses and full steps both
    assert min(abs(c - threshold) for c in changes) > 1e-3 * threshold  # no near tie
    _, _, _, records = run_trajectory(dit, "first_block_cache", steps=steps, threshold=threshold,
                                      accumulate=accumulate)
    assert [r.reused for r in records if r.layer == 1] == expected
    assert not any(r.reused for r in records if r.layer == 0)


def test_caching_composes_with_a_merging_strategy_on_the_steps_that_run(dit):
    options = dict(merge="tomesd", ratio=0.5, merge_options={"use_rand": False})
    outs, flops, _, records = run_trajectory(dit, "fora", **options)
    alone, alone_flops, _, _ = run_trajectory(dit, "tomesd", ratio=0.5, use_rand=False)
    for step in range(STEPS):
        step_records = records[2 * step: 2 * step + 2]
        if step % 3 == 0:  # a full step runs tomesd exactly as tomesd alone (the latent is the same each step)
            assert torch.equal(outs[step], alone[step]) and flops[step] == alone_flops[step]
            assert all(r.label == "tomesd" and r.num_removed > 0 for r in step_records)
        else:
            assert all(r.reused and r.num_removed == 0 for r in step_records) and flops[step][1] == [0, 0]


def test_caching_composes_with_a_merging_schedule():
    model = build("native_dit", depth=4)
    _, _, _, records = run_trajectory(model, "fora", merge="toma", ratio=0.5,
                                      merge_options={"num_tiles": 4, "skip_first": 1})
    labels = [[r.label for r in records if r.step == s] for s in range(STEPS)]
    assert labels[0] == labels[3] == ["skip_block", "merge", "merge", "merge"]  # toma's decisions, stored
    assert labels[1] == ["reuse"] * 4
    assert all(r.num_removed > 0 for r in records if r.label == "merge")


@pytest.mark.parametrize("schedule, options", [("fora", {}), ("taylorseer", dict(interval=2, forecast_order=2))])
def test_a_batch_equals_its_samples_alone(dit, schedule, options):
    batched = run_trajectory(dit, schedule, **options)[0]
    alone = [run_trajectory(dit, schedule, batch=slice(i, i + 1), **options)[0] for i in range(2)]
    for step, out in enumerate(batched):
        torch.testing.assert_close(out, torch.cat([alone[0][step], alone[1][step]]), rtol=1e-10, atol=1e-10)


def test_a_trajectory_after_another_starts_from_a_full_step(dit, baseline):
    """A new trajectory (a noisier timestep) clears the cache: nothing of the last image is reused."""
    handle = tomerge.apply(dit, "fora", num_steps=STEPS)
    try:
        for t in times(STEPS)[:2]:
            call(dit, inputs("native_dit", t))
        again = call(dit, inputs("native_dit", times(STEPS)[0]))
    finally:
        handle.remove()
    assert torch.equal(again, baseline[0][0]) and not handle.state.records[-1].reused


def test_remove_leaves_a_forward_another_library_wrapped_after_it_and_passes_through(dit, baseline):
    handle = tomerge.apply(dit, "fora", num_steps=STEPS)
    block = dit.blocks[0]
    inner = block.forward
    block.forward = lambda *args, **kwargs: inner(*args, **kwargs)  # e.g. an offloading hook, installed later
    outer = block.forward
    with pytest.warns(UserWarning, match="wrapped again after tomerge's"):
        handle.remove()
    try:
        assert block.forward is outer and "forward" not in dit.blocks[1].__dict__
        out = [call(dit, inputs("native_dit", t)) for t in times(STEPS)]
        assert all(torch.equal(a, b) for a, b in zip(out, baseline[0]))  # tomerge's wrapper passes through
    finally:
        del block.forward


def test_no_host_read_after_the_step_starts_but_the_criterions_one(dit):
    """Static caching reads nothing on the host but the clock's timestep; the adaptive criterion reads its one
    number per model call (the relative L1 change), outside compiled graphs."""
    for schedule, options, allowed in (("fora", {}, ("observe",)), ("taylorseer", {}, ("observe",)),
                                       ("first_block_cache", dict(threshold=1e9), ("observe", "relative_l1"))):
        with tomerge.merging(dit, schedule, num_steps=6, **options) as handle:
            mode = FailOnHostRead(allowed=allowed)
            with mode:
                for t in times(6):
                    call(dit, inputs("native_dit", t))
            assert handle.stats["reused_calls"] > 0
        assert mode.allowed_reads >= 6


# ====================================================================== torch.compile
def compiled_trajectory(model: nn.Module, schedule: str, regional: bool = False, steps: int = 12, **options):
    """Eager and compiled (``aot_eager``) outputs of one trajectory, the compiled frames after each step and the
    graph breaks."""
    outputs = []
    for backend in (None, torch._dynamo.testing.CompileCounterWithBackend("aot_eager")):
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        frames, outs = [], []
        with tomerge.merging(model, schedule, num_steps=steps, **options) as handle:
            runner = model
            if backend is not None and regional:
                for block in handle._blocks:
                    block.module.compile(backend=backend)
            elif backend is not None:
                runner = torch.compile(model, backend=backend)
            for t in times(steps):
                torch.manual_seed(0)
                outs.append(call(runner, inputs("native_dit", t)))
                frames.append(backend.frame_count if backend is not None else 0)
            assert handle.stats["reused_calls"] > 0
        if regional:
            for block in handle._blocks:
                block.module._compiled_call_impl = None
        outputs.append((outs, frames, dict(torch._dynamo.utils.counters["graph_break"])))
    torch._dynamo.reset()
    (eager, _, _), (compiled, frames, breaks) = outputs
    assert not breaks, breaks
    for a, b in zip(compiled, eager):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)
    return frames


@pytest.mark.parametrize("schedule, options", [
    ("fora", {}),
    ("taylorseer", dict(merge="tomesd", ratio=0.5, merge_options={"use_rand": False})),
    ("first_block_cache", dict(threshold=0.5)),
])
def test_a_compiled_trajectory_compiles_the_reusing_call_once_and_matches_eager(dit, schedule, options):
    """A block call that stores and one that reuses are two graphs, compiled in the first steps; nothing compiles
    after (no per-step recompile: the forecast's step distance is computed eagerly, outside the graphs)."""
    frames = compiled_trajectory(dit, schedule, **options)
    assert frames[-1] - frames[0] <= 1 and frames[-1] == frames[len(frames) // 3], frames


def test_regional_compilation_compiles_two_block_graphs(dit):
    frames = compiled_trajectory(dit, "fora", regional=True)
    assert frames[0] == 1 and frames[-1] == 2, frames


# ====================================================================== diffusers families
def family(name: str):
    """``(model, inputs, names of the tensors each block returns)``; the blocks' inputs of those names are the
    streams the cache adds residuals to."""
    if name == "dit":
        from helpers.models import make_inputs, tiny_dit
        return tiny_dit(), make_inputs("dit"), ("hidden_states",), "transformer_blocks"
    f = FAMILIES[name]
    model = f.build()
    outputs = {"qwenimage": ("encoder_hidden_states", "hidden_states")}.get(name, ("hidden_states",))
    return model, f.inputs(model), outputs, f.containers[0]


@pytest.mark.parametrize("name", ["dit", "sana", "wan", "qwenimage"])
def test_diffusers_families_reuse_every_stream_exactly_at_no_flop(name):
    model, kwargs, names, container = family(name)
    blocks = list(getattr(model, container))
    io: list[list[tuple[dict[str, Tensor], tuple[Tensor, ...]]]] = []

    def capture(module, args, kw, output):
        given = {"hidden_states": kw.get("hidden_states", args[0] if args else None), **kw}
        io[-1].append(({n: given[n] for n in names}, output if isinstance(output, tuple) else (output,)))
    hooks = [b.register_forward_hook(capture, with_kwargs=True) for b in blocks]

    def trajectory(schedule=None, **options):
        io.clear()
        handle = tomerge.apply(model, schedule, num_steps=3, **options) if schedule else None
        outs, flops = [], []
        for step in range(3):
            io.append([])
            t = kwargs["timestep"]
            step_kwargs = {**kwargs, "timestep": t * (1 - 0.2 * step)}
            counter = FlopCounter()
            with counter, torch.no_grad():
                outs.append(model(**step_kwargs).sample)
            counts = counter.get_flop_counts()
            flops.append((counter.get_total_flops(),
                          sum(sum(counts.get(f"{type(model).__name__}.{container}.{i}", {}).values())
                              for i in range(len(blocks)))))
        if handle:
            handle.remove()
        return outs, flops, [list(step) for step in io]

    try:
        base, base_flops, _ = trajectory()
        outs, _, _ = trajectory("block_cache", interval=1)
        assert all(torch.equal(a, b) for a, b in zip(outs, base))
        outs, flops, cached_io = trajectory("block_cache", interval=2)
        assert torch.equal(outs[0], base[0]) and torch.equal(outs[2], base[2]) and not torch.equal(outs[1], base[1])
        assert flops[1] == (base_flops[0][0] - base_flops[0][1], 0) and base_flops[0][1] > 0
        for layer in range(len(blocks)):
            (x0, y0), (x1, y1) = cached_io[0][layer], cached_io[1][layer]
            for i, stream in enumerate(names):
                assert torch.equal(y1[i], x1[stream] + (y0[i] - x0[stream])), (name, layer, stream)
        assert all(torch.equal(a, b) for a, b in zip(trajectory()[0], base))
        assert all("forward" not in b.__dict__ for b in blocks)
    finally:
        for h in hooks:
            h.remove()


def test_a_block_whose_tuple_output_is_undeclared_is_refused_by_name(monkeypatch):
    from tomerge.backbones.sd3 import SD3Adapter
    from helpers.models import make_inputs, tiny_sd3

    model, kwargs = tiny_sd3(), make_inputs("sd3")
    with torch.no_grad():
        before = model(**kwargs).sample
    monkeypatch.setattr(SD3Adapter, "block_outputs", None)
    with tomerge.merging(model, "fora", num_steps=4), torch.no_grad():
        with pytest.raises(TypeError, match=r"'joint' block \(JointTransformerBlock\) returned tuple of 2, where its "
                                            r"adapter declares one tensor.*BlockSpec.outputs"):
            model(**kwargs)
    with torch.no_grad():
        assert torch.equal(model(**kwargs).sample, before)


# ====================================================================== blocks that return a tuple
#: Families whose joint blocks return ``(text, image)`` or ``(image, text)`` (``Kind.outputs``); the video and audio
#: families are below (test_video_and_audio_families_run_every_caching_schedule).
TUPLE_FAMILIES = ["auraflow", "bria", "bria_fibo", "chroma", "cogvideox", "cogview3plus", "cogview4", "consisid",
                  "easyanimate", "flux3", "glm_image", "hidream", "longcat_image", "mochi", "ovis_image"]


@pytest.mark.parametrize("name", TUPLE_FAMILIES)
def test_blocks_that_return_a_tuple_reuse_each_declared_stream_exactly(name):
    """Interval 1 is the model bit for bit; with interval 2 the reused step's blocks return, for each element of
    their tuple, the input it replaces plus its residual of the last full step, and the full steps are the model's;
    fora, taylorseer and first_block_cache run with finite outputs and a first step that is the model's."""
    case = CASES[name]
    model = case.build()
    calls = trajectory(case, model)  # 3 steps
    base = run(case, model, calls)

    def cached_run(schedule: str, **options) -> tuple[list[Tensor], list[list[tuple[tuple, tuple]]]]:
        """Outputs, and each block call's (input streams, output streams) per step, in the declared order."""
        handle = tomerge.apply(model, schedule, num_steps=len(calls), **options)
        io: list[list[tuple[tuple, tuple]]] = []

        def capture(spec):
            def hook(module, args, kwargs, output):
                io[-1].append((spec.streams(args, kwargs), spec.output_streams(output)))
            return hook
        specs = handle.adapter.blocks()
        hooks = [spec.module.register_forward_hook(capture(spec), with_kwargs=True) for spec in specs]
        outs = []
        try:
            for inputs in calls:
                io.append([])
                outs.extend(run(case, model, [inputs]))
        finally:
            for h in hooks:
                h.remove()
            handle.remove()
        assert any(spec.outputs is not None and len(spec.outputs) == 2 for spec in specs)
        return outs, io

    every_step, _ = cached_run("block_cache", interval=1)
    assert all(torch.equal(a, b) for a, b in zip(every_step, base))
    outs, io = cached_run("block_cache", interval=2)
    assert torch.equal(outs[0], base[0]) and torch.equal(outs[2], base[2])
    assert torch.isfinite(outs[1]).all() and not torch.equal(outs[1], base[1])
    for layer, ((x0, y0), (x1, y1)) in enumerate(zip(io[0], io[1])):
        for stream, (a0, b0, a1, b1) in enumerate(zip(x0, y0, x1, y1)):
            assert b1 is None if b0 is None else torch.equal(b1, a1 + (b0 - a0)), (layer, stream)
    for schedule in ("fora", "taylorseer", "first_block_cache"):
        outs, _ = cached_run(schedule)
        assert torch.equal(outs[0], base[0]) and all(torch.isfinite(o).all() for o in outs), schedule
    assert all(torch.equal(a, b) for a, b in zip(run(case, model, calls), base))


def test_step_level_caching_is_refused_at_apply_where_blocks_cannot_be_skipped():
    """Wan VACE's control blocks return a new hint, no residual: the schedules that skip whole blocks are refused by
    apply with the reason `tomerge backbones` lists; toca, which skips no whole block, attaches."""
    model = build_wan_vace()
    for schedule in ("block_cache", "fora", "taylorseer", "first_block_cache"):
        with pytest.raises(NotImplementedError, match=rf"^schedule '{schedule}' skips whole block calls \(block cache\): "
                                                      r"backbone 'wan_vace' cannot skip its 'vace' blocks: they return "
                                                      r"a new hint beside the control tokens.*; use a merging strategy"):
            tomerge.apply(model, schedule, num_steps=4)
        assert "_tomerge_handle" not in model.__dict__ and all("forward" not in b.__dict__ for b in model.vace_blocks)
    tomerge.apply(model, "toca", num_steps=4).remove()


# ====================================================================== blocks that return (video, audio)
@pytest.mark.parametrize("name", ["kandinsky6", "ltx2"])
@pytest.mark.parametrize("schedule", [name for name in tomerge.registry.list_strategies() if caches_blocks(name)])
def test_video_and_audio_families_run_every_caching_schedule(models, name, schedule):
    """Six steps of each caching schedule on the families whose blocks return ``(video, audio)`` (toca merges the
    video stream and reuses its attention on partial steps): finite video and audio outputs of the plain shapes, the
    first step the plain model's, ``remove()`` restores it."""
    model = models[name]
    calls = [FAMILIES[name].inputs(model, batch=1, t=500.0 * (1 - 0.1 * step)) for step in range(6)]
    with torch.no_grad():
        before = model(**calls[0])
    handle = tomerge.apply(model, schedule, num_steps=6)
    try:
        with torch.no_grad():
            outs = [model(**call) for call in calls]
    finally:
        handle.remove()
    assert torch.equal(outs[0].sample, before.sample) and torch.equal(outs[0].audio_sample, before.audio_sample)
    for out in outs:
        assert out.sample.shape == before.sample.shape and torch.isfinite(out.sample).all()
        assert out.audio_sample.shape == before.audio_sample.shape and torch.isfinite(out.audio_sample).all()
    with torch.no_grad():
        assert torch.equal(model(**calls[0]).sample, before.sample)
    assert no_hooks_left(model)
