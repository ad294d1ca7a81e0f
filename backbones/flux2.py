"""`flux2`: FLUX.2 (diffusers `Flux2Transformer2DModel`): double-stream and parallel single-stream blocks.

Merges the image stream of the double blocks' joint attention and feed-forward, and the image part of the single
blocks' parallel attention-and-MLP (``Flux2ParallelSelfAttention``, one module: with both sublayers on, ``attn``
stays merged and its fused ``to_out`` unmerges once). Reference-image tokens (editing, klein) are context at full
length. The merge points, RoPE, grid from ``img_ids`` and limits: docs/backbones/flux2.md.
"""

from __future__ import annotations

from typing import Any, ClassVar

from torch import nn

from ._context import NO_CONTEXT, ContextTokens
from ._declared import DeclaredAdapter, Kind, Rope, Site
from ._diffusers import call_arg
from ._grid import split_ids
from ._host import HostFacts

_DOUBLE_ROPE = Rope("image_rotary_emb", 3, "rows")  # Flux2Attention.forward(hidden, encoder, mask, rope)
_SINGLE_ROPE = Rope("image_rotary_emb", 2, "rows")  # Flux2ParallelSelfAttention.forward(hidden, mask, rope)


class Flux2Adapter(DeclaredAdapter):
    """Adapter for diffusers `Flux2Transformer2DModel` (FLUX.2 dev / klein); see the module docstring."""

    name: ClassVar[str] = "flux2"
    model_class: ClassVar[str] = "Flux2Transformer2DModel"
    t_max: ClassVar[float] = 1.0
    timestep_index: ClassVar[int] = 2  # forward(hidden_states, encoder_hidden_states, timestep, img_ids, ...)
    kinds: ClassVar[tuple[Kind, ...]] = (
        Kind("double", "transformer_blocks", ("Flux2TransformerBlock",), (
            Site("attn", "attn", output=0, rope=_DOUBLE_ROPE, probe=True, text_keys=True),
            Site("mlp", "ff", arg="x"),
        ), text_arg="encoder_hidden_states", outputs=("encoder_hidden_states", "hidden_states")),
        Kind("single", "single_transformer_blocks", ("Flux2SingleTransformerBlock",), (
            Site("attn", "attn", tokens="joint", rope=_SINGLE_ROPE, mask_index=1, stays_merged_with="mlp", probe=True,
                 text_keys=True),
            Site("mlp", "attn.to_out", arg="input", tokens="joint"),
        ), joint_input="first"),
    )

    def __init__(self, model: nn.Module, options: Any) -> None:
        super().__init__(model, options)
        self._layout = HostFacts(split_ids)  # read once per img_ids tensor

    def call_layout(self, args: tuple, kwargs: dict) -> tuple[tuple[int, ...] | None, ContextTokens]:
        img_ids = call_arg(args, kwargs, "img_ids", 3)
        return self._layout(img_ids) if img_ids is not None else (None, NO_CONTEXT)

    def unknown_grid_reason(self) -> str:
        return "its img_ids hold no raster-ordered H x W grid of the generated image"
