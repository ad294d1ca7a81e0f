"""`skyreels_v2`: SkyReels-V2 text-to-video, image-to-video and diffusion forcing (diffusers
`SkyReelsV2Transformer3DModel`).

Wan's blocks and merge points. Diffusion forcing's per-frame timesteps and per-token modulation act outside the
merge points; the causal blocks' block-causal self-attention mask is gathered per slot on both axes. Details:
docs/backbones/wan.md ("SkyReels-V2").
"""

from __future__ import annotations

from typing import ClassVar

from ._declared import Kind, Rope, Site
from .wan import WanAdapter


class SkyReelsV2Adapter(WanAdapter):
    """Adapter for diffusers `SkyReelsV2Transformer3DModel` (SkyReels-V2 T2V, I2V, DF); see the module docstring."""

    name: ClassVar[str] = "skyreels_v2"
    model_class: ClassVar[str] = "SkyReelsV2Transformer3DModel"
    kinds: ClassVar[tuple[Kind, ...]] = (
        Kind("skyreels_v2", "blocks", ("SkyReelsV2TransformerBlock",), (
            Site("attn", "attn1", rope=Rope("rotary_emb", 3, "wan"), mask="pairs", probe=True),
            Site("crossattn", "attn2"),
            Site("mlp", "ffn"),
        )),
    )
