"""Helpers shared by the adapters of diffusers models (their `Attention` module, pipelines)."""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from tomerge.adapter import BlockSpec, MergePoint
from tomerge.probe import received_attention, split_heads, strided_queries
from tomerge.state import MergeState


def submodel(obj: Any, attr: str, class_name: str) -> nn.Module | None:
    """``obj`` itself if one of its classes is named ``class_name``, else ``obj.<attr>`` if that is."""
    from tomerge.adapter import class_names

    if isinstance(obj, nn.Module) and class_name in class_names(obj):
        return obj
    sub = getattr(obj, attr, None)
    if isinstance(sub, nn.Module) and class_name in class_names(sub):
        return sub
    return None


def probe_self_attention(block: BlockSpec, point: MergePoint, state: MergeState,
                         max_queries: int = 64) -> list[Any]:
    """Records the attention each image token receives in a diffusers self-attention ``Attention``.

    Hooks the query/key projections (or the q/k norms, which run after them) to capture what the
    processor computes anyway; after the attention runs at full length, stores
    ``received_attention`` for the block's layer. Calls where the attention itself was merged are
    not recorded (the keys are slots, not tokens).
    """
    attn = point.module
    q_module = attn.norm_q if getattr(attn, "norm_q", None) is not None else attn.to_q
    k_module = attn.norm_k if getattr(attn, "norm_k", None) is not None else attn.to_k
    captured: dict[str, Tensor] = {}

    def wanted() -> bool:
        call = state.call
        return call is not None and call.where.layer == block.layer and call.decision.merges

    def keep(name: str):
        def hook(module: nn.Module, args: tuple, output: Tensor) -> None:
            if wanted():
                captured[name] = output
        return hook

    def compute(module: nn.Module, args: tuple, output: Any) -> None:
        q, k = captured.pop("q", None), captured.pop("k", None)
        if q is None or k is None or not wanted():
            return
        q = strided_queries(split_heads(q, attn.heads), max_queries)  # [B, H, Q, d]
        k = split_heads(k, attn.heads)  # [B, H, N, d]
        H, W = state.call.grid
        if k.shape[2] != H * W:  # the attention ran on merged slots
            return
        state.store_attention(block.layer, received_attention(q, k, attn.scale))

    return [q_module.register_forward_hook(keep("q")), k_module.register_forward_hook(keep("k")),
            attn.register_forward_hook(compute)]
