"""What the `z_image` adapter (backbones/z_image.py, Z-Image) does beyond the family contract: the scheduler's timestep
direction, padded images and captions in place, Omni calls left unmerged. The checks every declared family passes are in
test_family_contract.py; these are the family's own.
"""

from __future__ import annotations

import pytest
import torch

import tomerge
from helpers import seeded
from helpers.family import ALL_SUBLAYERS, run
from helpers.image_families import randn, z_image_inputs


def test_z_image_reports_the_schedulers_timestep_direction(models):
    """ZImagePipeline calls the model with t = (1000 - timestep) / 1000 (1 at the clean image): the adapter gives
    1 - t, so the clock's progress rises along the trajectory."""
    model = models["z_image"]
    with tomerge.merging(model, "tomesd", ratio=0.5) as handle:
        inputs = z_image_inputs(model, grid=(4, 4))
        assert handle.adapter.call_timestep((), dict(inputs, t=torch.full((2,), 0.25))).tolist() == [0.75, 0.75]
        for t in (0.1, 0.6):
            run(model, dict(inputs, t=torch.full((2,), t)))
        assert handle.state.clock.step == 1 and handle.state.clock.progress == pytest.approx(0.6)


def test_z_image_pads_and_captions_stay_in_place(models):
    """On a 5 x 7 grid every sample's 35 image tokens are padded to 64 and its caption follows: the refiner and
    the main blocks merge the 35 image tokens alone (the permutation test is exact on this grid too)."""
    model = models["z_image"]
    inputs = z_image_inputs(model, grid=(5, 7))
    seen: list[tuple[int, int]] = []
    with tomerge.merging(model, "tomesd", ratio=0.5, use_rand=False, **ALL_SUBLAYERS) as handle:
        hooks = [block.attention.register_forward_pre_hook(lambda m, a, k: seen.append(tuple(a[0].shape[:2])),
                                                           with_kwargs=True)
                 for block in (model.noise_refiner[0], model.layers[0])]
        try:
            run(model, inputs)
        finally:
            for h in hooks:
                h.remove()
        removed = [r.num_removed for r in handle.state.records]
    assert all(r > 0 for r in removed)
    M = 35 - removed[0]
    assert seen == [(2, M + 29), (2, M + 29 + 64)]  # merged image + image padding (+ captions padded to 64)


@pytest.mark.filterwarnings("ignore:tomerge. no block")
def test_z_image_omni_calls_are_not_merged(models):
    """Z-Image Omni's nested lists (condition images before the target) are no single grid: unmerged, a warning."""
    model = models["z_image"]
    g = seeded(8)
    inputs = dict(x=[[randn(g, torch.float32, 16, 1, 8, 8), randn(g, torch.float32, 16, 1, 8, 8)]],
                  t=torch.full((1,), 0.5), cap_feats=[[randn(g, torch.float32, 8, 2560)] * 2],
                  siglip_feats=[None], image_noise_mask=[[0, 1]])
    before = run(model, inputs)
    with tomerge.merging(model, "tomesd", ratio=0.5) as handle:
        with pytest.warns(UserWarning, match="Omni"):
            out = run(model, inputs)
        assert handle.stats["tokens_removed"] == 0
    assert torch.equal(out, before)
