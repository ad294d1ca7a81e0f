"""What the `easyanimate` adapter (backbones/easyanimate.py, EasyAnimate V5.1) does beyond the family contract: the
feed-forward shared with the text stream. The checks every declared family passes are in test_family_contract.py; these
are the family's own.
"""

from __future__ import annotations

import torch

import tomerge
from helpers.family import run
from helpers.video_families import easyanimate_inputs


def test_easyanimate_shared_ff_merges_the_video_call_and_passes_the_text_call(models):
    """EasyAnimate's blocks without text projections call ``ff`` twice, on the video stream, then on the text
    stream: the first call runs on the merged video tokens, the second on the whole text (the permutation test
    shows that the unmerge of the first is exact)."""
    model = models["easyanimate"]
    assert model.transformer_blocks[0].txt_ff is not None and model.transformer_blocks[1].txt_ff is None
    seen: dict[int, list[int]] = {0: [], 1: []}
    with tomerge.merging(model, "tomesd", ratio=0.5, use_rand=False, merge_attn=False, merge_mlp=True):
        hooks = [block.ff.register_forward_pre_hook(lambda m, args, i=i: seen[i].append(args[0].shape[1]))
                 for i, block in enumerate(model.transformer_blocks)]  # after tomerge's hooks
        try:
            out = run(model, easyanimate_inputs(model))
        finally:
            for h in hooks:
                h.remove()
    assert torch.isfinite(out).all()
    assert seen == {0: [16], 1: [16, 8]}  # merged video (32 -> 16), then the 8 text tokens unmerged
