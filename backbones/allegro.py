"""`allegro`: Allegro text-to-video (diffusers `AllegroTransformer3DModel`, rhymes-ai/Allegro).

Merges the video tokens of every block's self-attention, cross-attention queries and feed-forward. Allegro's RoPE
looks per-axis tables up with every token's ``(t, h, w)`` position ids, so the ids are gathered per slot (layout
``"allegro"``). The blocks, grid and limits: docs/backbones/allegro.md.
"""

from __future__ import annotations

from typing import ClassVar

from ._declared import DeclaredAdapter, Kind, Rope, Site


class AllegroAdapter(DeclaredAdapter):
    """Adapter for diffusers `AllegroTransformer3DModel` (Allegro T2V); see the module docstring."""

    name: ClassVar[str] = "allegro"
    model_class: ClassVar[str] = "AllegroTransformer3DModel"
    grid_dims: ClassVar[int] = 3
    timestep_index: ClassVar[int] = 2  # forward(hidden_states, encoder_hidden_states, timestep, ...)
    patch_attrs: ClassVar[tuple[str, ...]] = ("patch_size_t", "patch_size", "patch_size")
    kinds: ClassVar[tuple[Kind, ...]] = (
        Kind("allegro", "transformer_blocks", ("AllegroTransformerBlock",), (
            Site("attn", "attn1", rope=Rope("image_rotary_emb", 3, "allegro"), probe=True),
            Site("crossattn", "attn2", mask="pass"),
            Site("mlp", "ff"),
        )),
    )
