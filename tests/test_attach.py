"""apply/remove guarantees, option validation, the trajectory clock and registries."""

import dataclasses
import types

import pytest
import torch
from torch import nn

import tomerge
from tomerge.state import TrajectoryClock
from models import tiny_unet, unet_inputs

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
    handle = tomerge.apply(unet, name, ratio=0.5, max_downsample=2)
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
    with tomerge.merging(unet, name, ratio=0.0, max_downsample=8):
        assert torch.equal(forward(unet, inputs), before)


def test_idm_records_received_attention_and_merges_only_the_mlp(unet):
    inputs = unet_inputs()
    with tomerge.merging(unet, "idm", ratio=0.5, max_downsample=1) as handle:
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
    with pytest.raises(TypeError, match="valid options.*max_downsample"):
        tomerge.apply(unet, "tomesd", ratio=0.5, max_downsampel=2)
    with pytest.raises(ValueError, match="max_downsample"):
        tomerge.apply(unet, "tomesd", ratio=0.5, max_downsample=3)
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
    with tomerge.merging(sdxl_like, "tomesd", ratio=0.5, max_downsample=1):
        with pytest.warns(UserWarning, match="no block of this UNet2DConditionModel call was merged"):
            forward(sdxl_like, inputs)
    with tomerge.merging(sdxl_like, "tomesd", ratio=0.5, max_downsample=2) as handle:
        forward(sdxl_like, inputs)
        assert handle.stats["tokens_removed"] > 0


def test_unet_blocks_are_numbered_in_execution_order(unet):
    with tomerge.merging(unet, "tomesd", ratio=0.5, max_downsample=2) as handle:
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
    with tomerge.merging(unet, SSM(round_windows=1), ratio=0.5, max_downsample=2):
        plain = forward(unet, inputs)
    with tomerge.merging(unet, Doubling(round_windows=1), ratio=0.5, max_downsample=2) as handle:
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


def test_the_old_capability_name_metric_is_refused_not_ignored():
    """``plan_input`` was called ``metric``: a strategy that still defines it would plan from the wrong tensor
    without a word, so the class definition raises."""
    from tomerge.strategies.ssm import SSM

    with pytest.raises(TypeError, match="plan_input"):
        @dataclasses.dataclass(frozen=True, kw_only=True)
        class OldName(SSM):
            @property
            def metric(self) -> str:
                return "block_input"


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
        batch_independent: ClassVar[bool] = False

    assert Constant().batch_independent is False and SSM().batch_independent is True
    assert ToMeSD().generator_policy == "fork_global" and ToMeSD(rng="per_step_layer").generator_policy == "per_step_layer"
    assert SSM().generator_policy == "per_step_layer"
