"""`wan_animate`: Wan 2.2 Animate, character animation and replacement from a pose and a face video (diffusers
`WanAnimateTransformer3DModel`).

Facts from the installed diffusers (0.42.1, ``models/transformers/transformer_wan_animate.py``):

* The blocks are Wan's (the module's own copy of ``WanTransformerBlock``, in ``blocks``): the merge points are
  ``wan``'s (``attn1`` with the ``[1, N, 1, d]`` RoPE table, ``attn2`` to UMT5 and CLIP image tokens, ``ffn``).
* The pose latents are added to the patch embedding of every frame after the first (the reference frame)
  before the first block. The face adapter (``face_adapter[i]``, a cross-attention from the video tokens to the
  face-motion tokens, frame-aligned: ``N`` must divide into the motion frames) runs between blocks, after
  every ``inject_face_latents_blocks``-th block, on the full-length video tokens that the blocks return: it is
  not merged and needs nothing.
* Grid: the latent ``[B, 2C + 4, F + 1, H, W]`` (noise, reference and mask channels; the reference frame first)
  divided by ``patch_size = (1, 2, 2)``. The pipeline passes the scheduler's timestep (``t_max = 1000``).
"""

from __future__ import annotations

from typing import ClassVar

from .wan import WanAdapter


class WanAnimateAdapter(WanAdapter):
    """Adapter for diffusers `WanAnimateTransformer3DModel` (Wan 2.2 Animate); see the module docstring."""

    name: ClassVar[str] = "wan_animate"
    model_class: ClassVar[str] = "WanAnimateTransformer3DModel"
