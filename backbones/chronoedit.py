"""`chronoedit`: ChronoEdit, image editing as a two-frame video (diffusers `ChronoEditTransformer3DModel`).

Facts from the installed diffusers (0.42.1, ``models/transformers/transformer_chronoedit.py``):

* A Wan 2.1 image-to-video transformer (the module's own copy of ``WanTransformerBlock``, in ``blocks``; 36 input
  channels: noise, condition latent and mask; CLIP image tokens in front of the UMT5 text): the merge points are
  ``wan``'s.
* Its RoPE differs from Wan's only in time: a 2-frame latent (the input image and the edited image) takes the
  temporal rows ``0`` and ``temporal_skip_len - 1``; the table is still ``[1, N, 1, d]``, gathered per slot.
  With temporal reasoning the pipeline first denoises more frames, then keeps frames ``[0, -1]``: every call has
  its own grid.
* Grid: the latent ``[B, 36, F, H, W]`` divided by ``patch_size = (1, 2, 2)``; the pipeline passes the
  scheduler's timestep (``t_max = 1000``).
"""

from __future__ import annotations

from typing import ClassVar

from .wan import WanAdapter


class ChronoEditAdapter(WanAdapter):
    """Adapter for diffusers `ChronoEditTransformer3DModel` (ChronoEdit-14B); see the module docstring."""

    name: ClassVar[str] = "chronoedit"
    model_class: ClassVar[str] = "ChronoEditTransformer3DModel"
