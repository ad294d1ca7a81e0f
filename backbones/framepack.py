"""`framepack`: HunyuanVideo-FramePack, image-to-video by next-frame-section prediction (diffusers
`HunyuanVideoFramepackTransformer3DModel`).

Facts from the installed diffusers (0.42.1, ``models/transformers/transformer_hunyuan_video_framepack.py``):

* The blocks are HunyuanVideo's (``HunyuanVideoTransformerBlock`` double-stream, then
  ``HunyuanVideoSingleTransformerBlock`` single-stream blocks) with the merge points of ``hunyuan_video``.
* The image stream is ``[history, target]``: the model puts the patch embeddings of the clean history latents
  (``latents_history_4x``, ``latents_history_2x``, ``latents_clean``: the start frame and the frames around the
  section, at 1, 1/2 and 1/4 resolution) in front of the ``N`` target tokens of the section being generated
  (the latent ``hidden_states``), and their rotary rows ``[P, d]`` in front of the target's ``[N, d]``; the output
  is the last ``N`` tokens. So :meth:`~FramePackAdapter.block_context` makes every token beyond the grid, first,
  context: the target tokens (the grid) are merged, the ``P`` history tokens are context: attended to at full length
  and passed through every sublayer as they are, their rotary rows and mask columns kept.
* The attention mask (batches of more than one prompt) is a key mask ``[B, 1, 1, P + N + T]`` over
  ``[history, target, text]`` (the text is SigLIP image tokens, then the prompt): its target columns are gathered.
* Received attention (``idm``): HunyuanVideo's joint-attention probe, with the history tokens among the keys the
  text queries attend to and the target keys' share recorded.
* Grid: the target latent ``[B, C, F, H, W]`` divided by ``(patch_size_t, patch_size, patch_size)``. The
  pipeline passes the scheduler's timestep (``t_max = 1000``).
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
