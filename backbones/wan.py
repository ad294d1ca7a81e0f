"""`wan`: Wan 2.1 / 2.2 text-to-video and image-to-video (diffusers `WanTransformer3DModel`).

Merges the video tokens of every block's self-attention (the 3-D RoPE rows gathered per slot), cross-attention
queries and feed-forward; the text (and image-to-video 2.1's CLIP tokens) stay as keys and values. The merge points,
grid, timesteps and Wan 2.2's two experts: docs/backbones/wan.md.
"""

from __future__ import annotations

from typing import ClassVar

from ._declared import DeclaredAdapter, Kind, Rope, Site


class WanAdapter(DeclaredAdapter):
    """Adapter for diffusers `WanTransformer3DModel` (Wan 2.1/2.2 T2V, I2V, TI2V); see the module docstring."""

    name: ClassVar[str] = "wan"
    model_class: ClassVar[str] = "WanTransformer3DModel"
    grid_dims: ClassVar[int] = 3
    timestep_index: ClassVar[int] = 1  # forward(hidden_states, timestep, encoder_hidden_states, ...)
    text_index: ClassVar[int] = 2
    kinds: ClassVar[tuple[Kind, ...]] = (
        Kind("wan", "blocks", ("WanTransformerBlock",), (
            Site("attn", "attn1", rope=Rope("rotary_emb", 3, "wan"), probe=True),
            Site("crossattn", "attn2"),
            Site("mlp", "ffn"),
        )),
    )
