"""What the `hidream` adapter (backbones/hidream.py, HiDream-I1) does beyond the family contract: non-square latents are
left unmerged with a reason. The checks every declared family passes are in test_family_contract.py; these are the
family's own.
"""

from __future__ import annotations

import pytest
import torch

import tomerge
from helpers import seeded
from helpers.family import run
from helpers.image_families import hidream_inputs


@pytest.mark.filterwarnings("ignore:tomerge. no block")
def test_hidream_non_square_latents_are_not_merged_with_a_reason(models):
    """A non-square HiDream latent is padded to max_resolution's 256 tokens with a key mask: not merged, and the
    warning says why (calls of square latents merge as before)."""
    model = models["hidream"]
    inputs = hidream_inputs(model, grid=(4, 4))
    inputs["hidden_states"] = torch.randn(2, 16, 8, 12, generator=seeded(11))  # 4 x 6 patches
    with tomerge.merging(model, "tomesd", ratio=0.5) as handle:
        with pytest.warns(UserWarning, match="non-square"):
            out = run(model, inputs)
        assert handle.stats["tokens_removed"] == 0
        run(model, hidream_inputs(model, grid=(4, 4)))
        assert handle.stats["tokens_removed"] > 0
    assert out.shape == (2, 16, 8, 12) and torch.isfinite(out).all()
