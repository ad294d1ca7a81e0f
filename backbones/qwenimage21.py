"""`qwenimage21`: Qwen-Image 2.1 (diffusers `QwenImage21Transformer2DModel`), single-stream block-causal blocks.

The model attends over one joint sequence ``[prompt (condition images in it), target image]`` block-causally: the
prompt never sees the target. So only the target, the last ``N`` tokens of every block input, is merged (the rest
kept), which changes only the target's keys and queries; the prompt's KV cache is untouched. The layout, masks,
cached steps and received attention: docs/backbones/qwenimage.md ("Qwen-Image 2.1").
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar, Literal

from torch import nn

from ._declared import DeclaredAdapter, DeclaredPoint, Kind, Rope, Site
from ._diffusers import call_arg
from ._host import HostFacts


@dataclasses.dataclass(frozen=True, eq=False)
class KeyValidAttention(DeclaredPoint):
    """``attn``, whose key mask ``key_valid`` (by keyword) is adjusted like its ``attention_mask``."""

    def mask_args(self) -> tuple[tuple[str, int | None], ...]:
        return (*super().mask_args(), ("key_valid", None))


class QwenImage21Adapter(DeclaredAdapter):
    """Adapter for diffusers `QwenImage21Transformer2DModel` (Qwen-Image 2.1, text-to-image and editing); see the
    module docstring."""

    name: ClassVar[str] = "qwenimage21"
    model_class: ClassVar[str] = "QwenImage21Transformer2DModel"
    t_max: ClassVar[float] = 1.0
    timestep_index: ClassVar[int] = 2  # forward(hidden_states, encoder_hidden_states, timestep, img_shapes, img_mask)
    joint_context: ClassVar[Literal["text", "rest"]] = "rest"
    kinds: ClassVar[tuple[Kind, ...]] = (
        Kind("joint", "transformer_blocks", ("QwenImage21TransformerBlock",), (
            # QwenImage21Attention.forward(hidden_states, **kwargs): every other argument by keyword
            Site("attn", "attn", tokens="joint", rope=Rope("rotary_emb", 1, "complex"), mask="keys",
                 mask_index=1, probe="sdpa", probe_queries="image", point=KeyValidAttention),
            Site("mlp", "img_mlp", tokens="joint"),
        ), joint_input="first"),
    )

    def __init__(self, model: nn.Module, options: Any) -> None:
        super().__init__(model, options)
        # whether the first sample's img_mask ends with `slots` image slots: read once per mask tensor and count
        self._ends_with_image = HostFacts(lambda mask, slots: bool(mask[0, -slots:].all()))

    def call_grid(self, args: tuple, kwargs: dict) -> tuple[int, ...] | None:
        shapes = call_arg(args, kwargs, "img_shapes", 3)
        img_mask = call_arg(args, kwargs, "img_mask", 4)  # [B, S] bool: True at image slots (2 x 2 tokens each)
        if not shapes or img_mask is None or any(list(s) != list(shapes[0]) for s in shapes):
            return None
        frames, h, w = shapes[0][-1]  # the target image, last
        slots = math.prod((frames, h, w)) // 4
        if int(frames) != 1 or slots == 0 or not self._ends_with_image(img_mask, slots):
            return None
        return int(h), int(w)

    def unknown_grid_reason(self) -> str:
        return "its img_shapes / img_mask do not end with one single-frame target image shared by the samples"
