"""`ernie_image`: ERNIE-Image (diffusers `ErnieImageTransformer2DModel`): single-stream blocks over a
sequence-first ``[image, text]`` sequence.

Merges the image part (the first ``N`` tokens) of every block's self-attention and MLP. The model keeps its joint
sequence sequence-first, ``[N + T, B, C]``, and transposes it only for the attention, so the block and its MLP point
read that layout (:class:`SequenceFirstBlock`, :class:`SequenceFirstPoint`). The layout, RoPE, mask and received
attention: docs/backbones/ernie_image.md.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from torch import Tensor

from ._declared import DeclaredAdapter, DeclaredBlock, DeclaredPoint, Kind, Rope, Site


@dataclasses.dataclass(frozen=True, eq=False)
class SequenceFirstBlock(DeclaredBlock):
    """A block whose token input ``x`` is sequence-first, ``[L, B, C]``."""

    def tokens(self, args: tuple, kwargs: dict) -> Tensor:
        return super().tokens(args, kwargs).transpose(0, 1)  # [L, B, C] -> [B, L, C]


@dataclasses.dataclass(frozen=True, eq=False)
class SequenceFirstPoint(DeclaredPoint):
    """A submodule (``mlp``) whose input and output are sequence-first, ``[L, B, C]``."""

    def batch_first(self, t: Tensor) -> Tensor:
        return t.transpose(0, 1)


class ErnieImageAdapter(DeclaredAdapter):
    """Adapter for diffusers `ErnieImageTransformer2DModel` (ERNIE-Image, ERNIE-Image-Turbo); see the module
    docstring."""

    name: ClassVar[str] = "ernie_image"
    model_class: ClassVar[str] = "ErnieImageTransformer2DModel"
    timestep_index: ClassVar[int] = 1  # forward(hidden_states, timestep, text_bth, text_lens)
    text_arg: ClassVar[str] = "text_bth"
    text_index: ClassVar[int] = 2
    kinds: ClassVar[tuple[Kind, ...]] = (
        Kind("ernie_image", "layers", ("ErnieImageSharedAdaLNBlock",), (
            Site("attn", "self_attention", tokens="joint", rope=Rope("image_rotary_emb", 3, "batched", text="last"),
                 mask="keys", probe="sdpa", text_keys=True),
            Site("mlp", "mlp", arg="x", tokens="joint", point=SequenceFirstPoint),
        ), arg="x", joint_input="last", joint="last", block=SequenceFirstBlock),
    )
