"""`helios`: Helios, long video generation in chunks conditioned on multi-term history (diffusers
`HeliosTransformer3DModel`).

Facts from the installed diffusers (0.42.1, ``models/transformers/transformer_helios.py``):

* Wan-style blocks (``HeliosTransformerBlock``, kind ``"helios"``, in ``blocks``) over the image stream
  ``[history, target]``: the model puts the patch embeddings of the history latents (long: 16 frames at patch
  ``(4, 8, 8)``, mid: 2 at ``(2, 4, 4)``, short: the first frame and the last one at ``(1, 2, 2)``) in front of the
  ``N`` target tokens of the chunk (the latent ``hidden_states``), with their rotary rows, and keeps the last ``N``
  tokens. So the adapter's :meth:`~HeliosAdapter.block_context` makes every token beyond the grid, first, context:
  the target tokens (the grid) are merged, the history tokens are context.
* ``attn1(norm1(x), None, None, rotary_emb, original_context_length)``: self-attention over the stream with the RoPE
  table ``[B or 1, P + N, 2d]`` (cos and sin concatenated; ``"batched"`` layout); ``original_context_length`` is the
  target count (the history keys are amplified before it when ``is_amplify_history``): merged calls get the slot
  count (:class:`HistoryAttention`). Received-attention probe: the target queries' attention, the history keys
  attended to, the target keys' share recorded (from q and k before the RoPE rotation and the history
  amplification).
* With ``guidance_cross_attn`` (every released configuration) the block splits the history off before ``attn2``:
  ``attn2`` gets the target tokens alone (:class:`TargetCrossAttention`). ``ffn`` reads the whole stream.
  Modulation is per token (``temb [B, P + N, 6, C]``, the history at timestep 0), applied before the merge points
  and gated after.
* Grid: the target latent ``[B, C, F, H, W]`` divided by ``patch_size = (1, 2, 2)``; the pipelines pass the
  scheduler's timestep (``t_max = 1000``).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from torch import Tensor

from tomerge.plan import MergePlan

from ._context import NO_CONTEXT, ContextTokens, beyond_grid
from ._declared import DeclaredPoint, Kind, Rope, Site
from ._diffusers import call_arg
from ._gather import with_arg
from .wan import WanAdapter


@dataclasses.dataclass(frozen=True, eq=False)
class HistoryAttention(DeclaredPoint):
    """``attn1``, whose ``original_context_length`` (position 4) is the number of target tokens: the slot count in
    merged calls."""

    def merge_arguments(self, args: tuple, kwargs: dict, plan: MergePlan) -> tuple[tuple, dict]:
        args, kwargs = super().merge_arguments(args, kwargs, plan)
        if call_arg(args, kwargs, "original_context_length", 4) is not None:
            args, kwargs = with_arg(args, kwargs, "original_context_length", 4, plan.num_slots)
        return args, kwargs


@dataclasses.dataclass(frozen=True, eq=False)
class TargetCrossAttention(DeclaredPoint):
    """``attn2``, which the block (``guidance_cross_attn``) passes the target tokens alone, without the history."""

    def around(self) -> ContextTokens:
        return NO_CONTEXT


class HeliosAdapter(WanAdapter):
    """Adapter for diffusers `HeliosTransformer3DModel` (Helios); see the module docstring."""

    name: ClassVar[str] = "helios"
    model_class: ClassVar[str] = "HeliosTransformer3DModel"
    kinds: ClassVar[tuple[Kind, ...]] = (
        Kind("helios", "blocks", ("HeliosTransformerBlock",), (
            Site("attn", "attn1", rope=Rope("rotary_emb", 3, "batched"), probe=True, point=HistoryAttention),
            Site("crossattn", "attn2", point=TargetCrossAttention),
            Site("mlp", "ffn"),
        )),
    )

    def block_context(self, kind: Kind, stream: Tensor) -> ContextTokens:
        """The history tokens: every token of the image stream before the call's grid."""
        return beyond_grid(stream, self.grid_size, "first")

    def check(self) -> None:
        super().check()
        if not self.model.config.guidance_cross_attn:
            raise ValueError("tomerge helios: a HeliosTransformer3DModel with guidance_cross_attn=False passes the "
                             "history tokens to attn2 as well; only guidance_cross_attn=True (the released "
                             "configurations) is declared")
