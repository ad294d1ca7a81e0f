"""`hunyuan_image`: HunyuanImage 2.1 (diffusers `HunyuanImageTransformer2DModel`), HunyuanVideo's block layout on
image latents.

Its double- and single-stream blocks are HunyuanVideo's, with the merge points of :class:`HunyuanVideoAdapter`; the
grid is 2-D (3-D for the refiner). The mask, grid and what the distilled model and the glyph text change:
docs/backbones/hunyuan_video.md ("HunyuanImage 2.1").
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
