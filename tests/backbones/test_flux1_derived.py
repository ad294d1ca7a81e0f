"""What the FLUX.1-derived adapters (backbones/flux1_derived.py: `chroma`, `bria`, `bria_fibo`, `longcat_image`,
`ovis_image`) do beyond the family contract: editing calls with reference ids left unmerged, Chroma's query-by-key mask
gathered on both axes. The checks every declared family passes are in test_family_contract.py; these are the family's
own.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

import tomerge
from helpers.families import FAMILIES
from helpers.family import ALL_SUBLAYERS, run
from helpers.image_families import chroma_inputs


@pytest.mark.filterwarnings("ignore:tomerge. no block")
@pytest.mark.parametrize("name", ["bria_fibo", "longcat_image"])
def test_editing_reference_ids_are_not_merged(models, name):
    """FIBO Edit and LongCat-Image Edit append the reference image's tokens and ids (another modality index, the
    same rows and columns): the ids are no single grid, so the call runs unmerged with a warning."""
    family, model = FAMILIES[name], models[name]
    inputs = family.inputs(model, grid=(4, 4))
    inputs["hidden_states"] = torch.cat([inputs["hidden_states"]] * 2, dim=1)
    inputs["img_ids"] = torch.cat([inputs["img_ids"], inputs["img_ids"] + torch.tensor([1.0, 0, 0])])
    if name == "bria_fibo":  # its key mask covers the reference tokens too
        mask = inputs["joint_attention_kwargs"]["attention_mask"]
        inputs["joint_attention_kwargs"] = {"attention_mask": torch.cat([mask, mask[..., -16:]], dim=-1)}
    before = run(model, inputs)
    with tomerge.merging(model, "tomesd", ratio=0.5) as handle:
        with pytest.warns(UserWarning, match="token grid of this"):
            out = run(model, inputs)
        assert handle.stats["tokens_removed"] == 0
    assert torch.equal(out, before)


def test_chroma_query_by_key_mask_is_gathered_on_both_axes(models):
    """Chroma's blocks turn the [B, T + N] mask into m[:, None, :, None] * m[:, None, None, :]: the merged call's
    mask is that product over [text, merged image] (the image rows and columns of the slots' tokens)."""
    model = models["chroma"]
    inputs = chroma_inputs(model)
    seen: list[Tensor] = []
    with tomerge.merging(model, "tomesd", ratio=0.5, use_rand=False, **ALL_SUBLAYERS) as handle:
        attn = model.transformer_blocks[0].attn
        hook = attn.register_forward_pre_hook(lambda m, a, k: seen.append(k["attention_mask"]), with_kwargs=True)
        try:
            run(model, inputs)
        finally:
            hook.remove()
        assert handle.stats["tokens_removed"] > 0
    m = inputs["attention_mask"][:, : 8 + 32]  # [B, T + M]: the image columns are ones, like any gather of them
    assert torch.equal(seen[0], m[:, None, :, None] * m[:, None, None, :])
