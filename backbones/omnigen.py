"""`omnigen`: OmniGen (diffusers `OmniGenTransformer2DModel`): a Phi-3 style decoder over one sequence of
condition tokens (text, with reference-image tokens in it), a time token and the image tokens.

Facts from the installed diffusers (0.42.1, ``models/transformers/transformer_omnigen.py``):

* The model builds ``[condition, time, image]``: the ``input_ids`` embeddings (with the patch embeddings of any
  input images written over their placeholder tokens), one time token, then the ``N`` tokens of the latent
  being denoised. Every ``OmniGenBlock`` (kind ``"omnigen"``, in ``layers``) runs ``self_attn(hidden_states=x,
  encoder_hidden_states=x, attention_mask, image_rotary_emb)`` (called as ``attn(x, x)``) and ``mlp`` on the
  whole sequence.
* Merge points, on the last ``N`` tokens (the joint sequence's text side is the condition and time tokens, kept:
  reference-image tokens are context, never merged): ``self_attn`` (``"attn"``) and ``mlp`` (``"mlp"``). The
  rotary table ``(cos, sin)`` ``[L, d]`` (from the first sample's position ids) has the image rows last:
  gathered per slot. The attention mask ``[B, 1, L, L]`` (additive; causal over the condition tokens, the time
  and image tokens see every unpadded token) gets its image rows and columns gathered per slot.
* Grid: the latent ``(H0 // p, W0 // p)``. Timesteps: the scheduler's, ``[0, 1000]``.

Received attention (``idm``, the ``sdtm`` schedules): the condition and time tokens attend causally and never
see the image tokens, so the text-query rule of joint attentions has nothing to record. The probe reads the
image queries instead (``Site(probe="sdpa", probe_queries="image")``): at most 64 strided image queries' softmax
over every key (condition, time and image, with the mask's rows of those queries, so padded condition tokens
are no keys), from the processor's SDPA call, averaged over heads and queries, restricted to the image keys and
renormalised per sample.
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
