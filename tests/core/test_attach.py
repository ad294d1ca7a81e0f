"""apply/remove guarantees, option validation, the trajectory clock and registries."""

import dataclasses
import re
import types

import pytest
import torch
from torch import nn

import tomerge
from tomerge.state import TrajectoryClock
from helpers.models import tiny_unet, unet_inputs

STRATEGIES = ["tomesd", "ssm", "idm", "facility_location"]


@pytest.fixture(scope="module")
def unet():
    return tiny_unet()


def forward(unet, inputs):
    with torch.no_grad():
        return unet(*inputs).sample


def no_hooks_left(model):
    return all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


@pytest.mark.parametrize("name", STRATEGIES)
def test_remove_restores_bit_identical_outputs_and_leaves_no_trace(unet, name):
    inputs = unet_inputs()
    before = forward(unet, inputs)
    handle = tomerge.apply(unet, name, ratio=0.5, adapter={"max_downsample": 2})
    merged = forward(unet, inputs)
    assert handle.stats["tokens_removed"] > 0
    assert not torch.equal(merged, before)
    tomerge.remove(unet)
    assert torch.equal(forward(unet, inputs), before)
    assert no_hooks_left(unet) and "_tomerge_handle" not in unet.__dict__


@pytest.mark.parametrize("name", STRATEGIES)
def test_ratio_zero_is_bit_identical(unet, name):
    inputs = unet_inputs()
    before = forward(unet, inputs)
    with tomerge.merging(unet, name, ratio=0.0, adapter={"max_downsample": 8}):
        assert torch.equal(forward(unet, inputs), before)


def test_idm_records_received_attention_and_merges_only_the_mlp(unet):
    inputs = unet_inputs()
    with tomerge.merging(unet, "idm", ratio=0.5, adapter={"max_downsample": 1}) as handle:
        forward(unet, inputs)
        attention = handle.state.attention
        assert attention and all(a.shape == (2, 256) for a in attention.values())
        assert all(torch.allclose(a.sum(-1), torch.ones(2)) for a in attention.values())
        merged = [r for r in handle.state.records if r.num_removed]
        assert merged and all(r.sublayers == ("mlp",) for r in merged)


def test_applying_twice_raises_and_remove_without_apply_raises(unet):
    with tomerge.merging(unet, "tomesd", ratio=0.5):
        with pytest.raises(RuntimeError, match="already applied"):
            tomerge.apply(unet, "ssm", ratio=0.5)
    with pytest.raises(ValueError, match="not applied"):
        tomerge.remove(unet)


def test_merging_removes_after_an_exception(unet):
    with pytest.raises(ZeroDivisionError):
        with tomerge.merging(unet, "tomesd", ratio=0.5):
            1 / 0
    assert no_hooks_left(unet)


def test_model_without_blocks_raises_naming_what_was_looked_for():
    from diffusers import UNet2DConditionModel

    plain = UNet2DConditionModel(sample_size=8, block_out_channels=(32, 32), norm_num_groups=8,
                                 down_block_types=("DownBlock2D", "DownBlock2D"),
                                 up_block_types=("UpBlock2D", "UpBlock2D"), mid_block_type=None,
                                 cross_attention_dim=32, layers_per_block=1)
    with pytest.raises(ValueError, match="BasicTransformerBlock"):
        tomerge.apply(plain, "tomesd", ratio=0.5)
    with pytest.raises(ValueError, match="no registered backbone"):
        tomerge.apply(nn.Linear(2, 2), "tomesd", ratio=0.5)


@pytest.mark.parametrize("ratio", [1.0, -0.1, 1.5, "0.5", True])
def test_ratio_out_of_range_raises(unet, ratio):
    with pytest.raises(ValueError, match="ratio"):
        tomerge.apply(unet, "tomesd", ratio=ratio)
    assert no_hooks_left(unet)


def test_unknown_names_and_options_raise_with_the_valid_ones(unet):
    with pytest.raises(KeyError, match="facility_location"):
        tomerge.apply(unet, "tome", ratio=0.5)
    with pytest.raises(TypeError, match="valid options.*use_rand"):
        tomerge.apply(unet, "tomesd", ratio=0.5, use_rnd=False)
    with pytest.raises(TypeError, match=r"valid options.*max_downsample"):
        tomerge.apply(unet, "tomesd", ratio=0.5, adapter={"max_downsampel": 2})
    with pytest.raises(ValueError, match="max_downsample"):
        tomerge.apply(unet, "tomesd", ratio=0.5, adapter={"max_downsample": 3})
    with pytest.raises(TypeError, match=r"\['max_downsample'\] are options of the 'unet' adapter: pass adapter="):
        tomerge.apply(unet, "tomesd", ratio=0.5, max_downsample=2)
    with pytest.raises(TypeError, match="ratio"):
        tomerge.apply(unet, "tomesd")
    with pytest.raises(TypeError, match="valid options"):
        tomerge.get_strategy("ssm", windw=2)
    with pytest.raises(ValueError, match="backbone 'unet' found no model"):
        tomerge.apply(nn.Linear(2, 2), "tomesd", ratio=0.5, backbone="unet")
    assert no_hooks_left(unet)


def test_wrong_token_shapes_raise_clear_errors():
    s = tomerge.get_strategy("ssm")
    with pytest.raises(ValueError, match="do not fill the grid"):
        s.plan(torch.randn(1, 15, 4), tomerge.MergeContext(grid=(4, 4), ratio=0.5))
    with pytest.raises(ValueError, match=r"\[B, N, C\]"):
        s.plan(torch.randn(16, 4), tomerge.MergeContext(grid=(4, 4), ratio=0.5))
    with pytest.raises(ValueError, match="grid"):
        tomerge.MergeContext(grid=(0, 4), ratio=0.5)
    with pytest.raises(ValueError, match="received_attention"):
        tomerge.get_strategy("idm").plan(torch.randn(1, 16, 4), tomerge.MergeContext(grid=(4, 4), ratio=0.5))


def test_strategy_instances_and_their_default_ratio(unet):
    inputs = unet_inputs()
    by_name = tomerge.apply(unet, "tomesd", ratio=0.5, use_rand=False)
    a = forward(unet, inputs)
    by_name.remove()
    with tomerge.merging(unet, tomerge.get_strategy("tomesd", ratio=0.5, use_rand=False)):
        assert torch.equal(forward(unet, inputs), a)
    with pytest.raises(TypeError, match="go into the strategy"):
        tomerge.apply(unet, tomerge.get_strategy("tomesd"), ratio=0.5, use_rand=False)


def test_register_strategy_rejects_duplicates_and_lists_new_names():
    @tomerge.register_strategy("test_only_every_other")
    @dataclasses.dataclass(frozen=True, kw_only=True)
    class EveryOther(tomerge.MergeStrategy):
        def select_destinations(self, x, ctx):
            return torch.arange(0, x.shape[1], 2).expand(x.shape[0], -1)

        def merge_matrix(self, x, dst, ctx):
            return tomerge.MergePlan.hard(torch.arange(x.shape[1]).div(2, rounding_mode="floor")
                                          .expand(x.shape[0], -1), dst)

    assert "test_only_every_other" in tomerge.list_strategies()
    assert tomerge.get_strategy("test_only_every_other").name == "test_only_every_other"
    with pytest.raises(ValueError, match="already registered"):
        tomerge.register_strategy("ssm")(EveryOther)


def test_clock_steps_from_distinct_timesteps():
    clock = TrajectoryClock()
    steps = []
    for t in [999, 999, 999, 800, 800, 600, 999, 700]:  # split CFG and a third call per step, then a new run
        clock.observe(torch.tensor([t]))
        steps.append((clock.trajectory, clock.step))
    assert steps == [(1, 0), (1, 0), (1, 0), (1, 1), (1, 1), (1, 2), (2, 0), (2, 1)]
    assert clock.progress == pytest.approx(0.3)  # 1 - 700 / 1000 when the step count is unknown


def test_clock_uses_the_scheduler_when_attached_to_a_pipeline(unet):
    scheduler = types.SimpleNamespace(timesteps=torch.tensor([900, 600, 300, 0]))
    pipe = types.SimpleNamespace(unet=unet, scheduler=scheduler)
    inputs = unet_inputs()
    with tomerge.merging(pipe, "tomesd", ratio=0.5) as handle:
        assert handle.model is unet
        for t in [900, 900, 300]:
            with torch.no_grad():
                unet(inputs[0], torch.tensor(t), inputs[2])
        assert (handle.state.clock.step, handle.state.clock.num_steps) == (2, 4)
        assert handle.state.clock.progress == pytest.approx(2 / 3)
    assert no_hooks_left(unet)


def test_warns_when_no_block_is_merged_as_on_sdxl_with_max_downsample_1():
    from diffusers import UNet2DConditionModel

    torch.manual_seed(0)
    sdxl_like = UNet2DConditionModel(  # like SDXL: no transformer block at full resolution
        sample_size=16, block_out_channels=(32, 64), norm_num_groups=8, layers_per_block=1,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=32, attention_head_dim=8).eval()
    inputs = unet_inputs()
    with tomerge.merging(sdxl_like, "tomesd", ratio=0.5, adapter={"max_downsample": 1}) as handle:
        messages = tomerge_warnings(lambda: (forward(sdxl_like, inputs), forward(sdxl_like, inputs)))
        messages += tomerge_warnings(handle.remove)
    assert messages == [  # once, at the first call: it is known then
        "tomerge: no block of this UNet2DConditionModel call was merged or reused: no block with a token grid: none "
        f"is mergeable with the 'unet' adapter's options {handle.adapter.options} at this input size; change the "
        "adapter's options (e.g. max_downsample) or the input size"]
    with tomerge.merging(sdxl_like, "tomesd", ratio=0.5, adapter={"max_downsample": 2}) as handle:
        forward(sdxl_like, inputs)
        assert handle.stats["tokens_removed"] > 0


def test_unet_blocks_are_numbered_in_execution_order(unet):
    with tomerge.merging(unet, "tomesd", ratio=0.5, adapter={"max_downsample": 2}) as handle:
        forward(unet, unet_inputs())
        layers = [r.layer for r in handle.state.records]
    assert layers == list(range(handle.state.num_layers))  # down, mid, up: the order they run in


def test_the_hooks_unmerge_with_the_strategys_own_unmerge(unet):
    """``MergeStrategy.unmerge`` is what the hooks call: an override sees every merged sublayer output."""
    from tomerge.strategies.ssm import SSM

    seen: list[tuple[int, int]] = []

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Doubling(SSM):
        def unmerge(self, y, plan):
            seen.append((y.shape[1], plan.num_tokens))
            return 2 * plan.unmerge(y)

    inputs = unet_inputs()
    with tomerge.merging(unet, SSM(round_windows=1), ratio=0.5, adapter={"max_downsample": 2}):
        plain = forward(unet, inputs)
    with tomerge.merging(unet, Doubling(round_windows=1), ratio=0.5, adapter={"max_downsample": 2}) as handle:
        doubled = forward(unet, inputs)
        merged_calls = sum(len(r.sublayers) for r in handle.state.records if r.num_removed)
    assert len(seen) == merged_calls > 0 and all(m < n for m, n in seen)
    assert not torch.allclose(plain, doubled)


def test_an_option_may_not_hide_a_method_the_core_calls():
    from tomerge.strategies.ssm import SSM

    with pytest.raises(TypeError, match="unmerge"):
        @dataclasses.dataclass(frozen=True, kw_only=True)
        class Hiding(SSM):
            unmerge: str = "pinv"


def test_capabilities_are_properties_an_option_may_not_hide_but_a_constant_may_set():
    from typing import ClassVar

    from tomerge.strategies.ssm import SSM
    from tomerge.strategies.tomesd import ToMeSD

    with pytest.raises(TypeError, match="needs"):
        @dataclasses.dataclass(frozen=True, kw_only=True)
        class Hiding(SSM):
            needs: frozenset = frozenset()

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Constant(SSM):
        plan_input: ClassVar[str] = "block_input"

    assert Constant().plan_input == "block_input" and SSM().plan_input == "sublayer"
    assert ToMeSD().generator_policy == "fork_global" and ToMeSD(rng="per_step_layer").generator_policy == "per_step_layer"
    assert SSM().generator_policy == "per_step_layer"


# ====================================================================== handle.stats and the warning of a handle that did nothing
# On the tiny native DiT of test_compile: 2 blocks, one guidance pair per model call (batch 2), 8 x 8 = 64 tokens.
NATIVE_STEPS = 5


@pytest.fixture(scope="module")
def dit():
    from helpers.compiled import build

    return build("native_dit")


def sample(model, steps: int = NATIVE_STEPS, batch_of_step=lambda step: 2, same_t: bool = False) -> None:
    """One trajectory of ``steps`` model calls (the times of test_compile), each step's batch ``batch_of_step``."""
    from helpers.compiled import call, inputs, times

    for step, t in enumerate(times(steps)):
        kwargs = inputs("native_dit", times(steps)[0] if same_t else t)
        call(model, {k: v[:batch_of_step(step)] for k, v in kwargs.items()})


def tomerge_warnings(run) -> list[str]:
    """The messages of the warnings tomerge gives while ``run()`` runs."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run()
    return [str(w.message) for w in caught if str(w.message).startswith("tomerge:")]


@pytest.mark.parametrize("schedule, options, expected", [
    # 5 steps x 2 blocks = 10 block calls; full steps 0, 2, 4 (count up from the warm-up step 0), reused 1, 3
    ("block_cache", dict(interval=2), dict(merged_calls=0, reused_calls=4, computed_calls=6, forecast_calls=0)),
    # the same with tomesd on the blocks that run: 64 tokens, 32 removed in each of the 6
    ("block_cache", dict(interval=2, merge="tomesd", ratio=0.5, merge_options=dict(use_rand=False)),
     dict(merged_calls=6, reused_calls=4, computed_calls=0, forecast_calls=0, tokens=6 * 64, tokens_removed=6 * 32)),
    # warm-up steps 0 and 1, full step 1 + 4 = 5 is past the end: steps 2, 3, 4 forecast
    ("taylorseer", {}, dict(merged_calls=0, reused_calls=6, computed_calls=4, forecast_calls=6)),
    # the first block runs at every step, the second reuses from step 1 on (any change is below 1e9)
    ("first_block_cache", dict(threshold=1e9), dict(merged_calls=0, reused_calls=4, computed_calls=6)),
    ("tomesd", dict(ratio=0.5, use_rand=False), dict(merged_calls=10, reused_calls=0, computed_calls=0,
                                                    tokens=10 * 64, tokens_removed=10 * 32)),
])
def test_stats_count_what_the_block_calls_did(dit, schedule, options, expected):
    with tomerge.merging(dit, schedule, num_steps=NATIVE_STEPS, **options) as handle:
        messages = tomerge_warnings(lambda: sample(dit))
        stats = handle.stats
    assert messages == []  # it merged or reused: nothing to warn about
    expected = {"model_calls": 5, "block_calls": 10, "sublayer_reused_calls": 0, "reuse_missed_calls": 0,
                "tokens": 0, "tokens_removed": 0, "forecast_calls": 0, "step": 4, "num_steps": 5, **expected}
    assert stats == expected


def test_a_cache_that_reuses_only_at_the_last_step_is_not_warned_about(dit):
    """Warm-up 4 of 5 steps: steps 0-3 run every block, step 4 reuses; the check waits for the trajectory's end."""
    with tomerge.merging(dit, "block_cache", interval=2, warmup=4, num_steps=NATIVE_STEPS) as handle:
        messages = tomerge_warnings(lambda: sample(dit))
        assert (handle.stats["reused_calls"], handle.stats["computed_calls"]) == (2, 8)
    assert messages == []


def sample_twice(model, schedule, options, **sample_options) -> tuple[list[str], list[str], dict]:
    """The tomerge warnings of two trajectories (given while they run, and at remove()) and the stats."""
    def run():
        handle = tomerge.apply(model, schedule, **options)
        try:
            during.extend(tomerge_warnings(lambda: (sample(model, **sample_options), sample(model, **sample_options))))
        finally:
            stats.update(handle.stats)
            at_remove.extend(tomerge_warnings(handle.remove))
    during, at_remove, stats = [], [], {}
    run()
    return during, at_remove, stats


@pytest.mark.parametrize("schedule, options, sample_options, when, reason", [
    ("first_block_cache", dict(threshold=1e-9, num_steps=5), {}, "during",
     r"reused nothing in 10 block calls: the threshold was never crossed: the first block's residual changed by at "
     r"least \S+ per step, not below threshold=1e-09; raise the threshold"),
    ("block_cache", dict(warmup=5, num_steps=5), {}, "during",
     r"reused nothing in 10 block calls: the step count leaves no reuse step: no step of the 5 seen \(of "
     r"num_steps=5\) was one its warmup and interval reuse; run more steps or lower the warmup or interval"),
    ("taylorseer", dict(num_steps=2), dict(steps=2), "during", r"reused nothing in 4 block calls: the step count leaves no reuse step"),
    ("tomesd", dict(ratio=0.5, merge_from=0.9, merge_until=0.95, num_steps=5), {}, "during",
     r"merged nothing in 10 block calls: the schedule decided no merge in any block call of the 5 steps seen; check "
     r"its step options \(merge_from/merge_until"),
    ("tomesd", dict(ratio=0.01, num_steps=5), {}, "during",
     r"merged nothing in 10 block calls: the strategy removed no token in the 10 block calls it was asked to merge "
     r"\(too few tokens for the ratio\); raise the ratio"),
    ("block_cache", dict(interval=2, num_steps=5), dict(batch_of_step=lambda step: 2 - step % 2), "during",
     r"reused nothing in 10 block calls: each of its 4 reuses found no kept residual of its input's shape \(the batch "
     r"or size changed between steps\)"),
    ("fora", dict(num_steps=5), dict(same_t=True), "at_remove",
     r"reused nothing in 20 block calls: all 10 model calls were at one step \(their timestep never changed"),
])
def test_a_handle_that_merged_or_reused_nothing_warns_once_with_the_reason(dit, schedule, options, sample_options,
                                                                           when, reason):
    """Each reason once over two trajectories: when the clock reaches the last step of the first (while the pipeline
    runs; its 5 steps x 2 blocks = 10 block calls), or at remove() where the clock never got there."""
    during, at_remove, stats = sample_twice(dit, schedule, options, **sample_options)
    messages = during + at_remove
    assert len(messages) == 1 and len({"during": during, "at_remove": at_remove}[when]) == 1, messages
    what = "strategy" if schedule == "tomesd" else "schedule"
    assert re.fullmatch(rf"tomerge: {what} '{schedule}' on this DiT {reason}.*", messages[0]), messages[0]
    assert stats["merged_calls"] == stats["reused_calls"] == 0


def test_a_pipeline_that_bypasses_the_hooked_module_is_named(dit):
    from helpers.compiled import inputs

    kwargs = inputs("native_dit", 0.5)
    with tomerge.merging(dit, "fora", num_steps=5) as handle:  # the blocks run, the model's hooks do not
        with torch.no_grad():
            messages = tomerge_warnings(lambda: [dit.forward(**kwargs) for _ in range(3)])
        assert messages == [] and handle.stats["block_calls"] == 6 and handle.stats["model_calls"] == 0
        messages = tomerge_warnings(handle.remove)
    assert len(messages) == 1 and messages[0].startswith(
        "tomerge: schedule 'fora' on this DiT reused nothing in 6 block calls: a pipeline bypassed the hooked module: "
        "its blocks ran outside a call of it (model.forward(...) called directly"), messages

    def skip_the_blocks(*args, **kwargs):
        return kwargs["x"]
    dit.forward = skip_the_blocks  # the model's hooks run, its blocks do not
    try:
        with tomerge.merging(dit, "tomesd", ratio=0.5) as handle:
            messages = tomerge_warnings(lambda: [dit(**kwargs) for _ in range(2)])
            messages += tomerge_warnings(handle.remove)
    finally:
        del dit.forward
    assert messages == ["tomerge: strategy 'tomesd' on this DiT merged nothing in 0 block calls: the model ran 2 "
                        "times but none of its 2 hooked blocks did (the pipeline or a graph compiled before apply "
                        "bypassed them); apply to the module the pipeline runs (e.g. transformer_2 too), and compile "
                        "after apply"]


def test_a_handle_that_saw_no_call_or_merges_at_ratio_zero_warns_nothing(dit):
    assert tomerge_warnings(lambda: tomerge.apply(dit, "fora").remove()) == []
    with tomerge.merging(dit, "tomesd", ratio=0.0, num_steps=NATIVE_STEPS) as handle:
        messages = tomerge_warnings(lambda: sample(dit))
        assert handle.stats["computed_calls"] == 10
    assert messages == []
