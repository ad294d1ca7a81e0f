"""What the `lumina2` adapter (backbones/lumina2.py, Lumina-Image 2.0) does beyond the family contract: ragged and equal
caption lengths, its rising timestep, its probes against the model's attention. The checks every declared family passes
are in test_family_contract.py; these are the family's own.
"""

from __future__ import annotations

import copy

import torch

import tomerge
from helpers.family import ALL_SUBLAYERS, check_permutation_is_exact, run, to_float64
from helpers.image_families import build_lumina2, lumina2_inputs


def test_lumina2_ragged_and_equal_caption_lengths_both_merge_exactly(models):
    """Lumina 2 joins only each caption's real tokens before the image: with a shorter second caption its image
    tokens start 3 rows earlier and a key mask is passed, with equal captions they start at one offset and no mask
    is passed. Both give the unpatched output under a permutation, which holds only if every sample's image part
    is found at its own offset; merged at ratio 0.5 the mask keeps each sample's caption and padding."""
    model = models["lumina2"]
    for padding in (3, 0):
        check_permutation_is_exact(model, lumina2_inputs(model, seed=10, padding=padding), None, 64)
    masks: list = []
    with tomerge.merging(model, "tomesd", ratio=0.5, use_rand=False, **ALL_SUBLAYERS):
        hook = model.layers[0].attn.register_forward_pre_hook(  # after tomerge's hooks: the merged call
            lambda m, args, kwargs: masks.append(kwargs["attention_mask"]), with_kwargs=True)
        try:
            for padding in (3, 0):
                run(model, lumina2_inputs(model, seed=10, padding=padding))
        finally:
            hook.remove()
    ragged, equal = masks
    assert ragged.shape == (2, 8 + 32) and ragged[0].all()
    assert ragged[1, :5 + 32].all() and not ragged[1, 5 + 32:].any()  # 5 caption tokens, 32 slots, 3 padding
    assert equal is None


def test_lumina2_timestep_counts_steps_from_the_noise():
    """Lumina 2's pipeline passes 1 - t / 1000, rising from 0 (noise) to 1: the adapter's timesteps fall, so a
    trajectory is one trajectory and its steps count up."""
    from tomerge.backbones.lumina2 import Lumina2Adapter

    adapter = Lumina2Adapter(build_lumina2(), None)
    seen = [float(adapter.call_timestep((), {"timestep": torch.tensor([x])})[0]) for x in (0.0, 0.25, 0.5)]
    assert seen == [1.0, 0.75, 0.5]


# (the joint families' probes against their own SDPA calls: the rows' ``joint`` in test_probes.py)
def test_lumina2_probe_equals_the_models_attention(models):
    """float64, from each block's own SDPA call (grouped-query keys repeated as SDPA's ``enable_gqa`` does): the
    refiner's record is the mean over heads and its 64 image queries of their softmax over the image keys; a joint
    layer's is, per sample, what its real caption tokens' queries give its image keys (at that sample's offset:
    captions of 8 and 5 tokens), renormalised, which is test_probes' rule on the sample without its padding."""
    from helpers.probes import record_sdpa, reference_received_attention

    model = copy.deepcopy(models["lumina2"]).double()
    modules = {0: model.noise_refiner[0].attn, 1: model.layers[0].attn, 2: model.layers[1].attn}
    seen, hooks = record_sdpa(modules)
    try:
        with tomerge.merging(model, "idm", ratio=0.5) as handle:
            run(model, to_float64(lumina2_inputs(model)))
            recorded = dict(handle.state.attention)
    finally:
        for hook in hooks:
            hook.remove()
    assert sorted(recorded) == [0, 1, 2]
    for layer, [call] in seen.items():
        q, k, mask, scale = (call[name] for name in ("query", "key", "attn_mask", "scale"))
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)  # 3 query heads per key head
        if layer == 0:  # the image self-attention
            weights = (torch.einsum("bhqd,bhkd->bhqk", q, k) * scale).softmax(-1)  # [B, h, N, N]
            reference = weights.mean(dim=(1, 2))
        else:
            assert mask is not None  # the shorter caption's padding is masked
            reference = torch.cat([reference_received_attention(q[b:b + 1, :, :T + 64], k[b:b + 1, :, :T + 64], None,
                                                                scale, 64, text_first=True)
                                   for b, T in enumerate((8, 5))])
        torch.testing.assert_close(recorded[layer].double(), reference, rtol=1e-5, atol=1e-8)
        assert (reference.max(-1).values - reference.min(-1).values > 1e-3).all()  # not uniform: real q and k
