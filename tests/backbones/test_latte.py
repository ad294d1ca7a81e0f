"""What the `latte` adapter (backbones/latte.py, Latte) does beyond the family contract: its spatial blocks merged per
frame, its temporal blocks at full length. The checks every declared family passes are in test_family_contract.py; these
are the family's own.
"""

from __future__ import annotations

import tomerge
from helpers.family import ALL_SUBLAYERS, run
from helpers.video_families import LATTE_FRAMES, latte_inputs


def test_latte_merges_each_frame_of_its_spatial_blocks_and_leaves_the_temporal_blocks_at_full_length(models):
    model = models["latte"]
    seen: dict[str, list[tuple[int, ...]]] = {"spatial": [], "temporal": []}
    with tomerge.merging(model, "tomesd", ratio=0.5, use_rand=False, **ALL_SUBLAYERS) as handle:
        hooks = [model.transformer_blocks[0].attn1.register_forward_pre_hook(  # after tomerge's hooks
                     lambda m, args: seen["spatial"].append(tuple(args[0].shape[:2]))),
                 model.temporal_transformer_blocks[0].register_forward_pre_hook(
                     lambda m, args: seen["temporal"].append(tuple(args[0].shape[:2])))]
        try:
            run(model, latte_inputs(model))
        finally:
            for h in hooks:
                h.remove()
        assert [r.num_tokens for r in handle.state.records] == [16, 16]
    assert seen == {"spatial": [(2 * LATTE_FRAMES, 8)], "temporal": [(2 * 16, LATTE_FRAMES)]}
