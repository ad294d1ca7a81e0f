"""`qwenimage`: Qwen-Image (diffusers `QwenImageTransformer2DModel`), MMDiT double-stream blocks.

Facts from the installed diffusers (0.42.1, ``models/transformers/transformer_qwenimage.py``):

* Every ``QwenImageTransformerBlock`` (kind ``"joint"``, in ``transformer_blocks``) runs ``attn(hidden_states=
  img_modulated, encoder_hidden_states=txt_modulated, encoder_hidden_states_mask=..., image_rotary_emb=
  (img_freqs, txt_freqs))``; the processor projects image and text separately, applies RoPE to each with its
  own complex table, attends over ``[text, image]`` and returns ``(image, text)``; then ``img_mlp`` on the
  image stream (``txt_mlp`` on the text). Merge points: ``attn`` (``"attn"``; the image table ``[N, d/2]``
  gathered per slot, the text table kept) and ``img_mlp`` (``"mlp"``).
* The text mask ``encoder_hidden_states_mask`` is joined inside the processor with an all-true image mask of
  the (merged) image length: nothing to adjust. An ``attention_mask`` is refused by the processor itself.
* Grid: ``img_shapes`` (per sample a list of ``(frames, h, w)``, the same for every sample); its first entry is
  the generated image, merged when it is one frame of ``h * w`` tokens. The pipeline calls the model with
  ``timestep / 1000`` (``t_max = 1``).
* Reference images (``QwenImageEditPipeline``, ``QwenImageEditPlusPipeline``): every further entry of
  ``img_shapes`` is an input image whose tokens follow the generated image's in the image stream (and whose
  rows follow its rows in the image RoPE table). They are context tokens (:mod:`tomerge.backbones._context`):
  merged sites merge the target, the reference tokens pass through at full length with their RoPE rows. The
  per-token modulation of ``zero_cond_t`` models (``modulate_index``) is applied by the block before the merge
  points and its gates after the unmerge.
"""

from __future__ import annotations

from typing import ClassVar

import math

from ._context import NO_CONTEXT, ContextTokens
from ._declared import DeclaredAdapter, Kind, Rope, Site
from ._diffusers import call_arg


class QwenImageAdapter(DeclaredAdapter):
    """Adapter for diffusers `QwenImageTransformer2DModel` (Qwen-Image, Qwen-Image-2512); see the module docstring."""

    name: ClassVar[str] = "qwenimage"
    model_class: ClassVar[str] = "QwenImageTransformer2DModel"
    t_max: ClassVar[float] = 1.0
    timestep_index: ClassVar[int] = 3  # forward(hidden_states, encoder_hidden_states, mask, timestep, img_shapes)
    kinds: ClassVar[tuple[Kind, ...]] = (
        Kind("joint", "transformer_blocks", ("QwenImageTransformerBlock",), (
            Site("attn", "attn", output=0, rope=Rope("image_rotary_emb", 3, "qwen"), mask="pass",
                 mask_arg="encoder_hidden_states_mask", mask_index=2, probe=True, text_keys=True),
            Site("mlp", "img_mlp"),
        ), text_arg="encoder_hidden_states", outputs=("encoder_hidden_states", "hidden_states")),
    )

    def call_layout(self, args: tuple, kwargs: dict) -> tuple[tuple[int, ...] | None, ContextTokens]:
        """The generated image's ``(h, w)`` (the first ``img_shapes`` entry) and the reference images' tokens
        (the further entries) as context after it."""
        shapes = call_arg(args, kwargs, "img_shapes", 4)
        if not shapes:
            return None, NO_CONTEXT
        per_sample = [list(s) if isinstance(s, (list, tuple)) and s and isinstance(s[0], (list, tuple)) else [s]
                      for s in shapes]
        first = per_sample[0]
        if (any(s != first for s in per_sample) or any(len(shape) != 3 for shape in first)
                or int(first[0][0]) != 1):
            return None, NO_CONTEXT
        references = sum(math.prod(int(v) for v in shape) for shape in first[1:])  # tokens after the target
        return (int(first[0][1]), int(first[0][2])), ContextTokens(after=references)

    def unknown_grid_reason(self) -> str:
        return "img_shapes is not the same list per sample, starting with a single-frame image"
