"""`auraflow`: AuraFlow (diffusers `AuraFlowTransformer2DModel`): MMDiT joint blocks, then single-stream blocks.

Facts from the installed diffusers (0.42.1, ``models/transformers/auraflow_transformer_2d.py``):

* The model prepends 8 learned register tokens to the projected text: the text stream is ``[registers, text]``
  (``T`` = 8 + the prompt's tokens).
* ``AuraFlowJointTransformerBlock`` (kind ``"joint"``, in ``joint_transformer_blocks``) runs ``attn(hidden_states=
  norm_image, encoder_hidden_states=norm_text)``: the processor projects image and text separately (added
  projections for the text), attends over ``[text, image]`` and returns ``(image, text)``; then ``ff`` on the
  image stream (``ff_context`` on the text). Merge points: ``attn`` (``"attn"``) and ``ff`` (``"mlp"``).
* ``AuraFlowSingleTransformerBlock`` (kind ``"single"``, in ``single_transformer_blocks``) gets the joint
  ``[text, image]`` sequence and runs ``attn`` and ``ff`` on all of it. Merge points, on its image part: ``attn``
  (``"attn"``) and ``ff`` (``"mlp"``).
* No RoPE, no attention mask: positions are a learned table added at the patch embedding (the centre crop of
  a 32 x 32 grid for the released model). Grid: the latent ``(H0 // p, W0 // p)``. Timesteps: the pipeline
  passes ``t / 1000`` (``t_max = 1``).

Received attention (``idm``, the ``sdtm`` schedules): the joint attention ``attn`` of every block
(:func:`~tomerge.backbones._diffusers.probe_joint_attention`: separate text projections in the joint blocks, one
projection of ``[text, image]`` in the single blocks), text queries against all keys, the image keys' share.
Prompt reweighting (``Site(text_keys=True)``): the text keys of ``attn``, registers and prompt first.
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
