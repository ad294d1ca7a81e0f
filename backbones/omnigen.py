"""`omnigen`: OmniGen (diffusers `OmniGenTransformer2DModel`): a Phi-3 style decoder over one sequence of
condition tokens (text, with reference-image tokens in it), a time token and the image tokens.

Merges the last ``N`` tokens, the image being generated, in every block's attention and MLP; the condition and time
tokens (reference images included) are kept. They attend causally and never see the image, so received attention
is read from the image queries. The sequence, RoPE and mask: docs/backbones/omnigen.md.
"""

from __future__ import annotations

from typing import ClassVar

from ._declared import DeclaredAdapter, Kind, Rope, SelfKVPoint, Site
from ._diffusers import call_arg


class OmniGenAdapter(DeclaredAdapter):
    """Adapter for diffusers `OmniGenTransformer2DModel` (OmniGen v1); see the module docstring."""

    name: ClassVar[str] = "omnigen"
    model_class: ClassVar[str] = "OmniGenTransformer2DModel"
    timestep_index: ClassVar[int] = 1  # forward(hidden_states, timestep, input_ids, input_img_latents, ...)
    kinds: ClassVar[tuple[Kind, ...]] = (
        Kind("omnigen", "layers", ("OmniGenBlock",), (
            Site("attn", "self_attn", tokens="joint", rope=Rope("image_rotary_emb", 3, "rows"), mask="pairs",
                 probe="sdpa", probe_queries="image", point=SelfKVPoint),
            Site("mlp", "mlp", tokens="joint"),
        ), joint_input="first"),
    )

    def call_text(self, args: tuple, kwargs: dict) -> int:
        """``T``: the condition tokens and the time token before the image."""
        input_ids = call_arg(args, kwargs, "input_ids", 2)
        return (0 if input_ids is None else int(input_ids.shape[1])) + 1
