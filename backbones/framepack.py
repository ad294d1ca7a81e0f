"""`framepack`: HunyuanVideo-FramePack, image-to-video by next-frame-section prediction (diffusers
`HunyuanVideoFramepackTransformer3DModel`).

HunyuanVideo's blocks and merge points over the image stream ``[history, target]``: the model puts the clean
history latents' tokens in front of the section being generated. The target (the grid) is merged; the history
tokens are context (``block_context``), attended to at full length with their rotary rows and mask columns kept.
The history layout and mask: docs/backbones/hunyuan_video.md ("FramePack").
"""

from __future__ import annotations

from typing import ClassVar

from torch import Tensor

from ._context import ContextTokens, beyond_grid
from ._declared import Kind
from .hunyuan_video import HunyuanVideoAdapter


class FramePackAdapter(HunyuanVideoAdapter):
    """Adapter for diffusers `HunyuanVideoFramepackTransformer3DModel` (FramePack, FramePack-F1); see the module
    docstring."""

    name: ClassVar[str] = "framepack"
    model_class: ClassVar[str] = "HunyuanVideoFramepackTransformer3DModel"

    def block_context(self, kind: Kind, stream: Tensor) -> ContextTokens:
        """The history tokens: every token of the image stream before the call's grid."""
        return beyond_grid(stream, self.grid_size, "first")
