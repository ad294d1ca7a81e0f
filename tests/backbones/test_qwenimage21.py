"""What the `qwenimage21` adapter (backbones/qwenimage21.py, Qwen-Image 2.1) does beyond the family contract: editing
with a condition image, the prefix KV cache's steps, the flex-attention block mask refused. The checks every declared
family passes are in test_family_contract.py; these are the family's own.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

import tomerge
from helpers.family import ALL_SUBLAYERS, check_permutation_is_exact, Permute, run
from helpers.image_families import qwenimage21_inputs, qwenimage21_output


def test_qwenimage21_editing_merges_the_target_and_keeps_the_condition_image(models):
    """A condition image sits inside the prompt; the target is last: the grid is the target's, every block
    removes target tokens only, and the permutation is exact (the condition tokens and their rotary rows stay)."""
    model = models["qwenimage21"]
    inputs = qwenimage21_inputs(model, grid=(4, 6), condition=(4, 4), seed=2)
    with tomerge.merging(model, "tomesd", ratio=0.5, use_rand=False) as handle:
        run(model, inputs)
        assert handle.adapter.grid_size == (4, 6)
        assert all(r.num_tokens == 24 and r.num_removed > 0 for r in handle.state.records)
    check_permutation_is_exact(model, inputs, None, 24)


def test_qwenimage21_prefix_kv_cache_steps_merge_exactly(models):
    """The pipeline's KV cache: the first step stores the prefix keys ("extract"), later steps run the target
    alone against them ("cached", a [B, 1, 1, P + N] key mask). A per-sample permutation gives the plain outputs
    of both steps, and tomesd merges both."""
    from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21KVCache

    model = models["qwenimage21"]
    inputs = qwenimage21_inputs(model, seed=3)

    def steps(strategy: str | tomerge.MergeStrategy | None = None) -> tuple[list[Tensor], list]:
        """The two steps' target outputs (merged with ``strategy``) and the merge records."""
        cache = QwenImage21KVCache(len(model.transformer_blocks))
        calls = [dict(inputs, kv_cache=cache, kv_cache_mode="extract"),
                 dict(inputs, timestep=torch.full((2,), 0.3), kv_cache=cache, kv_cache_mode="cached")]
        if strategy is None:
            return [qwenimage21_output(model, c) for c in calls], []
        with tomerge.merging(model, strategy, ratio=0.5, **ALL_SUBLAYERS) as handle:
            return [qwenimage21_output(model, c) for c in calls], handle.state.records

    plain, _ = steps()
    assert plain[1].shape == (2, 64, 64)  # cached steps return the target alone
    permuted, records = steps(Permute())
    assert [(r.step, r.num_tokens) for r in records] == [(0, 64), (0, 64), (1, 64), (1, 64)]
    for out, ref in zip(permuted, plain):
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    merged, records = steps("tomesd")
    assert all(r.num_removed > 0 for r in records) and all(torch.isfinite(out).all() for out in merged)


def test_qwenimage21_flex_block_mask_is_refused_on_merged_calls(models):
    """QwenImage21FlexAttnProcessor's BlockMask is built for the unmerged sequence: a merged call raises. Its
    prefill calls flex attention, not SDPA, so idm's probe (the target queries' SDPA call) raises too."""
    from diffusers.models.transformers.transformer_qwenimage21 import (QwenImage21AttnProcessor,
                                                                       QwenImage21FlexAttnProcessor)

    model = models["qwenimage21"]
    model.set_attn_processor(QwenImage21FlexAttnProcessor())
    try:
        with tomerge.merging(model, "tomesd", ratio=0.5):
            with pytest.raises(ValueError, match="BlockMask"):
                run(model, qwenimage21_inputs(model, grid=(4, 4)))
        with tomerge.merging(model, "idm", ratio=0.5):  # the attention runs unmerged, with the BlockMask
            with pytest.raises(RuntimeError, match="expected one call of .*scaled_dot_product_attention over the "
                                                   "most keys, got 0"):
                run(model, qwenimage21_inputs(model, grid=(4, 4)))
    finally:
        model.set_attn_processor(QwenImage21AttnProcessor())
