"""What the `wan_animate` adapter (backbones/wan_animate.py, Wan 2.2 Animate) does beyond the family contract: the face
adapter between blocks gets the full-length video tokens. The checks every declared family passes are in
test_family_contract.py; these are the family's own.
"""

from __future__ import annotations

import torch

import tomerge
from helpers.family import ALL_SUBLAYERS, run
from helpers.video_families import wan_animate_inputs


def test_wan_animate_face_adapter_gets_the_full_length_video_tokens(models):
    """The face adapter runs between blocks, on the blocks' full-length output, frame-aligned with the motion
    frames: merging leaves it as it is."""
    model = models["wan_animate"]
    seen = []
    with tomerge.merging(model, "tomesd", ratio=0.5, use_rand=False, **ALL_SUBLAYERS) as handle:
        hook = model.face_adapter[0].register_forward_pre_hook(lambda m, a: seen.append(tuple(a[0].shape)))
        try:
            out = run(model, wan_animate_inputs(model))
        finally:
            hook.remove()
        assert handle.stats["tokens_removed"] == 2 * 16
    assert seen == [(2, 32, 256)] and torch.isfinite(out).all()
