"""Received attention: how much attention each image token gets, measured cheaply.

IDM ranks tokens by the attention they receive. The adapter captures the queries and keys that the
block's attention already computed (hooks on the projection submodules, so the attention itself keeps
its fused kernel) and this module turns them into ``a [B, N]``: the softmax attention to every key,
averaged over heads and over a probe set of at most ``max_queries`` strided queries.
"""

from __future__ import annotations

import torch
from torch import Tensor


def split_heads(t: Tensor, heads: int) -> Tensor:
    """``[B, N, H*d] -> [B, H, N, d]``; a tensor already ``[B, H, N, d]`` is returned as is."""
    if t.dim() == 4:
        return t
    B, N, HD = t.shape
    return t.view(B, N, heads, HD // heads).transpose(1, 2)  # [B, H, N, d]


def strided_queries(q: Tensor, max_queries: int = 64) -> Tensor:
    """At most ``max_queries`` evenly strided queries of ``q [B, H, Nq, d]``."""
    stride = max(1, -(-q.shape[2] // max_queries))
    return q[:, :, ::stride]  # [B, H, <=max_queries, d]


def received_attention(q: Tensor, k: Tensor, scale: float) -> Tensor:
    """Mean over heads and queries of ``softmax(q k^T * scale)``.

    Args:
        q: ``[B, H, Q, d]`` probe queries.
        k: ``[B, H, N, d]`` keys (all keys of the attention, so the softmax is the model's own).
        scale: the attention's logit scale (usually ``d ** -0.5``).

    Returns:
        ``[B, N]`` fp32 attention received by every key; each row sums to 1.

    Example:
        >>> q, k = torch.zeros(1, 2, 4, 8), torch.randn(1, 2, 5, 8)
        >>> received_attention(q, k, 8 ** -0.5)   # zero queries attend uniformly
        tensor([[0.2000, 0.2000, 0.2000, 0.2000, 0.2000]])
    """
    B, H, Q, _ = q.shape
    # The scale goes on the small q, and the softmax is done in place on the one [B, H, Q, N] buffer: on
    # CPU, passes over that buffer are the probe's cost (SD3 at N = 4096: 333 text queries, 24 heads).
    logits = (q.float() * scale) @ k.float().transpose(-1, -2)  # [B, H, Q, N]
    logits -= logits.amax(dim=-1, keepdim=True)
    probs = logits.exp_()  # [B, H, Q, N] unnormalised softmax
    weight = probs.sum(dim=-1).reciprocal_().div_(H * Q)  # [B, H, Q]: normalisation and the mean's 1 / (H Q)
    return (weight.view(B, 1, H * Q) @ probs.view(B, H * Q, -1)).squeeze(1)  # [B, N]
