"""`pixart`: PixArt-alpha / PixArt-Sigma (diffusers `PixArtTransformer2DModel`).

Merges the self-attention input, the cross-attention queries (off by default) and the feed-forward input of every
``ada_norm_single`` `BasicTransformerBlock`; positions are absolute, so no positional work, and feed-forward
chunking keeps working (:class:`~tomerge.backbones._diffusers.FeedForwardPoint`). The merge points, received
attention, chunking and limits: docs/backbones/pixart.md.
"""

from __future__ import annotations

from typing import Any, ClassVar

from torch import Tensor, nn

from tomerge.adapter import BlockSpec, KindSummary, MergePoint
from tomerge.state import MergeState

from ._diffusers import FeedForwardPoint, PatchifiedAdapter, call_arg, probe_self_attention


class PixArtAdapter(PatchifiedAdapter):
    """Adapter for diffusers `PixArtTransformer2DModel` (see the module docstring).

    Example (``pipe``: a PixArt-alpha/Sigma pipeline, or the transformer itself):
        >>> import tomerge
        >>> handle = tomerge.apply(pipe, "tomesd", ratio=0.5, merge_crossattn=True)  # doctest: +SKIP
    """

    name: ClassVar[str] = "pixart"
    block_names: ClassVar[tuple[str, ...]] = ("BasicTransformerBlock",)
    model_class: ClassVar[str] = "PixArtTransformer2DModel"
    block_kind: ClassVar[str] = "ada_norm_single"
    timestep_index: ClassVar[int] = 2  # forward(hidden_states, encoder_hidden_states, timestep, ...)

    def merge_points(self, block: nn.Module) -> tuple[MergePoint, ...]:
        points = [MergePoint("attn", block.attn1)]
        if getattr(block, "attn2", None) is not None:
            points.append(MergePoint("crossattn", block.attn2))
        points.append(FeedForwardPoint("mlp", block.ff, block=block))
        return tuple(points)

    def on_model_call(self, args: tuple, kwargs: dict) -> Tensor | float | None:
        if call_arg(args, kwargs, "attention_mask", 5) is not None:
            raise ValueError(
                "tomerge's pixart adapter does not merge with a self-attention attention_mask over image tokens "
                "(PixArt pipelines never pass one; the text mask is encoder_attention_mask, which is fine); "
                "call the transformer without attention_mask, or tomerge.remove() it first")
        return super().on_model_call(args, kwargs)

    @classmethod
    def kind_summaries(cls) -> tuple[KindSummary, ...]:
        return (KindSummary(cls.block_kind, ("attn", "crossattn", "mlp"), context="cross-attention"),)

    @classmethod
    def probed_kinds(cls) -> frozenset[str]:
        return frozenset({cls.block_kind})

    def probe(self, block: BlockSpec, point: MergePoint, state: MergeState) -> list[Any]:
        return probe_self_attention(block, point, state)
