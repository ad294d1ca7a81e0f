"""What the `hunyuan_video` adapter (backbones/hunyuan_video.py, HunyuanVideo) does beyond the family contract: its
joint key mask follows the slots. The checks every declared family passes are in test_family_contract.py; these are the
family's own.
"""

from __future__ import annotations

import tomerge
from helpers.family import ALL_SUBLAYERS, run
from helpers.video_families import hunyuan_video_inputs


def test_hunyuan_video_joint_key_mask_follows_the_slots(models):
    """HunyuanVideo masks padded text keys in a [B, 1, 1, N + T] mask over [image, text]: merged calls gather
    its image columns, so the second (padded) prompt is masked as before (the permutation test is exact with
    it); a wrong mask length would raise inside SDPA."""
    model = models["hunyuan_video"]
    seen = []
    with tomerge.merging(model, "tomesd", ratio=0.5, use_rand=False, **ALL_SUBLAYERS):
        attn = model.transformer_blocks[0].attn
        hook = attn.register_forward_pre_hook(lambda m, a, k: seen.append(k["attention_mask"]), with_kwargs=True)
        try:
            run(model, hunyuan_video_inputs(model))
        finally:
            hook.remove()
    mask = seen[0]  # [B, 1, 1, M + T]
    assert mask.shape == (2, 1, 1, 16 + 8)
    assert mask[0].all() and mask[1, 0, 0, :21].all() and not mask[1, 0, 0, 21:].any()
