"""What the `helios` adapter (backbones/helios.py, Helios) does beyond the family contract: the history as context and
the target count, the probe's target share, a model without guidance cross-attention refused. The checks every declared
family passes are in test_family_contract.py; these are the family's own.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import tomerge
from helpers import no_hooks_left
from helpers.family import ALL_SUBLAYERS, check_permutation_is_exact, run, to_float64
from helpers.probes import idm_attention_and_inputs
from helpers.video_families import build_helios, framepack_history_tokens, helios_inputs


def test_helios_history_is_context_and_the_target_count_follows_the_slots():
    """attn1 gets the history tokens unchanged in front of the merged target tokens and, as
    ``original_context_length``, the slot count, so that the amplified history keys are the history's
    (``is_amplify_history``); attn2 gets the merged target tokens alone; the permutation stays exact."""
    model = build_helios(is_amplify_history=True)
    inputs = helios_inputs(model, seed=4)
    P, N, M = framepack_history_tokens((2, 4, 4)), 32, 16
    check_permutation_is_exact(model, inputs, None, N)
    block = model.blocks[0]

    def first_calls() -> dict[str, tuple]:
        """``(tokens, original_context_length)`` the first block's attentions get (after tomerge's hooks)."""
        seen: dict[str, tuple] = {}

        def record(name: str):
            def hook(module: nn.Module, args: tuple) -> None:
                seen[name] = (args[0], args[4])
            return hook

        hooks = [block.attn1.register_forward_pre_hook(record("attn1")),
                 block.attn2.register_forward_pre_hook(record("attn2"))]
        try:
            run(model, inputs)
        finally:
            for h in hooks:
                h.remove()
        return seen

    plain = first_calls()
    with tomerge.merging(model, "tomesd", ratio=0.5, use_rand=False, **ALL_SUBLAYERS) as handle:
        merged = first_calls()
        assert all(r.num_tokens == N and r.num_removed == N - M for r in handle.state.records)
    (x, count), (y, cross_count) = merged["attn1"], merged["attn2"]
    assert plain["attn1"][0].shape[1] == P + N and plain["attn1"][1] == N
    assert x.shape[1] == P + M and count == M and x.shape[1] - count == P  # the processor's history length
    assert torch.equal(x[:, :P], plain["attn1"][0][:, :P])
    assert y.shape[1] == M and plain["attn2"][0].shape[1] == N and cross_count == N  # attn2 ignores the count


def test_helios_received_attention_is_the_target_queries_share_on_the_target_keys(models):
    """float64: the self-attention probe's rule with history keys: every target query's softmax over the history
    and target keys (q and k after the q/k norms, before the RoPE rotation), averaged over heads and target queries,
    restricted to the target keys and renormalised."""
    model = copy.deepcopy(models["helios"]).double()
    inputs = to_float64(helios_inputs(model))
    P, N = framepack_history_tokens((2, 4, 4)), 32
    recorded, seen = idm_attention_and_inputs(model, inputs, [block.attn1 for block in model.blocks])
    assert sorted(recorded) == sorted(seen) == [0, 1]
    for layer, x in seen.items():
        attn = model.blocks[layer].attn1
        assert x.shape[1] == P + N
        with torch.no_grad():
            q = attn.norm_q(attn.to_q(x)).unflatten(2, (attn.heads, -1)).transpose(1, 2)  # [B, h, P + N, d]
            k = attn.norm_k(attn.to_k(x)).unflatten(2, (attn.heads, -1)).transpose(1, 2)
        p = ((q[:, :, P:] @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5).softmax(-1)  # target queries, all keys
        share = p.mean(dim=(1, 2))[:, P:]  # [B, N]
        torch.testing.assert_close(recorded[layer].double(), share / share.sum(-1, keepdim=True), rtol=1e-5,
                                   atol=1e-8)
        assert (p[..., :P].sum(-1) > 1e-3).all()  # the history keys take part of the target's attention


def test_helios_without_guidance_cross_attention_is_refused():
    model = build_helios(guidance_cross_attn=False)
    with pytest.raises(ValueError, match="guidance_cross_attn=False"):
        tomerge.apply(model, "tomesd", ratio=0.5)
    assert no_hooks_left(model)
