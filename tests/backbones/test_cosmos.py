"""What the `cosmos` adapter (backbones/cosmos.py, Cosmos) does beyond the family contract: steps counted in call order.
The checks every declared family passes are in test_family_contract.py; these are the family's own.
"""

from __future__ import annotations

import types

import torch

import tomerge
from helpers.family import run
from helpers.video_families import cosmos_inputs


def test_cosmos_counts_the_steps_in_call_order(models):
    """Cosmos Predict2 is called with sigma / (sigma + 1), not with its scheduler's timesteps (sigma * 1000): the
    steps of a run are counted in call order, the same with and without the pipeline's scheduler (looking the
    calls up in the schedule would put the first two calls on step 0: 0.83 is nearer 1.0 than 0.5)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    model = models["cosmos2_video2world"]
    scheduler = FlowMatchEulerDiscreteScheduler()
    scheduler.set_timesteps(3)
    assert [round(t) for t in scheduler.timesteps.tolist()] == [1000, 501, 1]
    for target in (types.SimpleNamespace(transformer=model, scheduler=scheduler), model):
        with tomerge.merging(target, "tomesd", ratio=0.5, use_rand=False) as handle:
            for sigma in (80.0, 5.0, 0.5):
                inputs = cosmos_inputs(model)
                run(model, dict(inputs, timestep=torch.full_like(inputs["timestep"], sigma / (sigma + 1))))
            assert [r.step for r in handle.state.records] == [0, 0, 1, 1, 2, 2]
            assert handle.state.clock.trajectory == 1
