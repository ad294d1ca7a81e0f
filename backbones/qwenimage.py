"""`qwenimage`: Qwen-Image (diffusers `QwenImageTransformer2DModel`), MMDiT double-stream blocks.

Merges the image stream of every block's joint ``[text, image]`` attention (its complex image RoPE table gathered,
the text table kept) and the image feed-forward ``img_mlp``. The editing pipelines' reference images (further
``img_shapes`` entries) are context tokens at full length. The merge points, grid and limits:
docs/backbones/qwenimage.md.
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
