"""`skyreels_v2`: SkyReels-V2 text-to-video, image-to-video and diffusion forcing (diffusers
`SkyReelsV2Transformer3DModel`).

Facts from the installed diffusers (0.42.1, ``models/transformers/transformer_skyreels_v2.py``):

* The blocks are Wan's (``SkyReelsV2TransformerBlock``, kind ``"skyreels_v2"``, in ``blocks``):
  ``attn1(norm1(x) * (1 + scale) + shift, None, attention_mask, rotary_emb)`` (self-attention with Wan's 3-D
  RoPE ``(cos, sin)``, each ``[1, N, 1, d]``), ``attn2(norm2(x), encoder_hidden_states, None, None)``
  (cross-attention to UMT5, and to the CLIP image tokens in front of it for image-to-video) and ``ffn``.
  Merge points as in ``wan``: ``attn1`` (``"attn"``, RoPE gathered, received-attention probe), ``attn2``
  (``"crossattn"``), ``ffn`` (``"mlp"``).
* Diffusion forcing (``enable_diffusion_forcing=True``, the ``SkyReelsV2DiffusionForcing*`` pipelines): the
  timestep is per latent frame (``[B, F]``), the modulation per token (``temb [B, 6, N, C]``), applied by the
  block before the merge points and gated after the unmerge; the step is the largest frame timestep.
* Causal blocks (``num_frame_per_block > 1``, set by the pipelines' ``causal_block_size``): ``attn1`` gets a
  block-causal mask ``[1, 1, N, N]`` over the video tokens, gathered per slot on both axes (``mask="pairs"``);
  the received-attention probe reads unmasked attention and so refuses such calls.
* Grid: the latent ``[B, C, F, H, W]`` divided by ``patch_size = (1, 2, 2)``, as Wan's. The pipelines pass the
  scheduler's timestep (``t_max = 1000``).
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
