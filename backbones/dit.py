"""`dit`: class-conditional DiT (diffusers `DiTTransformer2DModel`, adaLN-Zero `BasicTransformerBlock`).

Merges the modulated input of every block's self-attention ``attn1`` and feed-forward ``ff``; positions are
absolute sin-cos, so no positional work, and feed-forward chunking keeps working
(:class:`~tomerge.backbones._diffusers.FeedForwardPoint`). The merge points, received attention and diffusers' own
square-latent limit: docs/backbones/dit.md.
"""

from __future__ import annotations

from typing import Any, ClassVar

from torch import nn

from tomerge.adapter import BlockSpec, KindSummary, MergePoint
from tomerge.state import MergeState

from ._diffusers import FeedForwardPoint, PatchifiedAdapter, probe_self_attention


# ---------------------------------------------------------------------- the DiT adapter
class DiTAdapter(PatchifiedAdapter):
    """Adapter for diffusers `DiTTransformer2DModel` (see the module docstring).

    Example (``pipe``: a `DiTPipeline`, or the transformer itself):
        >>> import tomerge
        >>> handle = tomerge.apply(pipe, "tomesd", ratio=0.5)  # doctest: +SKIP
    """

    name: ClassVar[str] = "dit"
    block_names: ClassVar[tuple[str, ...]] = ("BasicTransformerBlock",)
    model_class: ClassVar[str] = "DiTTransformer2DModel"
    block_kind: ClassVar[str] = "adaln_zero"
    timestep_index: ClassVar[int] = 1  # forward(hidden_states, timestep, class_labels, ...)

    def merge_points(self, block: nn.Module) -> tuple[MergePoint, ...]:
        return (MergePoint("attn", block.attn1), FeedForwardPoint("mlp", block.ff, block=block))

    @classmethod
    def kind_summaries(cls) -> tuple[KindSummary, ...]:
        return (KindSummary(cls.block_kind, ("attn", "mlp"), context="class label (adaLN modulation)"),)

    @classmethod
    def probed_kinds(cls) -> frozenset[str]:
        return frozenset({cls.block_kind})

    def probe(self, block: BlockSpec, point: MergePoint, state: MergeState) -> list[Any]:
        return probe_self_attention(block, point, state)
