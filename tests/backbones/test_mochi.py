"""What the `mochi` adapter (backbones/mochi.py, Mochi 1) does beyond the family contract: rising timesteps as one
trajectory, and its per-sample joint attention's probe. The checks every declared family passes are in
test_family_contract.py; these are the family's own.
"""

from __future__ import annotations

import copy
import types

import pytest
import torch
from torch import nn

import tomerge
from helpers.family import run, to_float64
from helpers.video_families import mochi_inputs


# Mochi's RoPE runs under torch.autocast(float32), which diffusers calls on the CPU too.
pytestmark = pytest.mark.filterwarnings("ignore:In CPU autocast, but the target dtype is not supported")


def test_mochi_rising_timesteps_advance_one_trajectory(models):
    """Mochi's pipeline calls the model with t rising from noise to data (inverted sigmas): the adapter reports
    1000 - t, so the calls of one sampling run are steps 0, 1, 2 of one trajectory, found in the scheduler's
    schedule (mapped the same way) and, without a scheduler, by the order of the calls."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    model = models["mochi"]
    scheduler = FlowMatchEulerDiscreteScheduler(invert_sigmas=True)
    scheduler.set_timesteps(sigmas=[1.0, 0.6, 0.3])
    rising = scheduler.timesteps.tolist()
    assert rising == sorted(rising) and rising[0] < 500 < rising[-1]
    for target in (types.SimpleNamespace(transformer=model, scheduler=scheduler), model):
        with tomerge.merging(target, "tomesd", ratio=0.5, use_rand=False) as handle:
            for t in rising:
                run(model, dict(mochi_inputs(model), timestep=torch.full((2,), t)))
            clock = handle.state.clock
            assert [r.step for r in handle.state.records] == [0, 0, 1, 1, 2, 2]
            assert clock.trajectory == 1 and clock.progress == pytest.approx(1.0 if target is not model else
                                                                             rising[-1] / 1000)


def _attn1(model: nn.Module) -> dict[int, nn.Module]:
    return {layer: block.attn1 for layer, block in enumerate(model.transformer_blocks)}


def test_mochi_joint_probe_equals_the_models_attention(models):
    """float64: Mochi attends per sample over [video, the prompt's valid text tokens] (one SDPA call per sample,
    no mask: the padding is cut out) with its pairwise RoPE on the video q/k; the recorded received attention
    equals the probe's rule computed from those calls (the second prompt is 3 tokens shorter, so its padded
    text tokens are neither queries nor keys)."""
    from helpers.probes import idm_records, record_sdpa, reference_received_attention

    model = copy.deepcopy(models["mochi"]).double()
    inputs = to_float64(mochi_inputs(model))
    seen, hooks = record_sdpa(_attn1(model))
    recorded = idm_records(model, inputs, hooks)
    assert sorted(recorded) == [0, 1]
    for layer, calls in seen.items():
        assert [call["query"].shape[2] for call in calls] == [32 + 8, 32 + 5]  # per sample: video + valid text
        reference = torch.cat([reference_received_attention(call["query"], call["key"], call.get("attn_mask"),
                                                            call.get("scale"), 32, text_first=False)
                               for call in calls])  # [B, N]
        torch.testing.assert_close(recorded[layer].double(), reference, rtol=1e-5, atol=1e-8)
        assert (reference.max(-1).values - reference.min(-1).values > 1e-3).all()  # not uniform: real q/k
