"""``cached_detail`` (strategies/cached_detail.py): merging whose unmerge restores each token's detail from the
feature cache of the last full step.

The slot-offset rule ``y = unmerge(u) + c - unmerge(merge(c))`` is checked in float64 against the slot algebra it
stands for; through the real hooks on the tiny native DiT of ``helpers.compiled``: ``refresh_every=1``, ratio 0 and
``remove()`` are the unpatched model bit for bit; a step whose inputs are the full step's, merged only in
affine MLPs, returns the full step's output (where plain merging does not); the full steps are the unmerged
model's; a batch equals its samples; a compiled trajectory compiles no graph after its first steps; the
FLOP counter sees the merged steps' saving.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import tomerge
from tomerge.experiments.measure.flops import count_denoiser_flops
from tomerge.feature_cache import FeatureCaching
from tomerge.plan import MergePlan
from tomerge.schedule import Where
from tomerge.strategies.cached_detail import CachedDetail
from helpers.compiled import build, call, compiled_against_eager, inputs, times

OPTIONS = dict(merge="tomesd", merge_options={"use_rand": False, "merge_mlp": True})


def where(step: int) -> Where:
    return Where(step=step, num_steps=12, progress=step / 11, layer=0, num_layers=2)


def test_full_steps_store_what_the_merged_steps_restore():
    s = CachedDetail(**OPTIONS, ratio=0.5, refresh_every=3, warmup=2)
    labels = [s.decide(where(t)).label for t in range(8)]
    assert labels == ["full", "full", "tomesd", "tomesd", "full", "tomesd", "tomesd", "full"]
    full, merged = s.decide(where(1)), s.decide(where(2))
    assert full.strategy is None and full.technique(FeatureCaching).store == frozenset({"attn", "mlp"})
    assert merged.technique(FeatureCaching).detail == "merged_change" and merged.technique(FeatureCaching).weight is None
    assert merged.sublayers == frozenset({"attn", "mlp"})
    # one plan per layer and cycle: steps 2 and 3 share the key of full step 1, steps 5 and 6 that of step 4
    keys = [s.decide(where(t)).cache_key for t in (2, 3, 5, 6)]
    assert keys[0] == keys[1] != keys[2] == keys[3]
    offset = CachedDetail(**OPTIONS, ratio=0.5, refresh_every=3, detail="slot_offset").decide(where(1))
    assert offset.technique(FeatureCaching).detail == "slot_offset" and offset.cache_key is None


@pytest.mark.parametrize("bad, message", [
    (dict(refresh_every=0), "refresh_every"), (dict(warmup=0), "warmup"),
    (dict(merge="fora", merge_options={}, ratio=None), "caching schedule"), (dict(merge="nope"), "nope"),
    (dict(merge_options={"use_rand": False, "no_such_option": 1}), "no_such_option"),
    (dict(detail="offset"), "detail"),
])
def test_bad_options_are_refused_with_their_name(bad, message):
    with pytest.raises(ValueError, match=message):
        CachedDetail(**{**OPTIONS, "ratio": 0.5, **bad})


def test_the_restore_rule_is_each_tokens_offset_from_its_slot_mean():
    """With slots ``s`` of a hard plan: ``y_i = u_s + c_i - mean_{j in s} c_j``, written out slot by slot."""
    g = torch.Generator().manual_seed(0)
    slot = torch.tensor([[0, 0, 1, 2, 1, 1, 3, 0]])  # [B=1, N=8] -> 4 slots, sizes 3, 3, 1, 1
    plan = MergePlan.hard(slot, torch.tensor([[0, 2, 3, 6]]))
    c, u = torch.randn(1, 8, 5, generator=g, dtype=torch.float64), torch.randn(1, 4, 5, generator=g, dtype=torch.float64)
    restored = plan.unmerge(u) + (c - plan.unmerge(plan.merge(c)))
    for i, s in enumerate(slot[0].tolist()):
        members = (slot[0] == s).nonzero().flatten()
        # the plan's slot weights 1 / size are float32 (1/3 rounds): a mean is exact to float32 precision
        torch.testing.assert_close(restored[0, i], u[0, s] + c[0, i] - c[0, members].mean(0), rtol=0, atol=1e-7)
    assert torch.equal(restored[0, 3], u[0, 2])  # a token alone in its slot keeps its merged output


def trajectory(model: nn.Module, options: dict | None, calls: list[dict]) -> list[torch.Tensor]:
    if options is None:
        return [call(model, kwargs) for kwargs in calls]
    with tomerge.merging(model, **options, num_steps=len(calls)):
        return [call(model, kwargs) for kwargs in calls]


@pytest.fixture(scope="module")
def dit() -> nn.Module:
    return build("native_dit")


def test_refresh_every_step_ratio_zero_and_remove_are_the_unpatched_model(dit):
    calls = [inputs("native_dit", t) for t in times(6)]
    before = trajectory(dit, None, calls)
    for options in (dict(strategy="cached_detail", ratio=0.5, refresh_every=1, **OPTIONS),
                    dict(strategy="cached_detail", ratio=0.0, refresh_every=3, **OPTIONS)):
        assert all(torch.equal(a, b) for a, b in zip(trajectory(dit, options, calls), before)), options
    merged = trajectory(dit, dict(strategy="cached_detail", ratio=0.5, refresh_every=3, **OPTIONS), calls)
    assert all(torch.equal(merged[t], before[t]) for t in (0, 3))  # the full steps run unmerged
    assert all(not torch.equal(merged[t], before[t]) for t in (1, 2, 4, 5))
    assert all(torch.equal(a, b) for a, b in zip(trajectory(dit, None, calls), before))  # remove() left no trace


def test_a_step_like_the_full_one_is_restored_exactly_where_the_merged_sublayer_is_affine():
    """Timestep-blind model (the timestep embedding's last layer zeroed) with affine MLPs (no activation): a
    merged step on the full step's input gives every slot the mean of its tokens' cached outputs, and the
    restored detail makes each token's output its full-step output again. Plain merging averages it away."""
    model = build("native_dit")
    with torch.no_grad():
        model.t_embedder.mlp[2].weight.zero_()
    for block in model.blocks:
        block.mlp.act = nn.Identity()
    same = [inputs("native_dit", t) for t in (0.9, 0.8)]  # two steps (the timestep differs), one input
    full = trajectory(model, None, same[:1])[0]
    mlp_only = {"use_rand": False, "merge_attn": False, "merge_mlp": True}
    restored = trajectory(model, dict(strategy="cached_detail", ratio=0.5, refresh_every=2, merge="tomesd",
                                      merge_options=mlp_only, detail="slot_offset"), same)
    plain = trajectory(model, dict(strategy="tomesd", ratio=0.5, merge_from=0.5, **mlp_only), same)
    assert torch.equal(restored[0], full)
    # exact up to the plan's float32 slot weights (1/3 rounds; the affine maps' biases carry that rounding)
    torch.testing.assert_close(restored[1], full, rtol=0, atol=1e-8)
    assert (plain[1] - full).abs().max() > 1e-4


def test_merged_steps_whose_merged_output_does_not_change_return_the_full_step_bit_for_bit():
    """Timestep-blind model, one input at four timesteps: every merged step of the cycle merges with the same
    plan, so its merged output equals the first merged step's (the reference) and ``merged_change`` returns
    the cached full-step output itself. Plain merging returns its merged output instead."""
    model = build("native_dit")
    with torch.no_grad():
        model.t_embedder.mlp[2].weight.zero_()
    same = [inputs("native_dit", t) for t in (0.9, 0.8, 0.7, 0.6)]
    full = trajectory(model, None, same[:1])[0]
    options = dict(strategy="cached_detail", ratio=0.5, refresh_every=4, **OPTIONS)
    restored = trajectory(model, options, same)
    plain = trajectory(model, dict(strategy="tomesd", ratio=0.5, **OPTIONS["merge_options"]), same)
    assert all(torch.equal(out, full) for out in restored)
    assert all((out - full).abs().max() > 1e-4 for out in plain)


def test_a_batch_equals_its_samples(dit):
    options = dict(strategy="cached_detail", ratio=0.5, refresh_every=3, **OPTIONS)
    pair = [inputs("native_dit", t) for t in times(4)]
    batched = trajectory(dit, options, pair)
    for sample in range(2):
        alone = [{k: v[sample:sample + 1] for k, v in kwargs.items()} for kwargs in pair]
        for a, b in zip(trajectory(dit, options, alone), batched):
            torch.testing.assert_close(a[0], b[sample], rtol=1e-12, atol=1e-12)


def test_a_compiled_trajectory_compiles_nothing_after_its_first_steps():
    frames = compiled_against_eager("native_dit", "cached_detail", options=dict(refresh_every=3, **OPTIONS))
    assert frames[-1] == frames[len(frames) // 3], frames


def test_the_flop_counter_sees_the_merged_steps_saving(dit):
    calls = [inputs("native_dit", t) for t in times(6)]

    def per_step(*args, **options) -> list[float]:
        with tomerge.merging(dit, *args, num_steps=6, **options):
            return [count_denoiser_flops(dit, lambda: call(dit, kwargs))[0] for kwargs in calls]

    unmerged = count_denoiser_flops(dit, lambda: call(dit, calls[0]))[0]
    plain = per_step("tomesd", ratio=0.5, **OPTIONS["merge_options"])
    change = per_step("cached_detail", ratio=0.5, refresh_every=3, **OPTIONS)
    offset = per_step("cached_detail", ratio=0.5, refresh_every=3, detail="slot_offset", **OPTIONS)
    assert change[0] == change[3] == offset[0] == offset[3] == unmerged  # the full steps
    # the first merged step of a cycle plans and merges as plain merging does; the next one reuses its plan
    assert change[1] == change[4] == plain[1] and change[2] == change[5] < plain[2]
    # slot_offset plans every merged step; its merge and unmerge of the cached output (a hard plan's gathers
    # and sums) are not matrix products, which the counter prices at 0 as it does every elementwise op
    assert [offset[t] for t in (1, 2, 4, 5)] == [plain[t] for t in (1, 2, 4, 5)]
