"""`hunyuan_dit`: Hunyuan-DiT (diffusers `HunyuanDiT2DModel`): a DiT with cross-attention to CLIP and T5 text and
long skip connections (U-ViT style).

Merges every block's self-attention, cross-attention queries and feed-forward, both attentions' RoPE rows gathered.
The second half's blocks fuse a long skip into their input before any merge point, and every block's output is full
length, so the skips are untouched. Details: docs/backbones/hunyuan_dit.md.
"""

from __future__ import annotations

from typing import ClassVar

from ._declared import DeclaredAdapter, Kind, Rope, Site

_ROPE = Rope("image_rotary_emb", 3, "rows")  # image rows only [N, d], by keyword


class HunyuanDiTAdapter(DeclaredAdapter):
    """Adapter for diffusers `HunyuanDiT2DModel` (Hunyuan-DiT v1.0-v1.2); see the module docstring."""

    name: ClassVar[str] = "hunyuan_dit"
    model_class: ClassVar[str] = "HunyuanDiT2DModel"
    timestep_index: ClassVar[int] = 1  # forward(hidden_states, timestep, encoder_hidden_states, ...)
    text_index: ClassVar[int] = 2
    kinds: ClassVar[tuple[Kind, ...]] = (
        Kind("hunyuan_dit", "blocks", ("HunyuanDiTBlock",), (
            Site("attn", "attn1", rope=_ROPE, probe=True),
            Site("crossattn", "attn2", rope=_ROPE),
            Site("mlp", "ff"),
        )),
    )
