"""`kandinsky5`: Kandinsky 5.0 video (text- and image-to-video; diffusers `Kandinsky5Transformer3DModel`).

Merges the video tokens of every visual block's self-attention (3-D RoPE rotation matrices gathered),
cross-attention queries and feed-forward; the text blocks, which refine the prompt alone, are not merged. The
received-attention probe reads the per-head q/k norms (:meth:`Kandinsky5Adapter.probe`); calls with sparse "nabla"
attention are not merged. The blocks, RoPE, grid and limits: docs/backbones/kandinsky5.md.
"""

from __future__ import annotations

from typing import Any, ClassVar

from tomerge.adapter import BlockSpec, MergePoint
from tomerge.probe import attention_probe, received_self_attention
from tomerge.state import MergeState

from ._declared import DeclaredAdapter, DeclaredPoint, Kind, Rope, Site
from ._diffusers import call_arg


class Kandinsky5Adapter(DeclaredAdapter):
    """Adapter for diffusers `Kandinsky5Transformer3DModel` (Kandinsky 5.0 T2V / I2V); see the module docstring."""

    name: ClassVar[str] = "kandinsky5"
    model_class: ClassVar[str] = "Kandinsky5Transformer3DModel"
    grid_dims: ClassVar[int] = 3
    # forward(hidden_states, encoder_hidden_states, timestep, pooled_projections, visual_rope_pos, text_rope_pos,
    #         scale_factor, sparse_params)
    timestep_index: ClassVar[int] = 2
    kinds: ClassVar[tuple[Kind, ...]] = (
        Kind("kandinsky5", "visual_transformer_blocks", ("Kandinsky5TransformerDecoderBlock",), (
            Site("attn", "self_attention", rope=Rope("rotary_emb", 3, "wan"), probe=True),  # probe(): its norms
            Site("crossattn", "cross_attention"),
            Site("mlp", "feed_forward"),
        ), arg="visual_embed"),
    )

    def call_grid(self, args: tuple, kwargs: dict) -> tuple[int, ...] | None:
        if call_arg(args, kwargs, "sparse_params", 7) is not None:
            return None
        latent = call_arg(args, kwargs, "hidden_states", 0)  # [B, F, H, W, C]
        return tuple(int(size) // int(p) for size, p in zip(latent.shape[1:4], self.model.config.patch_size))

    def unknown_grid_reason(self) -> str:
        return "it uses sparse (nabla) attention: fractal token order and a block mask over the full sequence"

    def probe(self, block: BlockSpec, point: MergePoint, state: MergeState) -> list[Any]:
        """The received-attention probe of the probed site, ``self_attention`` (the declared one reads
        ``to_q``/``to_k``); the image stream's context tokens are keys, not recorded."""
        if not isinstance(point, DeclaredPoint) or not point.site.probe:
            return super().probe(block, point, state)
        attn = point.module
        heads_first = lambda out: out.transpose(1, 2)  # noqa: E731  the norms' [B, L, heads, d] -> [B, heads, L, d]
        sources = [("q", attn.query_norm, heads_first), ("k", attn.key_norm, heads_first)]
        scale = attn.query_norm.normalized_shape[0] ** -0.5

        def compute(captured: dict[str, Any], grid: tuple[int, ...]) -> Any:
            around = point.around()  # the block call's context tokens (Kandinsky 6's reference frame)
            return received_self_attention(captured, grid, attn.num_heads, scale, context=(around.before, around.after))

        return attention_probe(state, attn, sources, compute)
