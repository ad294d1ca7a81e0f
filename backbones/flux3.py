"""`flux3`: FLUX.3 (diffusers `Flux3Transformer2DModel`): per-mode blocks, then joint single blocks.

Merges the image mode blocks' parallel self-attention and feed-forward (one merge of the normalised image tokens)
and the image part of the single blocks' joint ``[text, image]`` sequence. The text and reference-image mode blocks
are not merged, and a call with reference images runs unmerged. The blocks, RoPE and grid:
docs/backbones/flux3.md.
"""

from __future__ import annotations

from typing import Any, ClassVar

from tomerge.adapter import BlockSpec, MergePoint
from tomerge.state import MergeState

from ._declared import DeclaredAdapter, DeclaredPoint, Kind, Rope, Site
from ._diffusers import call_arg, probe_self_attention

_ROPE = Rope("image_rotary_emb", 2, "rows")  # Flux3Attention.forward(hidden_states, attention_mask, image_rotary_emb)


class Flux3Adapter(DeclaredAdapter):
    """Adapter for diffusers `Flux3Transformer2DModel` (FLUX.3, and its flow-map step-distilled checkpoints); see
    the module docstring."""

    name: ClassVar[str] = "flux3"
    model_class: ClassVar[str] = "Flux3Transformer2DModel"
    t_max: ClassVar[float] = 1.0
    timestep_index: ClassVar[int] = 2  # forward(hidden_states, encoder_hidden_states, timestep, img_ids, txt_ids, ...)
    ids_arg: ClassVar[tuple[str, int]] = ("img_ids", 3)
    kinds: ClassVar[tuple[Kind, ...]] = (
        Kind("mode", "mode_blocks.image", ("Flux3ModeTransformerBlock",), (
            Site("attn", "attn", rope=_ROPE, mask_index=1, probe=True),
            Site("mlp", "ff", arg="x"),
        )),
        Kind("single", "single_transformer_blocks", ("Flux3SingleTransformerBlock",), (
            Site("attn", "attn", tokens="joint", rope=_ROPE, mask_index=1, probe=True),
            Site("mlp", "ff", arg="x", tokens="joint"),
        ), text_arg="encoder_hidden_states", outputs=("encoder_hidden_states", "hidden_states")),
    )

    def call_grid(self, args: tuple, kwargs: dict) -> tuple[int, ...] | None:
        if call_arg(args, kwargs, "image_cond_hidden_states", 5) is not None:
            return None
        return super().call_grid(args, kwargs)

    def unknown_grid_reason(self) -> str:
        return ("it has reference-image tokens (image_cond_hidden_states), or its img_ids are not one raster-ordered "
                "H x W grid")

    def probe(self, block: BlockSpec, point: MergePoint, state: MergeState) -> list[Any]:
        if block.kind == "mode" and isinstance(point, DeclaredPoint) and point.site.probe:
            # Flux3AttnProcessor unflattens the heads before norm_q / norm_k: [B, N, heads, d]
            return probe_self_attention(block, point, state, heads_first=False)
        return super().probe(block, point, state)  # the single blocks' joint attention
