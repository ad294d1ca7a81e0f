"""What the `framepack` adapter (backbones/framepack.py, HunyuanVideo-FramePack) does beyond the family contract: the
history tokens as context, the key mask, the probe's target share. The checks every declared family passes are in
test_family_contract.py; these are the family's own.
"""

from __future__ import annotations

import copy
import math

import torch
from torch import Tensor

import tomerge
from helpers.family import ALL_SUBLAYERS, run, to_float64
from helpers.probes import idm_records, record_sdpa
from helpers.video_families import framepack_history_tokens, framepack_inputs


def test_framepack_history_tokens_are_context_and_the_key_mask_follows_the_target(models):
    """The history tokens pass through the attention at full length and unchanged (they precede any merge in the
    first block), the target tokens are merged, and the key mask over [history, target, text] keeps the history
    and text columns (the second prompt's 3 padding keys stay masked)."""
    model = models["framepack"]
    inputs = framepack_inputs(model)
    P, N, T = framepack_history_tokens((2, 4, 4)), 32, 4 + 8  # text: 4 image tokens + 8 prompt tokens
    attn = model.transformer_blocks[0].attn

    def first_attention_call() -> tuple[Tensor, Tensor]:
        seen = []
        hook = attn.register_forward_pre_hook(lambda m, a, k: seen.append((k["hidden_states"], k["attention_mask"])),
                                              with_kwargs=True)
        try:
            run(model, inputs)
        finally:
            hook.remove()
        return seen[0]

    plain, plain_mask = first_attention_call()
    with tomerge.merging(model, "tomesd", ratio=0.5, use_rand=False, **ALL_SUBLAYERS) as handle:
        merged, mask = first_attention_call()
        assert all(r.num_tokens == N and r.num_removed == N // 2 for r in handle.state.records)
    M = N // 2
    assert plain.shape[1] == P + N and merged.shape[1] == P + M
    assert torch.equal(merged[:, :P], plain[:, :P])
    assert plain_mask.shape == (2, 1, 1, P + N + T) and mask.shape == (2, 1, 1, P + M + T)
    assert mask[0].all() and mask[1, 0, 0, : P + M + T - 3].all() and not mask[1, 0, 0, -3:].any()


def test_framepack_received_attention_is_the_target_keys_share_of_the_text_queries(models):
    """float64: the joint-attention probe's rule (the text queries' softmax over every key, averaged over heads and
    the unmasked text queries) with the history keys attended but not recorded: the target keys' share,
    renormalised, computed here from each attention's own SDPA call over [history, target, text]."""
    model = copy.deepcopy(models["framepack"]).double()
    inputs = to_float64(framepack_inputs(model))
    attentions = {0: model.transformer_blocks[0].attn, 1: model.single_transformer_blocks[0].attn}
    P, N, T = framepack_history_tokens((2, 4, 4)), 32, 4 + 8
    seen, hooks = record_sdpa(attentions)
    recorded = idm_records(model, inputs, hooks)
    assert sorted(recorded) == [0, 1]
    for layer, [call] in seen.items():
        q, k, mask, scale = (call[name] for name in ("query", "key", "attn_mask", "scale"))
        assert k.shape[2] == P + N + T and mask.shape == (2, 1, 1, P + N + T)
        logits = (q @ k.transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scale is None else scale)  # [B, h, L, L]
        p = logits.masked_fill(~mask, -math.inf).softmax(-1)
        reference = []
        for b in range(2):
            text = torch.arange(P + N, P + N + T)[mask[b, 0, 0, P + N:]]  # the text queries the mask keeps
            share = p[b][:, text].mean(dim=(0, 1))[P:P + N]  # [N]: the target keys
            reference.append(share / share.sum())
        reference = torch.stack(reference)
        torch.testing.assert_close(recorded[layer].double(), reference, rtol=1e-5, atol=1e-8)
        history = p[:, :, P + N:, :P].sum(-1)  # the history keys do take part of the text's attention
        assert (history > 1e-3).all()
