"""What the `kandinsky5` adapter (backbones/kandinsky5.py, Kandinsky 5.0 video) does beyond the family contract: a batch
plans as its samples though the model is not batch-invariant, its probe from the query and key norms, sparse attention
calls left unmerged. The checks every declared family passes are in test_family_contract.py; these are the family's own.
"""

from __future__ import annotations

import copy

import pytest
import torch

import tomerge
from helpers.family import ALL_SUBLAYERS, run, select, to_float64
from helpers.probes import idm_attention_and_inputs
from helpers.video_families import KANDINSKY5_POSITIONS, kandinsky5_inputs


@pytest.mark.tie_sensitive
@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")  # its norms get float32 q, k
def test_kandinsky5_batch_plans_are_its_samples_plans(models, monkeypatch):
    """Kandinsky 5 is not batch-invariant by itself: its time embedding computes in float32 whatever the model's
    dtype (kept so here, as diffusers keeps it) and its attention rounds the rotated q and k to bfloat16, so a batch
    and its samples alone differ (~1e-4) even unmerged. In float64 otherwise, every block of the batch still gets
    each sample's own plan (destinations and assignment), and the merged outputs differ as little."""
    from tomerge.state import MergeState

    model = copy.deepcopy(models["kandinsky5"]).double()
    model.time_embeddings.float()
    inputs = to_float64(kandinsky5_inputs(model, seed=5))
    parts = [inputs] + [select(inputs, i, KANDINSKY5_POSITIONS) for i in (0, 1)]
    plans: list = []
    plan_for = MergeState.plan_for

    def recording(self, call, tokens):
        plan = plan_for(self, call, tokens)
        if not any(plan is seen for seen in plans):
            plans.append(plan)
        return plan

    monkeypatch.setattr(MergeState, "plan_for", recording)
    plain = [run(model, part) for part in parts]
    merged, per_part = [], []
    for part in parts:
        plans.clear()
        with tomerge.merging(model, "tomesd", ratio=0.5, use_rand=False, **ALL_SUBLAYERS):
            merged.append(run(model, part))
        per_part.append(list(plans))
    batch, alone = per_part[0], per_part[1:]
    assert len(batch) == 2 and all(len(p) == 2 for p in alone)  # one plan per block
    for layer in range(2):
        for b in range(2):
            assert torch.equal(batch[layer].dst[b], alone[b][layer].dst[0])
            assert torch.equal(batch[layer].assign[b], alone[b][layer].assign[0])
    unmerged_gap = (plain[0] - torch.cat(plain[1:])).abs().max()
    merged_gap = (merged[0] - torch.cat(merged[1:])).abs().max()
    assert 0 < unmerged_gap < 1e-3 and merged_gap < 1e-3


def test_kandinsky5_received_attention_is_computed_from_its_query_and_key_norms(models):
    """The probe declared on ``to_query``/``to_key`` + ``query_norm``/``key_norm``: every video query's softmax
    over the video keys (after the per-head norms, before the rotation), averaged over heads and queries."""
    model = models["kandinsky5"]
    inputs = kandinsky5_inputs(model)
    recorded, seen = idm_attention_and_inputs(
        model, inputs, [block.self_attention for block in model.visual_transformer_blocks], lambda: run(model, inputs))
    assert sorted(recorded) == sorted(seen) == [0, 1]
    for layer, x in seen.items():
        attn = model.visual_transformer_blocks[layer].self_attention
        with torch.no_grad():
            q = attn.query_norm(attn.to_query(x).unflatten(2, (attn.num_heads, -1)).float()).double()
            k = attn.key_norm(attn.to_key(x).unflatten(2, (attn.num_heads, -1)).float()).double()
        p = torch.einsum("bqhd,bkhd->bhqk", q, k).mul(q.shape[-1] ** -0.5).softmax(-1)  # [B, h, N, N]
        torch.testing.assert_close(recorded[layer].double(), p.mean(dim=(1, 2)), rtol=1e-4, atol=1e-6)


@pytest.mark.filterwarnings("ignore:tomerge. no block")
def test_kandinsky5_sparse_attention_calls_are_not_merged(models):
    """With ``sparse_params`` (nabla attention) the tokens are in a fractal order and attend through a block mask
    of the full sequence: the call's grid is unknown (no block merges), with the adapter's warning saying why."""
    model = models["kandinsky5"]
    inputs = dict(kandinsky5_inputs(model), sparse_params={"to_fractal": False, "sta_mask": None, "P": 0.9})
    with tomerge.merging(model, "tomesd", ratio=0.5) as handle:
        with pytest.warns(UserWarning, match="sparse"):
            assert handle.adapter.on_model_call((), inputs) is not None
        assert handle.adapter.grid_size is None
