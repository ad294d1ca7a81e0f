"""`pixart`: PixArt-alpha / PixArt-Sigma (diffusers `PixArtTransformer2DModel`).

Blocks: every `BasicTransformerBlock` (``norm_type="ada_norm_single"``) in ``transformer_blocks``.
Each block runs ``attn1`` on ``norm1(x) * (1 + scale) + shift``, then the cross-attention ``attn2``
on the raw hidden states (PixArt applies no norm before it; queries = image tokens, keys/values =
text), then ``ff`` on ``norm2(x) * (1 + scale) + shift``. Merge points:

* ``attn1`` input -> sublayer ``"attn"``;
* ``attn2`` queries -> sublayer ``"crossattn"``: no strategy merges it by default; enable it with
  ``tomerge.apply(..., merge_crossattn=True)``. Its text mask (``encoder_attention_mask``, a bias over
  the keys) broadcasts over any number of queries, so merged queries need nothing else;
* ``ff`` input -> sublayer ``"mlp"``.

Outputs are unmerged before the gated residual. Positions are absolute (sin-cos at the patch
embedding, interpolated for other sizes): no positional work. Grid: ``(H0 // p, W0 // p)``.

Feed-forward chunking works with merging (:class:`~tomerge.backbones._diffusers.FeedForwardPoint`). Not
supported (the call raises with what to do): the rarely used self-attention ``attention_mask`` over image
tokens (the pipelines never pass it; its keys would have to be merged too).

Received attention for ``idm``: strided image queries of ``attn1`` (:func:`probe_self_attention`).
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
