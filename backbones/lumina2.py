"""`lumina2`: Lumina-Image 2.0 (diffusers `Lumina2Transformer2DModel`): image and caption refiners, then
single-stream blocks over the joint caption-image sequence.

Merges the image tokens of the noise refiner and the image part of the joint layers (attention, called as
``attn(x, x)``, and feed-forward). Each sample's joint sequence is ``[caption_b, image, padding]`` with only the
caption's real tokens, so the image starts at a per-sample row (a ragged sequence). The layout, masks, timestep
and received attention: docs/backbones/lumina2.md.
"""

from __future__ import annotations

from typing import Any, ClassVar

from torch import nn

from ._declared import DeclaredAdapter, Kind, RaggedText, Rope, SelfKVPoint, Site
from ._diffusers import call_arg
from ._host import HostFacts

_ROPE = Rope("image_rotary_emb", 3, "batched")  # [B, L, d/2] complex, caption rows first, by keyword


class Lumina2Adapter(DeclaredAdapter):
    """Adapter for diffusers `Lumina2Transformer2DModel` (Lumina-Image 2.0); see the module docstring."""

    name: ClassVar[str] = "lumina2"
    model_class: ClassVar[str] = "Lumina2Transformer2DModel"
    t_max: ClassVar[float] = 1.0
    timestep_index: ClassVar[int] = 1  # forward(hidden_states, timestep, encoder_hidden_states, encoder_attention_mask)
    text_index: ClassVar[int] = 2
    kinds: ClassVar[tuple[Kind, ...]] = (
        Kind("refiner", "noise_refiner", ("Lumina2TransformerBlock",), (
            Site("attn", "attn", rope=_ROPE, probe="sdpa", point=SelfKVPoint),
            Site("mlp", "feed_forward", arg="x"),
        )),
        Kind("joint", "layers", ("Lumina2TransformerBlock",), (
            Site("attn", "attn", tokens="joint", rope=_ROPE, mask="keys", probe="sdpa", point=SelfKVPoint),
            Site("mlp", "feed_forward", arg="x", tokens="joint"),
        ), joint_input="first"),
    )

    def __init__(self, model: nn.Module, options: Any) -> None:
        super().__init__(model, options)
        # the caption lengths on the host, read once per mask tensor (the pipeline passes the same one every step)
        self._lengths = HostFacts(lambda mask: mask.sum(dim=1).tolist())

    def call_text(self, args: tuple, kwargs: dict) -> int | RaggedText:
        """The caption length (the real tokens of ``encoder_attention_mask [B, L]``), or per-sample lengths when
        they differ: read on the host once per mask tensor, before the first block."""
        mask = call_arg(args, kwargs, "encoder_attention_mask", 3)  # [B, L]
        lengths = self._lengths(mask)
        if len(set(lengths)) == 1:
            return lengths[0]
        return RaggedText(max(lengths), mask.sum(dim=1))  # [B] on the model's device

    def call_timestep(self, args: tuple, kwargs: dict) -> Tensor | float | None:
        t = super().call_timestep(args, kwargs)
        return None if t is None else 1 - t
