"""What the adapters of backbones/cogview.py (`cogview4`, `glm_image`, `cogview3plus`) do beyond the family contract:
the feed-forward shared by the image and text calls, a text mask through merged calls, GLM-Image's condition-image pass.
The checks every declared family passes are in test_family_contract.py; these are the family's own.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

import tomerge
from helpers.families import FAMILIES
from helpers.family import ALL_SUBLAYERS, check_permutation_is_exact, run
from helpers.image_families import glm_image_inputs


@pytest.mark.parametrize("name", ["cogview4", "glm_image"])
def test_the_shared_feed_forward_merges_the_image_call_and_leaves_the_text_call(models, name):
    """CogView4 and GLM-Image call one ``ff`` on the image, then on the text stream: the first call runs on the
    merged image tokens, the second on all text tokens, and with only the MLP merged the text stream's output is
    that of the unpatched block (with the attention merged, text queries would see merged image keys)."""
    family, model = FAMILIES[name], models[name]
    inputs = family.inputs(model, seed=7)
    block = model.transformer_blocks[0]

    def observed() -> tuple[list[int], Tensor, Tensor]:
        seen, text_out = [], []
        hooks = [block.ff.register_forward_pre_hook(lambda m, args: seen.append(args[0].shape[1])),
                 block.register_forward_hook(lambda m, args, out: text_out.append(out[1]))]
        try:
            out = run(model, inputs)
        finally:
            for h in hooks:
                h.remove()
        return seen, text_out[0], out

    plain_seen, plain_text, _ = observed()
    with tomerge.merging(model, "tomesd", ratio=0.5, use_rand=False, merge_attn=False, merge_mlp=True) as handle:
        seen, text, out = observed()  # hooks registered after tomerge's: they see what the module gets
        assert handle.stats["tokens_removed"] > 0
    assert plain_seen == [64, 8] and seen == [32, 8]  # the image call on 32 slots, the text call on its 8 tokens
    assert torch.isfinite(out).all()
    torch.testing.assert_close(text, plain_text, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["cogview4", "glm_image"])
def test_a_text_mask_passes_through_merged_calls(models, name):
    """CogView4's and GLM-Image's processors join the text mask [B, T] with an all-ones image part of the call's
    own length: merged calls pass it as it is, and a permutation still gives the unpatched output."""
    family, model = FAMILIES[name], models[name]
    inputs = family.inputs(model, seed=12, masked=True)
    assert not torch.equal(run(model, inputs), run(model, family.inputs(model, seed=12)))  # the mask matters
    check_permutation_is_exact(model, inputs, None, 64)


@pytest.mark.filterwarnings("ignore:tomerge. no block")
def test_glm_image_condition_image_pass_is_not_merged_and_is_not_a_step(models):
    """GLM-Image's image-to-image calls first run each condition image with the key/value cache in ``"write"``
    mode: those tokens are reference context, stored at full length, and the call (timestep 0) is not a step."""
    from diffusers.models.transformers.transformer_glm_image import GlmImageKVCache

    model = models["glm_image"]
    caches = GlmImageKVCache(num_layers=2)
    caches.set_mode("write")
    condition = glm_image_inputs(model, batch=1, grid=(4, 4), seed=8, text=0)
    condition["timestep"] = torch.zeros(1)
    with tomerge.merging(model, "tomesd", ratio=0.5, use_rand=False, **ALL_SUBLAYERS) as handle:
        run(model, dict(condition, kv_caches=caches))
        assert handle.stats["tokens_removed"] == 0 and handle.state.clock.current is None
        assert caches[0].k_caches[0].shape[1] == 16  # all 4 x 4 reference tokens' keys
        caches.set_mode("read")
        out = run(model, dict(glm_image_inputs(model, batch=1, seed=9), kv_caches=caches))
        assert handle.stats["tokens_removed"] > 0 and torch.isfinite(out).all()
