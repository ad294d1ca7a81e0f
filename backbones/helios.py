"""`helios`: Helios, long video generation in chunks conditioned on multi-term history (diffusers
`HeliosTransformer3DModel`).

Wan-style blocks over the image stream ``[history, target]``: the model puts the history latents' tokens in front
of the chunk's target tokens. The target (the grid) is merged and the history is context (``block_context``); the
self-attention gets the slot count as ``original_context_length`` (:class:`HistoryAttention`) and the
cross-attention the target alone (:class:`TargetCrossAttention`). The history layout, RoPE and modulation:
docs/backbones/wan.md ("Helios").
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
