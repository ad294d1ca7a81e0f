"""`auraflow`: AuraFlow (diffusers `AuraFlowTransformer2DModel`): MMDiT joint blocks, then single-stream blocks.

Merges the image stream of the joint blocks' attention and feed-forward and the image part of the single blocks'
joint ``[text, image]`` sequence. The text stream starts with 8 learned register tokens, counted in the text
length. No RoPE and no mask: positions are learned and added at the patch embedding. Details:
docs/backbones/auraflow.md.
"""

from __future__ import annotations

from typing import ClassVar

from ._declared import DeclaredAdapter, Kind, Site


class AuraFlowAdapter(DeclaredAdapter):
    """Adapter for diffusers `AuraFlowTransformer2DModel` (AuraFlow v0.1-v0.3); see the module docstring."""

    name: ClassVar[str] = "auraflow"
    model_class: ClassVar[str] = "AuraFlowTransformer2DModel"
    t_max: ClassVar[float] = 1.0
    timestep_index: ClassVar[int] = 2  # forward(hidden_states, encoder_hidden_states, timestep, ...)
    kinds: ClassVar[tuple[Kind, ...]] = (
        Kind("joint", "joint_transformer_blocks", ("AuraFlowJointTransformerBlock",), (
            Site("attn", "attn", output=0, probe=True, text_keys=True),
            Site("mlp", "ff", arg="x"),
        ), text_arg="encoder_hidden_states", outputs=("encoder_hidden_states", "hidden_states")),
        Kind("single", "single_transformer_blocks", ("AuraFlowSingleTransformerBlock",), (
            Site("attn", "attn", tokens="joint", probe=True, text_keys=True),
            Site("mlp", "ff", arg="x", tokens="joint"),
        ), joint_input="first"),
    )

    def call_text(self, args: tuple, kwargs: dict) -> int | None:
        """``T`` of the single blocks' ``[text, image]``: the register tokens and the prompt's."""
        text = super().call_text(args, kwargs)
        return None if text is None else text + int(self.model.register_tokens.shape[1])
