"""What the `skyreels_v2` adapter (backbones/skyreels_v2.py, SkyReels-V2) does beyond the family contract: the
block-causal mask of diffusion forcing gathered on both axes. The checks every declared family passes are in
test_family_contract.py; these are the family's own.
"""

from __future__ import annotations

import pytest
import torch

import tomerge
from helpers import no_hooks_left
from helpers.family import ALL_SUBLAYERS, check_permutation_is_exact, Permute, run
from helpers.video_families import build_skyreels_v2, skyreels_v2_inputs


def test_skyreels_v2_block_causal_mask_is_gathered_on_both_axes():
    """With causal blocks of 2 frames (``num_frame_per_block=2``) attn1 gets a block-causal mask ``[1, 1, N, N]``:
    merged calls gather its rows and columns per slot (the permutation is exact with it), and the probe that
    ignores masks refuses to rank tokens."""
    model = build_skyreels_v2()
    model._set_ar_attention(2)
    inputs = skyreels_v2_inputs(model, grid=(4, 2, 2), seed=3)
    N = 16
    check_permutation_is_exact(model, inputs, None, N)
    seen = []
    with tomerge.merging(model, "tomesd", ratio=0.5, use_rand=False, **ALL_SUBLAYERS):
        attn = model.blocks[0].attn1
        hook = attn.register_forward_pre_hook(lambda m, a, k: seen.append((a[0].shape[1], a[2])), with_kwargs=True)
        try:
            out = run(model, inputs)
        finally:
            hook.remove()
    assert torch.isfinite(out).all()
    (M, mask), = seen
    assert M == N // 2 and mask.shape == (2, 1, M, M) and mask.dtype == torch.bool  # per-sample plans
    block_of = torch.arange(N) // 4 // 2  # token -> its causal block (2 frames of 2 x 2 tokens)
    with tomerge.merging(model, Permute(), ratio=0.5, **ALL_SUBLAYERS):  # the mask a per-sample permutation gets
        attn = model.blocks[0].attn1
        hook = attn.register_forward_pre_hook(lambda m, a, k: seen.append((a[0].shape[1], a[2])), with_kwargs=True)
        try:
            run(model, inputs)
        finally:
            hook.remove()
    _, permuted = seen[1]  # [B, 1, N, N]
    slots = Permute().select_destinations(torch.zeros(2, N, 1), None)  # [B, N]: the token of each slot
    assert permuted.shape == (2, 1, N, N) and not torch.equal(slots[0], slots[1])
    for b in range(2):
        blocks = block_of[slots[b]]
        assert torch.equal(permuted[b, 0], blocks[None, :] <= blocks[:, None])  # query slot i sees key slot j
    with pytest.raises(NotImplementedError, match="attention mask.*probe ignores masks"):
        with tomerge.merging(model, "idm", ratio=0.5):
            run(model, inputs)
    assert no_hooks_left(model)
