"""What the `hunyuan_dit` adapter (backbones/hunyuan_dit.py, Hunyuan-DiT) does beyond the family contract: idm records
received attention in every block, after the long skips. The checks every declared family passes are in
test_family_contract.py; these are the family's own.
"""

from __future__ import annotations

import torch

import tomerge
from helpers.family import run
from helpers.image_families import hunyuan_dit_inputs


def test_hunyuan_dit_idm_records_received_attention_in_every_block(models):
    """Hunyuan-DiT's image self-attention declares a probe: idm gets every block's received attention ([B, N]) in
    the same block call and merges (the second half's blocks after their skip connection too)."""
    model = models["hunyuan_dit"]
    inputs = hunyuan_dit_inputs(model)
    with tomerge.merging(model, "idm", ratio=0.5) as handle:
        out = run(model, inputs)
        assert set(handle.state.attention) == {0, 1, 2, 3}
        assert all(a.shape == (2, 64) and torch.allclose(a.sum(-1), torch.ones(2))
                   for a in handle.state.attention.values())
        assert all(r.num_removed > 0 for r in handle.state.records)
    assert torch.isfinite(out).all()
