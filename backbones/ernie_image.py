"""`ernie_image`: ERNIE-Image (diffusers `ErnieImageTransformer2DModel`): single-stream blocks over a
sequence-first ``[image, text]`` sequence.

Facts from the installed diffusers (0.42.1, ``models/transformers/transformer_ernie_image.py``):

* The model joins ``[image, text]`` sequence-first: ``x [N + T, B, C]`` (``T`` the padded text length, the
  padding masked as keys). Every ``ErnieImageSharedAdaLNBlock`` (kind ``"ernie_image"``, in ``layers``) runs
  ``self_attention(x.permute(1, 0, 2), attention_mask=..., image_rotary_emb=...)`` on the batch-first view and
  ``mlp`` on the sequence-first tensor (:class:`SequenceFirstBlock`, :class:`SequenceFirstPoint`).
* Merge points, on the image part (the first ``N`` tokens): ``self_attention`` (``"attn"``; the rotary table
  ``[B, N + T, 1, d]`` has its image rows first: gathered per slot, the text rows kept; the key mask ``[B, 1, 1,
  N + T]`` gets its image columns gathered) and ``mlp`` (``"mlp"``; its ``[N + T, B, C]`` input and output are
  read sequence-first).
* Grid: the latent ``(H0 // p, W0 // p)`` (patch 1 on the 128-channel latent). Timesteps: the scheduler's,
  ``[0, 1000]``.

Received attention (``idm``, the ``sdtm`` schedules): ``self_attention`` of every block, from its SDPA call
(:func:`~tomerge.backbones._diffusers.probe_sdpa_attention`: ERNIE-Image rotates q/k with its own function), text
queries against all keys with the padding mask, the image keys' share. Prompt reweighting
(``Site(text_keys=True)``): the text keys of ``self_attention``, the padded text last.
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
