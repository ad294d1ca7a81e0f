"""Prompt reweighting (the text-key bias, :mod:`tomerge.text_bias`) on the declared joint text-image families
(``Site(text_keys=True)``: FLUX.2 double and single blocks, Qwen-Image, HunyuanVideo, HunyuanVideo 1.5, AuraFlow,
CogView4, GLM-Image, CogView3-Plus, HiDream, ERNIE-Image; SD3 and FLUX.1 are in
tests/strategies/test_prompt_reweighting.py).

A zero bias (``a_p = 1``, or no token of the phase's category) is bit-identical to no bias; a positive one
changes the output, and every attention call's result (float64 model, the bias in fp32) equals the model's own
q, k, v and mask attended with ``log(a_p)`` added by hand to the biased text keys' logits of the image queries,
which moves their attention toward those keys.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

import tomerge
from tomerge.strategies.sdtm_prompts import token_bias
from helpers.families import FAMILIES
from helpers.probes import record_sdpa

S, D, N = "structure", "detail", "none"
TEXT = {"flux2": 8, "qwenimage": 8, "hunyuan_video": 8, "hunyuan_video15": 16,  # text tokens the blocks attend to
        "auraflow": 16, "cogview4": 8, "glm_image": 8, "cogview3plus": 8, "hidream": 16, "ernie_image": 8}


def biased_attention(call: dict, bias: Tensor, text_first: bool) -> tuple[Tensor, Tensor]:
    """``(softmax(q k^T * scale + mask + b) v, attention weights)`` float64 from one SDPA call's inputs ``[B, h, L,
    d]``, ``b``: ``bias [T]`` on the text keys' logits of the image queries."""
    q, k, v = (call[name].double() for name in ("query", "key", "value"))
    B, h, L, d = q.shape
    T = bias.shape[0]
    logits = torch.einsum("bhqd,bhkd->bhqk", q, k) * (d ** -0.5 if call["scale"] is None else call["scale"])
    mask = call["attn_mask"]
    if mask is not None:
        logits = logits.masked_fill(~mask, -math.inf) if mask.dtype == torch.bool else logits + mask
    text = slice(0, T) if text_first else slice(L - T, L)
    image = slice(T, L) if text_first else slice(0, L - T)
    logits[:, :, image, text] += bias.double()
    weights = logits.softmax(-1)  # [B, h, L, L] (rows of masked text queries: NaN, as the model's)
    return weights @ v, weights


def run(model, inputs: dict) -> Tensor:
    with torch.no_grad():
        return model(**inputs).sample


@pytest.mark.parametrize("name", TEXT)
def test_prompt_reweighting_biases_the_image_queries_toward_the_labelled_text_keys(name):
    family = FAMILIES[name]
    attentions, text_first = family.joint.attentions, family.joint.text_first
    model = family.build().double()
    inputs = {k: v.double() if isinstance(v, Tensor) and v.is_floating_point() else v
              for k, v in family.inputs(model).items()}
    T = TEXT[name]
    labels = ([S, D, N] * T)[:T]
    plain = run(model, inputs)
    options = dict(ratio=0.0, num_steps=10)  # the first call is in the structure phase
    for a_p, rows in ((1.0, [labels]), (2.0, [[D] * T])):  # log 1 = 0; no structure token: a zero bias
        with tomerge.merging(model, "sdtm", prompt_reweight=a_p, text_labels=rows, **options):
            assert torch.equal(run(model, inputs), plain)
    handle = tomerge.apply(model, "sdtm", prompt_reweight=2.0, text_labels=[labels], **options)
    seen, hooks = record_sdpa(attentions(model))
    try:
        reweighted = run(model, inputs)
    finally:
        for hook in hooks:
            hook.remove()
        handle.remove()
    assert (reweighted - plain).abs().max() > 1e-6
    assert torch.equal(run(model, inputs), plain)
    bias = token_bias(labels, S, 2.0)  # [T]: log 2 on the structure tokens
    assert bias.count_nonzero() == T // 3 + (T % 3 > 0)
    for layer, calls in seen.items():
        assert len(calls) == 1
        expected, weights = biased_attention(calls[0], bias, text_first)
        got = calls[0]["out"]
        valid = ~expected.isnan()  # masked text queries attend to nothing: the model's rows are undefined too
        # the bias enters the kernel in fp32 (tomerge.text_bias.key_bias_attention): fp32-rounded logits
        torch.testing.assert_close(got[valid], expected[valid], rtol=1e-6, atol=1e-7)
        plain_out, unbiased = biased_attention(calls[0], torch.zeros(T), text_first)
        assert (got[valid] - plain_out[valid]).abs().max() > 1e-4  # far outside the tolerance above
        L = weights.shape[-1]
        image = slice(T, L) if text_first else slice(0, L - T)
        keys = (torch.arange(T) if text_first else torch.arange(L - T, L))[bias > 0]
        share, before = (w[:, :, image][..., keys].sum(-1) for w in (weights, unbiased))  # [B, h, N]
        assert (share > before).all()  # every image query attends more to the biased text keys
