"""What the `flux3` adapter (backbones/flux3.py, FLUX.3) does beyond the family contract: its mode blocks' probe, and
calls with reference images left unmerged. The checks every declared family passes are in test_family_contract.py; these
are the family's own.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

import tomerge
from helpers import seeded
from helpers.family import grid_ids, run
from helpers.image_families import flux3_inputs


def test_flux3_mode_block_probe_records_the_attention_each_image_token_receives(models):
    """FLUX.3's mode-block attention unflattens its heads before the q/k norms ([B, N, heads, d]); idm's record
    equals the softmax attention computed here from the same projections, averaged over heads and queries."""
    model = models["flux3"]
    inputs = flux3_inputs(model)
    attn = model.mode_blocks["image"][0].attn
    seen: list[Tensor] = []
    hook = attn.register_forward_pre_hook(lambda m, args, kwargs: seen.append(kwargs["hidden_states"]),
                                          with_kwargs=True)
    try:
        with tomerge.merging(model, "idm", ratio=0.5) as handle:  # idm merges the MLP: the attention runs in full
            run(model, inputs)
            recorded = handle.state.attention[0]  # [B, N]: layer 0 is the image mode block
            assert handle.stats["tokens_removed"] > 0
    finally:
        hook.remove()
    x = seen[0]  # [B, N, C], the attention's input
    q = attn.norm_q(attn.to_q(x).unflatten(-1, (attn.heads, -1)).float()).transpose(1, 2)  # [B, h, N, d]
    k = attn.norm_k(attn.to_k(x).unflatten(-1, (attn.heads, -1)).float()).transpose(1, 2)
    expected = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).softmax(-1).mean(dim=(1, 2))  # [B, N]
    torch.testing.assert_close(recorded, expected, rtol=1e-5, atol=1e-7)


@pytest.mark.filterwarnings("ignore:tomerge. no block")
def test_flux3_reference_image_calls_are_not_merged(models):
    """With reference images (image_cond_hidden_states) the single blocks' content is [image, reference]: the
    call runs unmerged, with a warning, and gives the unpatched output."""
    model = models["flux3"]
    inputs = flux3_inputs(model, grid=(4, 4))
    g = seeded(9)
    inputs.update(image_cond_hidden_states=torch.randn(2, 16, 128, generator=g),
                  image_cond_ids=grid_ids(1, 4, 4, 1) + torch.tensor([10, 0, 0, 0]))  # Flux3 reference ids: t = 10
    before = run(model, inputs)
    with tomerge.merging(model, "tomesd", ratio=0.5) as handle:
        with pytest.warns(UserWarning, match="reference-image"):
            out = run(model, inputs)
        assert handle.stats["tokens_removed"] == 0
    assert torch.equal(out, before)
