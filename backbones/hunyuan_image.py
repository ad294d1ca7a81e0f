"""`hunyuan_image`: HunyuanImage 2.1 (diffusers `HunyuanImageTransformer2DModel`), HunyuanVideo's block layout on
image latents.

Facts from the installed diffusers (0.42.1, ``models/transformers/transformer_hunyuanimage.py``):

* ``HunyuanImageTransformerBlock`` (kind ``"double"``) and ``HunyuanImageSingleTransformerBlock`` (kind
  ``"single"``) are HunyuanVideo's blocks (``backbones/hunyuan_video.py``): a joint attention over ``[image,
  text]`` (text LAST) with RoPE ``(cos, sin)`` on the ``[N, d]`` image rows only and a key mask ``[B, 1, 1,
  N + T]`` (the model pads the text mask with the image's ``True`` columns), then ``ff``; the single blocks
  concatenate ``[image, text]`` before their norm, ``proj_mlp`` and ``attn`` read it in parallel, ``proj_out``
  reads ``cat([attn, mlp], -1)``. The same merge points, declared by :class:`HunyuanVideoAdapter`.
* Grid: the latent ``[B, C, H, W]`` (or ``[B, C, F, H, W]`` of the refiner) divided by ``patch_size``, a tuple
  of 2 (or 3) sizes. The pipelines pass the scheduler's timestep (``t_max = 1000``). The distilled model's
  ``timestep_r`` (MeanFlow) and the ByT5 glyph text (``encoder_hidden_states_2``, joined to the text stream
  before the blocks) change nothing here.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from ._declared import Kind
from .hunyuan_video import HunyuanVideoAdapter

_DOUBLE, _SINGLE = HunyuanVideoAdapter.kinds


class HunyuanImageAdapter(HunyuanVideoAdapter):
    """Adapter for diffusers `HunyuanImageTransformer2DModel` (HunyuanImage 2.1, its distilled and refiner models);
    see the module docstring."""

    name: ClassVar[str] = "hunyuan_image"
    model_class: ClassVar[str] = "HunyuanImageTransformer2DModel"
    patch_attrs: ClassVar[tuple[str, ...]] = ("patch_size",)
    kinds: ClassVar[tuple[Kind, ...]] = (
        dataclasses.replace(_DOUBLE, classes=("HunyuanImageTransformerBlock",)),
        dataclasses.replace(_SINGLE, classes=("HunyuanImageSingleTransformerBlock",)),
    )
