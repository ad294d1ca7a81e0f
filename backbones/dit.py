"""`dit`: class-conditional DiT (diffusers `DiTTransformer2DModel`, adaLN-Zero `BasicTransformerBlock`).

Every `BasicTransformerBlock` (``norm_type="ada_norm_zero"``) is one block, in ``transformer_blocks``
order. Merge points: ``attn1`` (self-attention, ``"attn"``: its first positional argument is the
modulated, normalised image tokens) and ``ff`` (``"mlp"``); both outputs are unmerged before the
gated residual. Positions are absolute sin-cos embeddings added at the patch embedding, so merging
needs no positional work. The token grid is ``(H0 // p, W0 // p)`` for a latent ``H0 x W0`` (recorded
by a pre-hook on the model) and patch size ``p``.

Received attention for ``idm``: a strided set of at most 64 image queries against all keys of
``attn1``, from the q/k that its projections computed (:func:`probe_self_attention`).

Feed-forward chunking (``block.set_chunk_feed_forward``) works with merging: in calls that merge the
MLP, :class:`~tomerge.backbones._diffusers.FeedForwardPoint` hands ``ff`` the whole merged sequence and
runs it in the block's chunks (docs/backbones/dit.md).

Note (diffusers 0.42 itself, not tomerge): ``DiTTransformer2DModel.forward`` unpatchifies with
``height = width = sqrt(N)``, so the model only produces meaningful output for square latents.
The adapter's grid is the true ``(H, W)`` in any case.
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
