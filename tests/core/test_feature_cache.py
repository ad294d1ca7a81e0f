"""The feature cache of the ``sdtm`` schedule (``cache_weight``, the authors' ``mcw``), through the real hooks.

The authors' rule (``TR_SDTM.py``, ``make_SDTM_block`` and the ``unmerge`` functions of ``SSM``/``FIDM``): on
a protected step every block stores its full-length sublayer outputs; on a merged step each merged
sublayer's unmerged output is, for the tokens of merged groups (SSM: every token of a merged window),
``mcw * output + (1 - mcw) * cached``; other tokens keep their output; protected layers neither store nor
blend. The tests run a tiny SD3 transformer (the authors' model family) for two steps, capture each merge
point's raw output (a hook registered before ``apply`` sees the merged ``[B, M, C]`` tensor) and its final
output (a hook registered after), and rebuild the expected blend from the plan and the protected step.
"""

from __future__ import annotations

import pytest
import torch

import tomerge
from tomerge import MergeContext
from tomerge.strategies.sdtm import SDTM
from helpers.models import make_inputs, tiny_sd3

W = 0.25


def capture(modules: dict[str, torch.nn.Module], steps: list[dict], step: list[int]) -> list:
    """Forward hooks writing each module's image-token output (SD3's attention returns ``(image, text)``) into
    ``steps[step[0]]``."""
    def hook(name):
        def fn(module, args, out):
            steps[step[0]][name] = (out[0] if isinstance(out, tuple) else out).detach().clone()
        return fn
    return [m.register_forward_hook(hook(n)) for n, m in modules.items()]


def points(model) -> dict[str, torch.nn.Module]:
    return {f"{i}.{kind}": getattr(block, kind) for i, block in enumerate(model.transformer_blocks)
            for kind in ("attn", "ff")}


def slot_members(plan) -> torch.Tensor:
    """``[B, N]`` bool: tokens sharing their slot with another token, from ``assign`` alone."""
    sizes = torch.stack([torch.bincount(a, minlength=plan.num_slots) for a in plan.assign])  # [B, M]
    return sizes.gather(1, plan.assign) > 1


def two_steps(schedule: SDTM, seed: int = 1):
    """Step 0 (protected) then step 1 of a 4-step trajectory; returns raw and final outputs of both steps and
    the plans of step 1 by layer."""
    model = tiny_sd3(dual=False)
    inputs = make_inputs("sd3", seed=seed)
    raw: list[dict] = [{}, {}]
    final: list[dict] = [{}, {}]
    plans: dict[int, object] = {}
    step = [0]
    hooks = capture(points(model), raw, step)  # before apply: they see what the module returned
    handle = tomerge.apply(model, schedule, num_steps=4)
    hooks += capture(points(model), final, step)  # after apply: they see what tomerge's hooks made of it
    handle.state.observers.append(lambda call, plan: plans.__setitem__(call.where.layer, plan))
    for step[0] in range(2):
        with torch.no_grad():
            model(**{**inputs, "timestep": torch.full((2,), 900.0 - 100 * step[0])})
    for h in hooks:
        h.remove()
    handle.remove()
    return raw, final, plans


def test_merged_tokens_blend_with_the_protected_steps_outputs_in_the_structure_phase():
    schedule = SDTM(ratio=0.5, protect_every=2, switch_step=3, round_windows=1, prompt_reweight=None,
                    cache_weight=W)
    raw, final, plans = two_steps(schedule)
    assert set(plans) == {0, 1}
    for layer, plan in plans.items():
        merged = slot_members(plan)  # [B, N]
        assert merged.any() and not merged.all()
        for kind in ("attn", "ff"):
            name = f"{layer}.{kind}"
            cached = final[0][name]  # [B, N, C]: the protected step's full-length output
            assert raw[0][name].shape == cached.shape  # step 0 ran unmerged
            assert raw[1][name].shape[1] == plan.num_slots  # step 1 ran merged
            unmerged = plan.unmerge(raw[1][name])  # [B, N, C]
            expected = torch.where(merged.unsqueeze(-1), W * unmerged + (1 - W) * cached, unmerged)
            torch.testing.assert_close(final[1][name], expected, rtol=1e-5, atol=1e-6)
            assert not torch.allclose(final[1][name], unmerged)  # the blend changed something


def test_detail_phase_blends_only_the_merged_mlp_and_the_window_destinations_count():
    schedule = SDTM(ratio=0.5, protect_every=2, switch_step=0, idm_variant="streak", idm_round_tokens=1,
                    prompt_reweight=None, cache_weight=W)
    raw, final, plans = two_steps(schedule)
    for layer, plan in plans.items():
        assert torch.equal(final[1][f"{layer}.attn"], raw[1][f"{layer}.attn"])  # attention ran unmerged: untouched
        name = f"{layer}.ff"
        grid = (16, 16)
        merged = schedule.idm.merged_tokens(plan, MergeContext(grid=grid, ratio=0.5))  # [B, N]
        # The authors' FIDM blends every destination (one per 2x2 window: 64), and the merged sources.
        assert int(merged[0].sum()) == 64 + plan.num_removed
        unmerged = plan.unmerge(raw[1][name])
        expected = torch.where(merged.unsqueeze(-1), W * unmerged + (1 - W) * final[0][name], unmerged)
        torch.testing.assert_close(final[1][name], expected, rtol=1e-5, atol=1e-6)


def test_weight_one_is_the_schedule_without_cache_and_remove_is_bit_exact():
    common = dict(ratio=0.5, protect_every=2, switch_step=3, round_windows=1, prompt_reweight=None)
    model = tiny_sd3(dual=False)
    inputs = make_inputs("sd3")

    def trajectory(schedule):
        outs = []
        with tomerge.merging(model, schedule, num_steps=4), torch.no_grad():
            for step in range(4):
                outs.append(model(**{**inputs, "timestep": torch.full((2,), 900.0 - 100 * step)}).sample)
        return outs

    with torch.no_grad():
        before = model(**inputs).sample
    plain, weight_one, cached = (trajectory(SDTM(**common)), trajectory(SDTM(**common, cache_weight=1.0)),
                                 trajectory(SDTM(**common, cache_weight=W)))
    for a, b in zip(plain, weight_one):
        assert torch.equal(a, b)
    assert torch.equal(plain[0], cached[0])  # step 0 is protected: nothing to blend yet
    assert not torch.allclose(plain[1], cached[1])
    with torch.no_grad():
        assert torch.equal(model(**inputs).sample, before)


@pytest.mark.parametrize("options, match", [
    (dict(cache_weight=0.1), "protect_every"),
    (dict(cache_weight=1.5, protect_every=3), "cache_weight"),
    (dict(cache_weight=-0.1, protect_every=3), "cache_weight"),
])
def test_cache_weight_needs_protected_steps_and_a_weight_in_range(options, match):
    with pytest.raises(ValueError, match=match):
        SDTM(**options)
